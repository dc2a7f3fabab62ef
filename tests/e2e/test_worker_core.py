"""The second worker design under failure: batches, the batch writer, worker heartbeats.

Real Celery workers and beat over real Redis and PostgreSQL, the simulator over
HTTP; kill tests kill real processes. The test settings (conftest.TEST_ENV)
make a worker count as dead 3 s after its last heartbeat.

The outage scenarios (kill -9, a broker wipe, a hanging server, SIGTERM, a
PostgreSQL restart) moved to ``tests/chaos``, where each test has its own
PostgreSQL and Redis processes to kill and restart.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import create_engine, func, select, text
from support import counts, wait_for, wait_worker_live

from synthq.store.db import session_scope
from synthq.store.models import Attempt, Sample

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


def prompts(n: int, tag: str) -> list[str]:
    return [f"{tag} question number {i}: explain something" for i in range(n)]


def ok_calls_per_sample(job_id: int) -> list[int]:
    with session_scope() as s:
        return [n for _, n in s.execute(
            select(Attempt.sample_id, func.count()).join(Sample, Sample.id == Attempt.sample_id)
            .where(Sample.job_id == job_id, Attempt.outcome == "ok")
            .group_by(Attempt.sample_id))]


def test_worker_killed_before_its_commit_is_retried(workers: Any, simulator: Callable[..., Any],
                                                    job_factory: Callable[..., Any],
                                                    pg: str) -> None:
    """Answers in hand but not yet committed when the worker dies: redone, never done
    without their row."""
    sim = simulator("--latency", "0.2", "--capacity", "16")
    n = 4
    report = job_factory(prompts(n, "commit"), servers=[sim.url], inflight_limit=8)
    victim = workers.worker(concurrency=8, name="victim")
    wait_worker_live()
    workers.beat()
    wait_for(lambda: counts(report.job_id)["running"] == n, 30, workers.logs())
    # Hold the rows: the writer's compare-and-set now waits on our lock.
    engine = create_engine(pg)
    conn = engine.connect()
    tx = conn.begin()
    conn.execute(text("SELECT id FROM samples WHERE job_id = :j FOR UPDATE"),
                 {"j": report.job_id})
    wait_for(lambda: sim.stats()["completed"] >= n, 20, "calls did not finish")
    time.sleep(0.3)  # the outcomes are queued in the writer, blocked on the lock
    victim.kill9()
    tx.rollback()
    conn.close()
    engine.dispose()
    c = counts(report.job_id)
    assert c["done"] == 0 and c["running"] == n, c
    workers.worker(concurrency=8, name="rescuer")
    wait_for(lambda: counts(report.job_id)["done"] == n, 40, workers.logs())
    assert ok_calls_per_sample(report.job_id) == [1] * n
    assert all(v == 2 for v in sim.stats()["prompts"].values())
    with session_scope() as s:
        assert s.scalar(select(func.count()).select_from(Sample).where(
            Sample.state == "done", Sample.response_content.is_(None))) == 0
