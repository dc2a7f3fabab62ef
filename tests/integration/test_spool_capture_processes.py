"""A ``synthq capture`` process and a streamed run's two ranks capture from one server at
once: together they never pass its ``capture_limit`` (issue 43), and each rank says once
that it waits for a slot. Real processes over PostgreSQL, against the counting capture
server of tests/integration/test_capture_queue.py.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_engine import LAYERS, captures_by_state
from sqlalchemy import select
from support import child_env, wait_for
from test_capture_queue import HIDDEN, FakeCaptureServer, _done_samples

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

LIMIT = 2


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[FakeCaptureServer]:
    (tmp_path / "engine").mkdir()
    server = FakeCaptureServer(tmp_path / "engine", hold=0.3)
    yield server
    server.close()


def _ranks(job_id: int, engine: FakeCaptureServer, tmp_path: Path,
           said: list[list[str]]) -> list[Any]:
    """A streamed run's two ranks' captures (synthq.capture.spool.StreamCapture), five
    examples each, their servers probed; not started."""
    from synthq.capture.spool import Slot, Spool, StreamCapture, probe
    from synthq.queue import run_states
    from synthq.store.db import session_scope, utcnow
    from synthq.store.models import Job

    with session_scope() as s:
        job = s.get_one(Job, job_id)
        s.expunge(job)
        run_id = run_states.create(s, job_id=job_id, trigger="manual", target="t",
                                   settings={}, output_dir=str(tmp_path / "run"), now=utcnow())
    found = probe(job, [engine.url], LAYERS, np.arange(3, dtype=np.int64) + 7, hidden=HIDDEN,
                  timeout=30.0)
    caps = []
    for rank in range(2):
        order = [Slot(i, 0, f"{rank}-{i}", np.arange(4 + i, dtype=np.int64) + 100 * rank)
                 for i in range(5)]
        spool = Spool(tmp_path / "spool" / f"rank{rank}", 1 << 30)
        spool.scan({})
        said.append([])
        caps.append(StreamCapture(run_id=run_id, rank=rank, job=job, probe=found,
                                  layers=LAYERS, spool=spool, order=order,
                                  epochs={0: [s.example for s in order]},
                                  say=said[rank].append, timeout=30.0))
    return caps


def test_a_capture_process_and_two_streamed_ranks_keep_one_limit(
        pg: str, job_factory: Any, engine: FakeCaptureServer, tmp_path: Path) -> None:
    from synthq.queue import spool_states
    from synthq.store.db import session_scope
    from synthq.store.models import Job, SpoolItem

    job_id = _done_samples(job_factory, 12, engine.url, LIMIT)
    with session_scope() as s:
        name = s.scalar(select(Job.name).where(Job.id == job_id))
    said: list[list[str]] = []
    caps = _ranks(job_id, engine, tmp_path, said)  # the probes call before the stage runs
    # The stage's calls are held long until both ranks are waiting, so that they meet it.
    engine.hold = 5.0
    log = (tmp_path / "capture.log").open("w")
    stage = subprocess.Popen([sys.executable, "-m", "synthq.cli", "capture", str(name)],
                             env=child_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: engine.active >= LIMIT, 120, "the capture process took no room")
        for cap in caps:
            cap.start()
        wait_for(lambda: any(cap.full_waits for cap in caps), 120,
                 "no rank waited for the capture process's room")
        engine.hold = 0.3
        for cap in caps:
            cap.join(timeout=240)
            assert not cap.is_alive() and cap.error is None, cap.error
        assert stage.wait(timeout=240) == 0, (tmp_path / "capture.log").read_text()
    finally:
        if stage.poll() is None:
            stage.kill()
            stage.wait()
        log.close()
    # The one limit held over the process and both ranks, at every moment.
    assert engine.most <= LIMIT, engine.most
    assert captures_by_state(job_id) == {"done": 12}
    with session_scope() as s:
        rows = s.execute(select(SpoolItem.state, SpoolItem.captures, SpoolItem.server,
                                SpoolItem.claim)).all()
        capturing = s.scalar(select(SpoolItem.id).where(
            SpoolItem.state == spool_states.CAPTURE.held))
    assert sorted(set(rows)) == [("spooled", 1, engine.url, None)] and len(rows) == 10
    assert capturing is None
    # Each rank says at most once that it waits (it may have waited many times).
    for lines in said:
        waits = [line for line in lines if "at their capture limit" in line]
        assert len(waits) <= 1, lines
    assert sum(cap.full_waits for cap in caps) >= 1
    assert any("at their capture limit" in line for lines in said for line in lines)


def test_a_resumed_rank_captures_what_its_killed_holder_had_in_flight(
        pg: str, job_factory: Any, engine: FakeCaptureServer, tmp_path: Path) -> None:
    """The run's earlier holder was killed with a call in flight (its row ``capturing``,
    holding a slot for an hour's lease): the next holder's capture takes it back, captures
    it with the others, and skips nothing."""
    from synthq.queue import spool_states
    from synthq.store.db import session_scope, utcnow

    job_id = _done_samples(job_factory, 1, engine.url, LIMIT)
    cap = _ranks(job_id, engine, tmp_path, [])[0]
    with session_scope() as s:
        spool_states.add_epoch(s, cap.run_id, 0, 0, cap.epochs[0], now=utcnow())
        first = spool_states.items(s, cap.run_id, rank=0)[0]
        assert spool_states.start_capture(s, first.id, server=engine.url, limit=LIMIT,
                                          token="killed", worker="killed-trainer",
                                          lease=3600.0, now=utcnow())
    cap.start()
    cap.join(timeout=120)
    assert not cap.is_alive() and cap.error is None, cap.error
    with session_scope() as s:
        rows = spool_states.items(s, cap.run_id, rank=0)
    assert [(r.state, r.path is not None) for r in rows] == [("spooled", True)] * 5
    assert cap.captured == 5
