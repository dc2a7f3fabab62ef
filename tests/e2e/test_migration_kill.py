"""A migration killed with SIGKILL at any statement leaves the SQLite file as it was,
and a rerun completes (issue 41: a `synthq run` killed during its first migration
failed every rerun with ``table workers already exists`` and the like).

The kills are real: a process that migrates is killed -9 right after its K-th write
statement (CREATE, ALTER, DROP, INSERT, UPDATE, DELETE), for kill points sampled over
the whole migration (the first, the last, and random ones between; ``SYNTHQ_KILL_SEED``
replays a failure's sample). Each killed process is a fork of one process that
imported synthq once, so a dozen kills take seconds.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support import REPO, child_env, run_cli

pytestmark = pytest.mark.e2e

#: A statement that writes (the kill points are counted over these).
_WRITE = r"^\s*(CREATE|ALTER|DROP|INSERT|UPDATE|DELETE)\b"

#: The migrating process: reads ``URL K`` lines, forks a child per line that runs
#: synthq.store.migrate.upgrade(URL) and kills itself with SIGKILL after its K-th write
#: statement (K=0: it runs to the end and prints how many writes it made), and prints
#: the child's fate (``killed``, ``exit N``) and, for K=0, the count.
ZYGOTE = rf"""
import os, re, signal, sys
from sqlalchemy import event
from sqlalchemy.engine import Engine
import alembic.command, alembic.migration, alembic.operations, alembic.script  # noqa
import synthq.spec.config, synthq.store.models  # noqa
from synthq.store.migrate import upgrade

WRITE = re.compile({_WRITE!r}, re.I)

def child(url, kill_at):
    seen = [0]

    @event.listens_for(Engine, "after_cursor_execute")
    def count(conn, cursor, statement, *args):
        if WRITE.match(statement):
            seen[0] += 1
            if seen[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    try:
        upgrade(url)
    except BaseException as exc:
        print(f"ERROR {{exc!r}}"[:300], flush=True)
        os._exit(3)
    print(f"WRITES {{seen[0]}}", flush=True)
    os._exit(0)

print("READY", flush=True)
for line in sys.stdin:
    url, kill_at = line.split()
    pid = os.fork()
    if pid == 0:
        child(url, int(kill_at))
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        print(f"killed {{os.WTERMSIG(status)}}", flush=True)
    else:
        print(f"exit {{os.WEXITSTATUS(status)}}", flush=True)
"""


class Migrator:
    """The forking migrator process (ZYGOTE) and one request at a time."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], cwd=REPO, env=child_env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._line() == "READY"

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        assert line, f"the migrator died (exit {self.proc.poll()})"
        return line

    def migrate(self, db: Path, kill_at: int = 0) -> list[str]:
        """Migrate ``db`` in a fresh child killed after write ``kill_at`` (0: never); the
        child's lines, its fate last."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"sqlite:///{db} {kill_at}\n")
        self.proc.stdin.flush()
        lines = [self._line()]
        while not lines[-1].startswith(("killed", "exit")):
            lines.append(self._line())
        return lines

    def writes(self, db: Path) -> int:
        """How many write statements migrating ``db`` (a copy of it) takes."""
        lines = self.migrate(db)
        assert lines[-1] == "exit 0", lines
        return int(lines[0].split()[1])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def migrator() -> Iterator[Migrator]:
    m = Migrator()
    yield m
    m.close()


def kill_points(total: int, extra: int) -> tuple[list[int], int]:
    """The first and last write and ``extra`` random ones between; and the seed."""
    seed = int(os.environ.get("SYNTHQ_KILL_SEED") or random.SystemRandom().randrange(1 << 30))
    middle = random.Random(seed).sample(range(2, total), min(extra, max(0, total - 2)))
    return sorted({1, total, *middle}), seed


def wal_file(db: Path) -> None:
    """An empty file in WAL mode, as `synthq run` leaves it before it migrates."""
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.close()


def schema(db: Path) -> list[tuple[str, str]]:
    """The file's tables, indexes and triggers (type, name), and its revision."""
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute("SELECT type, name FROM sqlite_master "
                            "WHERE name NOT LIKE 'sqlite_%' ORDER BY type, name").fetchall()
        if ("table", "alembic_version") in rows:
            rows += conn.execute("SELECT 'revision', version_num FROM alembic_version").fetchall()
        return rows
    finally:
        conn.close()


def test_a_new_database_killed_at_any_statement_is_left_empty_and_rerun_completes(
        migrator: Migrator, tmp_path: Path) -> None:
    from synthq.store.migrate import HEAD, upgrade

    probe = tmp_path / "probe.db"
    wal_file(probe)
    total = migrator.writes(probe)
    whole = schema(probe)
    assert ("revision", HEAD) in whole and ("trigger", "synthq_samples_inserted") in whole
    points, seed = kill_points(total, 5)
    for k in points:
        db = tmp_path / f"fresh-{k}.db"
        wal_file(db)
        fate = migrator.migrate(db, k)
        assert fate[-1] == "killed 9", (k, fate)
        assert schema(db) == [], f"killed after write {k} of {total} (seed {seed}): " \
                                 f"the file holds {schema(db)}"
        upgrade(f"sqlite:///{db}")  # the rerun
        assert schema(db) == whole, f"rerun after a kill at write {k} (seed {seed})"


#: An embedded job's rows at revision OLD: one job, 40 samples (25 done, with their
#: answers and calls), written with the columns that revision has.
OLD = "0009"


def _old_rows(db: Path) -> None:
    now = "2026-11-30 12:00:00.000000"
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(
            "INSERT INTO jobs (id, name, model, servers, sampling, extra_body, max_tokens, "
            "total_timeout, stall_timeout, max_attempts, backoff_base, backoff_cap, "
            "inflight_limit, keep_truncated, state, dataset, created_at, updated_at) VALUES "
            "(1, 'old-job', 'm', '[\"http://127.0.0.1:9/v1\"]', '{}', '{}', 64, 1800, 300, 5, "
            "1, 60, 8, 0, 'active', 'prompts.jsonl', ?, ?)", (now, now))
        for i in range(40):
            done = i < 25
            conn.execute(
                "INSERT INTO samples (id, job_id, content_key, dataset_index, prompt, state, "
                "attempts, created_at, updated_at, response_content, finish_reason, "
                "completion_tokens) VALUES (?, 1, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (i + 1, f"key{i:04d}", i, json.dumps([{"role": "user", "content": f"p {i}"}]),
                 "done" if done else "pending", int(done), now, now,
                 f"answer {i}" if done else None, "stop" if done else None,
                 7 if done else None))
            if done:
                conn.execute("INSERT INTO attempts (sample_id, server, started_at, outcome, "
                             "completion_tokens) VALUES (?, 'http://127.0.0.1:9/v1', ?, 'ok', 7)",
                             (i + 1, now))
    conn.close()


