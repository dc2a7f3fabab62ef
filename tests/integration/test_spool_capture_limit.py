"""A streamed run's capture calls count toward the server's one capture limit (issue 43):
the stage's captures and the spool's calls share ``capture_limit`` under one lock per
server (synthq.queue.capture_states.room), and a dead trainer's call is freed by the
ledger's one dead-holder rule. On SQLite and PostgreSQL; the cross-process run (a
``synthq capture`` process beside two streamed ranks' captures) is in
tests/integration/test_spool_capture_processes.py.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import numpy as np
import pytest
from sqlalchemy import select, update

from synthq.store.db import session_scope, utcnow

pytestmark = pytest.mark.integration

SERVER = "http://127.0.0.1:9/v1"


def _job_and_run(n: int, *, limit: int) -> tuple[int, int, list[int]]:
    """A job of ``n`` done samples (each with its pending capture) on SERVER with
    ``capture_limit`` ``limit``, and a streamed run with ``n`` pending spool rows."""
    from synthq.data.dataset import Row
    from synthq.jobs.enqueue import EnqueueReport, JobSpec, get_or_create_job
    from synthq.jobs.samplecopy import insert_rows
    from synthq.queue import capture_states, run_states, spool_states
    from synthq.store.models import Job, Sample, SpoolItem

    spec = JobSpec(name="j", model="m", servers=["http://127.0.0.1:8/v1"], max_tokens=16)
    with session_scope() as s:
        job, _, _ = get_or_create_job(s, spec)
        job_id, settings = job.id, job.generation_settings()
    insert_rows(job_id, settings, [Row(i, [{"role": "user", "content": f"p{i}"}])
                                   for i in range(n)],
                EnqueueReport(job_id=job_id, job_name="j", created=True))
    now = utcnow()
    with session_scope() as s:
        s.execute(update(Sample).where(Sample.job_id == job_id).values(
            state="done", input_ids=np.arange(6, dtype="<i4").tobytes(), num_tokens=6,
            tokenize_version=1, finished_at=now))
        s.execute(update(Job).where(Job.id == job_id).values(
            capture_servers=[SERVER], capture_layers=[2, 4, 5, 8], capture_limit=limit))
        capture_states.add_missing(s, job_id, now=now)
        run_id = run_states.create(s, job_id=job_id, trigger="manual", target="t",
                                   settings={}, output_dir="/tmp/{run}", now=now)
        spool_states.add_epoch(s, run_id, 0, 0, [f"{i}" for i in range(n)], now=now)
        items = list(s.scalars(select(SpoolItem.id).where(SpoolItem.run_id == run_id)
                               .order_by(SpoolItem.id)))
    return job_id, run_id, items


def _start(item: int, *, worker: str = "trainer", lease: float = 600.0,
           limit: int = 2) -> bool:
    from synthq.queue import spool_states

    with session_scope() as s:
        return spool_states.start_capture(s, item, server=SERVER, limit=limit,
                                          token=f"t{item}", worker=worker, lease=lease,
                                          now=utcnow())


def _stage_claims(job_id: int, most: int, *, limit: int = 2) -> int:
    from synthq.queue import capture_states

    with session_scope() as s:
        return len(capture_states.claim(s, job_id, server=SERVER, limit=limit, most=most,
                                        worker="stage", token="s" * 16, lease=600.0,
                                        now=utcnow()))


def test_the_stage_and_the_spool_share_one_limit_per_server(backend: str) -> None:
    """Limit 2: a stage capture and a spool call fill it; neither kind gets a third, and a
    spool call that ends (its file, or handed back) frees its slot for either kind."""
    from synthq.queue import capture_states, spool_states

    job_id, _, items = _job_and_run(6, limit=2)
    assert _stage_claims(job_id, 1) == 1
    assert _start(items[0])
    with session_scope() as s:
        assert capture_states.running_on(s, SERVER) == 2
    assert not _start(items[1])  # the stage's capture holds the other slot
    assert _stage_claims(job_id, 2) == 0  # the spool's call holds one
    with session_scope() as s:
        assert spool_states.captured(s, items[0], token=f"t{items[0]}", path="ab/x",
                                     nbytes=10, now=utcnow())
    assert _start(items[1])
    with session_scope() as s:
        assert spool_states.release_capture(s, items[1], token=f"t{items[1]}", now=utcnow())
    assert _stage_claims(job_id, 2) == 1
    with session_scope() as s:
        assert capture_states.running_on(s, SERVER) == 2
        rows = {r.id: r for r in spool_states.items(s, _run_of(s, items[0]))}
    assert (rows[items[0]].state, rows[items[0]].path) == ("spooled", "ab/x")
    assert rows[items[1]].state == "pending" and rows[items[1]].claim is None


def _run_of(s: Any, item: int) -> int:
    from synthq.store.models import SpoolItem

    return int(s.scalar(select(SpoolItem.run_id).where(SpoolItem.id == item)))


def test_a_dead_trainers_call_is_freed_by_the_one_dead_holder_rule(backend: str) -> None:
    """A spool call's holder heart-beats as a worker: one whose heartbeat went silent, or
    whose lease passed, no longer holds the server's slot once the sweep has run; a live
    holder's call within its lease keeps it."""
    from synthq.queue import spool_states, sweep, workers

    _, _, items = _job_and_run(4, limit=3)
    with session_scope() as s:
        workers.heartbeat(s, "live", capacity=0, inflight=1)
        workers.heartbeat(s, "killed", capacity=0, inflight=1,
                          now=utcnow() - timedelta(seconds=3600))
    assert _start(items[0], worker="live", limit=3)
    assert _start(items[1], worker="killed", limit=3)
    assert _start(items[2], worker="live", lease=-1.0, limit=3)  # its lease passed already
    assert not _start(items[3], worker="live", limit=3)
    sweep.sweep()  # the tick's (and a capture stage's) sweep: the lease rule
    with session_scope() as s:
        states = {r.id: r.state for r in spool_states.items(s, _run_of(s, items[0]))}
    assert states[items[2]] == "pending"
    with session_scope() as s:  # the heartbeat rule, as a sweep that judges workers
        spool_states.expire_captures(s, now=utcnow(), worker_timeout=60.0)
        states = {r.id: r.state for r in spool_states.items(s, _run_of(s, items[0]))}
    assert [states[i] for i in items] == ["capturing", "pending", "pending", "pending"]
    assert _start(items[3], worker="live", limit=3)
    assert _start(items[1], worker="live", limit=3)
    assert not _start(items[2], worker="live", limit=3)


def test_a_new_holder_of_the_run_takes_its_calls_back(backend: str) -> None:
    """A killed trainer's rank left a call in flight: the run's next holder sends it back
    to pending before its capture walks (else the walk would pass it by: skipped)."""
    from synthq.queue import spool_states

    _, run_id, items = _job_and_run(2, limit=2)
    assert _start(items[0], worker="old")
    with session_scope() as s:
        assert spool_states.take_back_captures(s, run_id, 1, now=utcnow()) == 0  # rank 1's
        assert spool_states.take_back_captures(s, run_id, 0, now=utcnow()) == 1
        row = spool_states.items(s, run_id, examples=["0"])[0]
    assert (row.state, row.claim) == ("pending", None)
    assert _start(items[0]) and _start(items[1])
