"""`synthq status --watch` without a job: it waits for the first job (it used to exit with
"no jobs yet"), shows a bar for every job with samples open (it showed the newest job's
only), and its closing tables say "finished" where the footer does (the job's row still
read "active" until a tick marked it). In process, on SQLite: the pause between two
redraws is the test's hook, which makes jobs and finishes their samples."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import _reset_process_state
from typer.testing import CliRunner


@pytest.fixture
def embedded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The embedded default on a fresh SQLite file, no other SYNTHQ_ setting."""
    for key in [k for k in os.environ if k.startswith("SYNTHQ_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("SYNTHQ_DATABASE_URL", f"sqlite:///{tmp_path / 'w.db'}")
    monkeypatch.setenv("SYNTHQ_DATA_DIR", str(tmp_path / "data"))
    _reset_process_state()
    from synthq.cli import ensure_db

    ensure_db()  # migrates the SQLite file
    yield tmp_path
    _reset_process_state()


def _make_job(tmp_path: Path, name: str, rows: int) -> None:
    from synthq.jobs.enqueue import build_spec, enqueue

    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{name} {i}"}) + "\n" for i in range(rows)))
    spec = build_spec({"name": name, "model": "m", "servers": ["http://127.0.0.1:9/v1"]},
                      source=str(data))
    enqueue(spec, str(data))


def _finish(name: str) -> None:
    """Every sample of job ``name`` done, as a worker leaves them (the job's row is left
    active: no tick runs here)."""
    from sqlalchemy import text

    from synthq.store.db import session_scope, utcnow

    with session_scope() as s:
        s.execute(text("UPDATE samples SET state = 'done', finished_at = :now WHERE job_id = "
                       "(SELECT id FROM jobs WHERE name = :name)"),
                  {"now": utcnow(), "name": name})


def test_watch_waits_for_a_job_shows_every_open_jobs_bar_and_ends_finished(
        embedded: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from synthq.cli import app, watch

    steps = iter([
        lambda: None,                                                    # still no job
        lambda: (_make_job(embedded, "alpha", 2), _make_job(embedded, "beta", 3)),
        lambda: _finish("alpha"),
        lambda: _finish("beta"),
    ])
    waits = []

    def wait(seconds: float) -> None:
        waits.append(seconds)
        next(steps)()

    monkeypatch.setattr(watch, "_wait", wait)
    result = CliRunner().invoke(app, ["status", "--watch", "--interval", "0.01"],
                                env={"COLUMNS": "120"})
    out = result.output
    assert result.exit_code == 0, out
    assert "no job yet: waiting for one" in out
    assert len(waits) == 4  # it waited through the empty table, then until both finished
    # A bar for each job (the last frame: both complete).
    assert re.search(r"alpha .*100%.*done 2 ", out) and re.search(r"beta .*100%.*done 3 ", out), out
    # Each watched job's summary, its title saying what its footer says.
    titles = re.findall(r"job (\w+) \(id \d+\) — (\w+)", out)
    assert titles == [("alpha", "finished"), ("beta", "finished")], out
    assert "— active" not in out


def test_watch_of_one_job_says_finished_in_its_title_too(
        embedded: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from synthq.cli import app, watch

    _make_job(embedded, "solo", 2)
    monkeypatch.setattr(watch, "_wait", lambda seconds: _finish("solo"))
    result = CliRunner().invoke(app, ["status", "solo", "--watch", "--interval", "0.01"],
                                env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    assert "— finished" in result.output and "— active" not in result.output, result.output
    assert "finished: 2 done" in result.output
