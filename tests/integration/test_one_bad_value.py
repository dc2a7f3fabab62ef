"""One job's value never stops every job: the sweep and the dispatch on real PostgreSQL
with a row no front end accepts any more (issue 24, item 7)."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import update
from support import counts

from synthq.queue.dispatch import Dispatched, dispatch
from synthq.queue.sweep import sweep
from synthq.store.db import session_scope, utcnow
from synthq.store.models import Job

pytestmark = pytest.mark.integration


def test_a_huge_stored_value_leaves_the_sweep_and_the_other_jobs_moving(
        job_factory: Callable[..., Any], sample_factory: Callable[..., int]) -> None:
    bad = job_factory([], servers=["http://10.255.3.1:8000/v1"])
    # What the API's requeue stored before its settings were bounded: a sample's own
    # max_attempts of 10**12 (no INTEGER holds it), running on a lease that has passed.
    past = utcnow() - timedelta(seconds=30)
    huge = sample_factory("running", job_id=bad.job_id, attempts=1, claim="t",
                          server="http://10.255.3.1:8000/v1", worker="gone@host",
                          started_at=past, expires_at=past,
                          overrides={"max_attempts": 10**12})
    # One more with a value of a type no front end writes.
    odd = sample_factory("running", job_id=bad.job_id, attempts=1, claim="u",
                         server="http://10.255.3.1:8000/v1", started_at=past,
                         expires_at=past, overrides={"max_attempts": "many"})
    # And the job's own timeouts, stored as create accepted them then.
    with session_scope() as s:
        s.execute(update(Job).where(Job.id == bad.job_id).values(
            stall_timeout=1e308, total_timeout=1e308, backoff_cap=1e308))
    canary = job_factory(["c1", "c2", "c3"], servers=["http://10.255.3.2:8000/v1"])

    assert sweep() == 2  # both back to pending (their attempt budgets are not spent)
    assert counts(bad.job_id)["pending"] == 2
    taken: list[Dispatched] = []
    dispatch(taken.extend)
    by_job = {d.sample_id for d in taken}
    assert huge in by_job and odd in by_job
    assert counts(canary.job_id).get("queued") == 3, counts(canary.job_id)

    from synthq.queue.jobview import get_job
    from synthq.queue.states import SAMPLES

    lease_seconds = SAMPLES.lease_seconds  # the samples' declared lease

    assert math.isfinite(lease_seconds(get_job(bad.job_id)))
    assert lease_seconds(get_job(bad.job_id)) < 8 * 24 * 3600
