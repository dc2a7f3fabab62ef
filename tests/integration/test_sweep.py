"""One sweep (synthq.queue.sweep) over every kind of leased work, training runs included
(issue 42, item 1): what a dead holder left of samples, captures and runs comes back in
one pass, and each orphaned run is sent its ``train`` message after the commit."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select, update

from synthq.queue import capture_states, run_states
from synthq.queue import states as sample_states
from synthq.store.db import session_scope, utcnow
from synthq.store.models import Capture, Sample, TrainingRun

pytestmark = [pytest.mark.integration]


def test_one_sweep_brings_back_every_kind_and_sends_the_runs(
        pg: str, job_factory: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from synthq.queue.sweep import sweep
    from synthq.spec.config import get_settings

    monkeypatch.setenv("SYNTHQ_TRAIN_LEASE", "30")
    get_settings.cache_clear()
    past = utcnow() - timedelta(seconds=120)
    job_id = job_factory(["one", "two"]).job_id
    with session_scope() as s:
        first, second = s.scalars(select(Sample.id).where(Sample.job_id == job_id)
                                  .order_by(Sample.id)).all()
        # The first sample is done and has a capture; the second runs on a passed lease.
        s.execute(update(Sample).where(Sample.id == first).values(
            state="done", input_ids=b"\x01\x00\x00\x00", num_tokens=1, tokenize_version=1))
        capture_states.add_missing(s, job_id, now=past)
    with session_scope() as s:
        sample_states.queue(s, [second], server="http://127.0.0.1:9/v1", token="q",
                            deadline=past + timedelta(seconds=30), now=past)
    with session_scope() as s:
        assert sample_states.claim(s, second, "q", new_token="held", worker="gone:1",
                                   lease_until=past + timedelta(seconds=60), now=past)
        assert capture_states.claim(s, job_id, server="http://127.0.0.1:9/c", limit=4, most=1,
                                    worker="gone:1", token="cap", lease=60.0, now=past)
        run_id = run_states.create(s, job_id=job_id, trigger="manual", target="t",
                                   settings={}, output_dir="/nowhere/{run}", now=past)
    with session_scope() as s:
        assert run_states.claim(s, run_id, "run", worker="gone:1", now=past, lease=30.0)

    sent: list[list[int]] = []
    # Without a way to send a run its message, runs are left to the readiness check.
    assert sweep(job_ids=[job_id]) == 2
    with session_scope() as s:
        assert s.get_one(TrainingRun, run_id).state == "running"
    assert sweep(job_ids=[job_id], send_runs=sent.append) == 1
    assert sent == [[run_id]]
    with session_scope() as s:
        assert s.get_one(Sample, second).state == "pending"
        assert s.scalars(select(Capture.state).where(Capture.job_id == job_id)).one() == \
            "pending"
        run = s.get_one(TrainingRun, run_id)
        assert (run.state, run.claim) == ("pending", None)
    # Nothing is left: a second sweep moves and sends nothing.
    assert sweep(job_ids=[job_id], send_runs=sent.append) == 0
    assert sent == [[run_id]]
