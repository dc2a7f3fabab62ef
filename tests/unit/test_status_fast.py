"""`synthq status` on the embedded default answers from sqlite3 (synthq.cli.fast) with
exactly the status the ordinary path (SQLAlchemy) computes, figure by figure.

One SQLite database holds a rich job, built through synthq's own functions:
samples in every state, failures of several classes, retries waiting, a
conversation cut short, calls with tokens over the last minutes (the cost
report, with a GPU-hour price and 2 GPUs, and a fold of busy time to store),
an ``--inflight auto`` job with a server's limit history, a live and a dead
worker, a server failing its health probe, ``--regenerate all`` turn counts,
and a tokenizer with stale examples and token sums. The database is copied;
the ordinary path reads one copy and the fast path the other, at the same
frozen ``now`` (so rates, ETA, heartbeat ages and the projection are the
same numbers): the two statuses must be equal, and so must the folds they
stored. Then again 30 s later (the fold is fresh: read, not written) and
200 s later (it moves on).
"""

from __future__ import annotations

import os
import secrets
import sqlite3
from collections.abc import Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from support import _reset_process_state

from synthq.cli import fast
from synthq.core.enums import JobState
from synthq.data.dataset import Row
from synthq.jobs.enqueue import EnqueueReport, JobSpec, find_job, get_or_create_job
from synthq.jobs.samplecopy import insert_rows
from synthq.queue import jobs, states
from synthq.queue.dispatch import Dispatched, dispatch
from synthq.store.db import session_scope, utcnow
from synthq.views.report import job_status

A, B = "http://127.0.0.1:9/v1", "http://127.0.0.1:10/v1"
CONVERSATION = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"},
                {"role": "user", "content": "q3"}, {"role": "assistant", "content": "a3"}]


def _use(monkeypatch: pytest.MonkeyPatch, db: Path) -> None:
    """The embedded default on ``db``: no SYNTHQ_ setting but the database's."""
    import os

    for key in [k for k in os.environ if k.startswith("SYNTHQ_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SYNTHQ_DATABASE_URL", f"sqlite:///{db}")
    _reset_process_state()


@pytest.fixture
def built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, datetime]]:
    """The database with the rich job ``rich``, and the time it was built at."""
    from synthq.store.migrate import upgrade

    db = tmp_path / "built.db"
    _use(monkeypatch, db)
    upgrade(f"sqlite:///{db}")
    now = utcnow()
    _build(now)
    yield db, now
    _reset_process_state()


def _attempt(d: Dispatched, outcome: str, start: datetime, seconds: float,
             tokens: int | None) -> dict[str, Any]:
    return dict(sample_id=d.sample_id, server=d.server, worker="w", started_at=start,
                ended_at=start + timedelta(seconds=seconds), outcome=outcome,
                latency_s=seconds, completion_tokens=tokens)