def _rows(db: Path) -> dict[str, Any]:
    """What must survive the upgrade: the rows, and the counters the upgrade fills."""
    conn = sqlite3.connect(db)
    try:
        out: dict[str, Any] = {
            "jobs": conn.execute("SELECT id, name, state FROM jobs").fetchall(),
            "samples": conn.execute("SELECT id, job_id, state, response_content, prompt "
                                    "FROM samples ORDER BY id").fetchall(),
            "attempts": conn.execute("SELECT sample_id, outcome FROM attempts "
                                     "ORDER BY id").fetchall(),
        }
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
        if "sample_counts" in tables:
            out["counted"] = conn.execute("SELECT state, sum(n) FROM sample_counts "
                                          "GROUP BY state ORDER BY state").fetchall()
            assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        return out
    finally:
        conn.close()


def test_an_old_database_killed_mid_upgrade_keeps_its_revision_and_rows(
        migrator: Migrator, tmp_path: Path) -> None:
    from synthq.store.migrate import HEAD, upgrade

    template = tmp_path / "old.db"
    upgrade(f"sqlite:///{template}", OLD, from_models=False)
    _old_rows(template)
    before_schema, before = schema(template), _rows(template)
    assert ("revision", OLD) in before_schema

    def copy(name: str) -> Path:
        db = tmp_path / name
        shutil.copyfile(template, db)
        return db

    probe = copy("probe.db")
    total = migrator.writes(probe)
    whole = schema(probe)
    assert ("revision", HEAD) in whole
    after = _rows(probe)
    assert after["counted"] == [("done", 25), ("pending", 15)]
    assert {k: after[k] for k in before} == before
    points, seed = kill_points(total, 5)
    for k in points:
        db = copy(f"old-{k}.db")
        fate = migrator.migrate(db, k)
        assert fate[-1] == "killed 9", (k, fate)
        where = f"killed after write {k} of {total} (seed {seed})"
        assert schema(db) == before_schema, f"{where}: the file is not as it was"
        assert _rows(db) == before, where
        upgrade(f"sqlite:///{db}")  # the rerun
        assert schema(db) == whole, f"rerun, {where}"
        assert _rows(db) == after, f"rerun, {where}"


#: `synthq run` under a kill hook: SIGKILL after the migration's write SYNTHQ_KILL_AT.
RUN_KILLED = rf"""
import os, re, runpy, signal, sys
from sqlalchemy import event
from sqlalchemy.engine import Engine
import synthq.store.migrate

WRITE = re.compile({_WRITE!r}, re.I)
state = {{"on": False, "n": 0}}
kill_at = int(os.environ["SYNTHQ_KILL_AT"])

@event.listens_for(Engine, "after_cursor_execute")
def count(conn, cursor, statement, *args):
    if state["on"] and WRITE.match(statement):
        state["n"] += 1
        if state["n"] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

real = synthq.store.migrate.upgrade

def upgrade(*args, **kwargs):
    state["on"] = True
    try:
        return real(*args, **kwargs)
    finally:
        state["on"] = False

synthq.store.migrate.upgrade = upgrade
sys.argv = ["synthq", *sys.argv[1:]]
runpy.run_module("synthq.cli", run_name="__main__")
"""


def test_synthq_run_killed_during_its_first_migration_reruns_to_the_end(
        simulator: Callable[..., Any], migrator: Migrator, tmp_path: Path) -> None:
    """The issue's repro: a 40-row dataset, a fresh SYNTHQ_DATABASE_URL, `synthq run`
    killed -9 half-way through its migration, then the same command again."""
    sim = simulator("--latency", "0")
    probe = tmp_path / "probe.db"
    wal_file(probe)
    half = migrator.writes(probe) // 2
    dataset = tmp_path / "p.jsonl"
    dataset.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"kill prompt {i}"}]}) + "\n"
        for i in range(40)))
    db = tmp_path / "run.db"
    env = child_env(SYNTHQ_DATA_DIR=str(tmp_path / "data"), SYNTHQ_BROKER_URL="",
                    SYNTHQ_DATABASE_URL=f"sqlite:///{db}")
    args = ["run", "--dataset", str(dataset), "--server", sim.url, "--model", "sim-model",
            "--max-tokens", "64", "--json"]
    killed = subprocess.run([sys.executable, "-c", RUN_KILLED, *args], cwd=REPO,
                            env={**env, "SYNTHQ_KILL_AT": str(half)}, capture_output=True,
                            text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    again = run_cli(*args, env=env, check=False)
    assert again.returncode == 0, again.stderr[-2000:]
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert summary["counts"]["done"] == 40 and summary["finished"]