def _build(now: datetime) -> None:
    from sqlalchemy import text

    from synthq.queue.workers import heartbeat
    from synthq.serving.adaptive import _save
    from synthq.serving.health import _record

    spec = JobSpec(name="rich", model="m", servers=[A, B], max_tokens=16, inflight_limit=40,
                   inflight_auto=True, min_inflight=2, gpus=2, gpu_hour_price=2.5,
                   tokenizer="some/tokenizer", regenerate="all", max_attempts=3)
    with session_scope() as s:
        job, _, _ = get_or_create_job(s, spec)
        job_id, settings = job.id, job.generation_settings()
    rows = [Row(i, [{**m, "content": f"{m['content']} #{i}"} for m in CONVERSATION])
            for i in range(30)]
    insert_rows(job_id, settings, rows, EnqueueReport(job_id=job_id, job_name="rich",
                                                      created=True), regenerate="all")
    taken: list[Dispatched] = []
    dispatch(taken.extend, job_ids=[job_id], capacity=24)  # 6 stay pending
    token = secrets.token_hex(16)
    with session_scope() as s:
        states.claim_batch(s, [(d.sample_id, d.token) for d in taken], new_token=token,
                           lease_until=now + timedelta(minutes=5), worker="w",
                           now=now - timedelta(minutes=10))
    with session_scope() as s:
        for i, d in enumerate(taken):
            # Calls spread over the last 10 minutes, overlapping on each server; the last
            # round's answers within the last minute (the projection's rate).
            kind, round_ = i % 8, i // 8
            start = now - timedelta(seconds=600 - 23 * i if round_ < 2 else 50 - i)
            if kind in (0, 1, 2):  # done: inside the rate window or not, with an example
                states.complete(s, d.sample_id, token, now=start + timedelta(seconds=30),
                                attempt=_attempt(d, "ok", start, 30, 40 + i),
                                response_content="an answer", completion_tokens=40 + i,
                                num_tokens=100 + i, num_supervised=20 + i,
                                tokenize_version=1, token_mismatch=i % 2 == 0, turn=3)
            elif kind == 3:  # one turn answered, the next one due
                states.advance_turn(s, d.sample_id, token, turn=1,
                                    turns=[{"content": "a", "completion_tokens": 9}],
                                    now=start + timedelta(seconds=5),
                                    attempt=_attempt(d, "ok", start, 5, 9))
            elif kind == 4:  # waiting to retry, by class
                states.retry(s, d.sample_id, token, next_attempt_at=now + timedelta(hours=1),
                             error_class="timeout" if round_ else "rate_limited",
                             error_message="slow", now=start + timedelta(seconds=60),
                             attempt=_attempt(d, "timeout" if round_ else "rate_limited",
                                              start, 60, None))
            elif kind == 5:  # failed: a request error, or a tokenization one (answered)
                if round_:
                    states.fail(s, d.sample_id, token, error_class="bad_request",
                                error_message="no", now=start + timedelta(seconds=1),
                                attempt=_attempt(d, "bad_request", start, 1, None))
                else:
                    states.store_response(s, d.sample_id, token, now=start,
                                          response_content="x",
                                          attempt=_attempt(d, "ok", start, 2, 12))
                    states.fail(s, d.sample_id, token, error_class="mask_mismatch",
                                error_message="mask", now=start + timedelta(seconds=3))
            elif kind == 6:  # skipped: nothing left to learn
                states.store_response(s, d.sample_id, token, now=start, response_content="y",
                                      attempt=_attempt(d, "ok", start, 2, 7))
                states.skip(s, d.sample_id, token, error_class="no_supervised_tokens",
                            error_message="empty", now=start + timedelta(seconds=3))
            # kind 7: still running (busy until now), started by the claim
        ids = [d.sample_id for d in taken]
        s.execute(text("UPDATE samples SET started_at = :at WHERE id IN (:a, :b, :c)"),
                  {"at": (now - timedelta(seconds=20)).replace(tzinfo=None),
                   "a": ids[7], "b": ids[15], "c": ids[23]})
        # A conversation cut after its second turn; one example already at version 2.
        s.execute(text("UPDATE samples SET cut_at_turn = 1, turn = 2 WHERE id = :id"),
                  {"id": ids[0]})
        s.execute(text("UPDATE samples SET tokenize_version = 2 WHERE id = :id"),
                  {"id": ids[1]})
        s.execute(text("UPDATE jobs SET tokenize_version = 2 WHERE id = :id"), {"id": job_id})
        # Server A: an adaptive limit with history; B fails its probe (twice).
        _save(s, A, now - timedelta(seconds=3), 24, 30, "24 ↓ ttft 4.1 s = 3× baseline", {},
              [[now.timestamp() - 2, 20, 150.0, 1.5], [now.timestamp() - 1, 24, 160.0, 1.7]])
        _record(s, B, "ConnectError: refused")
        _record(s, B, "ConnectError: refused")
        heartbeat(s, "host:1:live", capacity=8, inflight=3, now=now - timedelta(seconds=2))
        heartbeat(s, "host:2:dead", capacity=8, inflight=0, now=now - timedelta(minutes=5))
        jobs.set_job_state(s, job_id, JobState.PAUSED, now=now, reason="http://x (no /v1)")


def _copy(src: Path, dst: Path) -> Path:
    with sqlite3.connect(src) as a, sqlite3.connect(dst) as b:
        a.backup(b)
    a.close()
    b.close()
    return dst


def _ordinary(monkeypatch: pytest.MonkeyPatch, db: Path, now: datetime) -> dict[str, Any]:
    _use(monkeypatch, db)
    with session_scope() as s:
        return job_status(s, find_job(s, "rich"), now=now).to_dict()


def _fast(monkeypatch: pytest.MonkeyPatch, db: Path, now: datetime) -> dict[str, Any]:
    _use(monkeypatch, db)
    status = fast.job_status("rich", now=now)
    assert status is not None, "the fast path declined"
    return status.to_dict()


def _fold(db: Path) -> tuple[Any, ...]:
    with sqlite3.connect(db) as conn:
        row = conn.execute("SELECT busy_until, busy_folded FROM jobs").fetchone()
    conn.close()
    return tuple(row)


def test_the_fast_status_equals_the_ordinary_one(
        built: tuple[Path, datetime], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, t0 = built
    slow_db, fast_db = _copy(src, tmp_path / "slow.db"), _copy(src, tmp_path / "fast.db")
    for seconds in (0, 30, 200):
        now = t0 + timedelta(seconds=seconds)
        slow = _ordinary(monkeypatch, slow_db, now)
        quick = _fast(monkeypatch, fast_db, now)
        for key in slow:
            assert quick[key] == slow[key], (seconds, key)
        assert quick == slow
        assert _fold(fast_db) == _fold(slow_db)
        if seconds == 0:  # the comparison covers every part of a status
            assert _fold(fast_db)[0] is not None  # a fold was stored
            assert set(slow["failures"]) == {"bad_request", "mask_mismatch"}
            assert set(slow["retrying"]) == {"timeout", "rate_limited"}
            assert all(slow["counts"][state] for state in ("pending", "running", "done",
                                                           "failed", "skipped"))
            assert slow["done_per_s"] > 0 and slow["eta_s"] is not None
            assert sum(slow["inflight"].values()) == 3
            assert {"ok", "timeout", "rate_limited", "bad_request"} <= set(slow["calls"])
            assert list(slow["unhealthy"]) == [B]
            assert [w["name"] for w in slow["workers"]] == ["host:1:live"]
            assert slow["limits"][A]["history"] and slow["limits"][A]["limit"] == 24
            assert slow["limits"][B]["reason"] == "not started yet"
            assert slow["turns_total"] > slow["turns_done"] > 0 and slow["cut"] == 1
            assert slow["stale_examples"] > 0 and slow["num_tokens"] > 0
            assert slow["token_mismatches"] > 0 and slow["pause_reason"]
            cost = slow["cost"]
            assert cost["busy_s"] > 0 and cost["dollars"] > 0 and cost["gpus"] == 2
            assert cost["current_tokens_per_s"] > 0 and cost["remaining_dollars"] > 0


def test_the_fast_path_leaves_what_it_cannot_answer_to_the_ordinary_one(
        built: tuple[Path, datetime], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src, _ = built
    assert fast.job_status("rich") is not None
    assert fast.job_status(None) is not None  # the newest job
    assert fast.job_status("no-such-job") is None  # the ordinary path words the error
    monkeypatch.setenv("SYNTHQ_WORKER_TIMEOUT", "3")  # a setting: validated, and it counts
    assert fast.job_status("rich") is None
    old = _copy(src, tmp_path / "old.db")
    with sqlite3.connect(old) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0017'")
    conn.close()
    _use(monkeypatch, old)
    assert fast.job_status("rich") is None  # the ordinary path migrates it first
    _use(monkeypatch, tmp_path / "missing.db")
    assert fast.job_status("rich") is None



def test_sqlite_times_are_written_as_sqlalchemy_writes_them(
        built: tuple[Path, datetime]) -> None:
    """Both paths compare times as SQLite text: a parameter must have the exact form of
    the values SQLAlchemy stored (a shared format; the comparison above cannot see it)."""
    from synthq.store.sqlread import SQLITE_TIME, read_time

    src, _ = built
    with sqlite3.connect(src) as conn:
        (created,) = conn.execute("SELECT created_at FROM jobs").fetchone()
    conn.close()
    assert read_time(created).strftime(SQLITE_TIME) == created


def test_postgres_fast_status_equals_the_ordinary_one(
        pg: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On PostgreSQL `synthq status` reads through psycopg alone (issue 24: 6-14 s per
    `status --json` on a loaded machine, nearly all of it importing SQLAlchemy and
    pydantic-settings): the same status as the ordinary path, figure by figure. The
    rich job is built once and the database copied, so each path stores its own fold."""
    import subprocess
    import sys

    from sqlalchemy import create_engine, text

    from synthq.store.db import dispose_engines

    now = utcnow()
    _build(now)
    dispose_engines()
    copy = pg.rsplit("/", 1)[0] + "/" + pg.rsplit("/", 1)[1] + "_fastcopy"
    admin = create_engine(pg.rsplit("/", 1)[0] + "/postgres", isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        name = copy.rsplit("/", 1)[1]
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{name}" TEMPLATE "{pg.rsplit("/", 1)[1]}"'))
    try:
        for key in [k for k in os.environ if k.startswith("SYNTHQ_")]:
            monkeypatch.delenv(key)
        monkeypatch.setenv("SYNTHQ_DATABASE_URL", pg)
        _reset_process_state()
        with session_scope() as s:
            slow = job_status(s, find_job(s, "rich"), now=now).to_dict()
        dispose_engines()
        monkeypatch.setenv("SYNTHQ_DATABASE_URL", copy)
        monkeypatch.setenv("SYNTHQ_BROKER_URL", "redis://127.0.0.1:6379/0")
        assert fast.eligible()
        quick_status = fast.job_status("rich", now=now)
        assert quick_status is not None, "the fast path declined"
        quick = quick_status.to_dict()
        for key in slow:
            assert quick[key] == slow[key], key
        assert slow["cost"]["busy_s"] > 0 and slow["workers"]
        # Not for it: another setting (validated by the ordinary path), an unknown job.
        assert fast.job_status("no-such-job") is None
        monkeypatch.setenv("SYNTHQ_HEARTBEAT_INTERVAL", "1")
        assert not fast.eligible() and fast.job_status("rich") is None
        monkeypatch.delenv("SYNTHQ_HEARTBEAT_INTERVAL")
        # The command itself loads neither SQLAlchemy nor pydantic-settings.
        probe = ("import sys, runpy; sys.argv = ['synthq', 'status', 'rich', '--json']\n"
                 "try:\n    runpy.run_module('synthq.cli', run_name='__main__')\n"
                 "except SystemExit:\n    pass\n"
                 "print('LOADED', 'sqlalchemy' in sys.modules, 'pydantic_settings' in "
                 "sys.modules)")
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             env={**os.environ}, timeout=120)
        assert '"name": "rich"' in out.stdout, out.stderr
        assert "LOADED False False" in out.stdout, out.stdout[-500:] + out.stderr
    finally:
        dispose_engines()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{copy.rsplit("/", 1)[1]}" '
                              "WITH (FORCE)"))
        admin.dispose()
