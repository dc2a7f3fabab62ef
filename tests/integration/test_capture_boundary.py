"""Capture inside the system: a capture server's error answer is classed by the one
HTTP boundary (synthq.serving.inference.status_error), Retry-After included, and every failure
class, ``worker_error`` and ``lost`` among them, is one a requeue accepts."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import httpx
import numpy as np
import pytest
from fake_engine import capture_job
from sqlalchemy import select
from support import run_cli

pytestmark = pytest.mark.integration

URL = "http://capture.invalid/v1"


def _capture_job(job_factory: Any, n: int) -> int:
    return capture_job(job_factory, n, URL, limit=2,
                       tokens=lambda sid: np.arange(6, dtype="<i4") + sid)


def _busy_engine(request: httpx.Request) -> httpx.Response:
    """An engine that lists its model and answers every capture "busy, come back in 30 s"."""
    if request.url.path.endswith("/models"):
        return httpx.Response(200, json={"data": [{"id": "target"}]})
    if request.url.path.endswith("/version"):
        return httpx.Response(200, json={"version": "test"})
    return httpx.Response(429, headers={"Retry-After": "30"},
                          json={"error": {"message": "queue full"}})


def test_a_capture_honours_the_servers_retry_after(job_factory: Any) -> None:
    from synthq.capture.stage import Stage
    from synthq.store.db import session_scope, utcnow
    from synthq.store.models import Capture

    job_id = _capture_job(job_factory, 2)
    stage = Stage(job_id, seconds=1.0)
    stage.client.close()
    stage.client = httpx.Client(transport=httpx.MockTransport(_busy_engine))
    started = utcnow()
    left = stage.run()
    assert left.done == 0
    with session_scope() as s:
        rows = s.execute(select(Capture.state, Capture.error_class, Capture.error_message,
                                Capture.next_attempt_at).where(Capture.job_id == job_id)).all()
    assert len(rows) == 2
    for state, error_class, message, due in rows:
        assert (str(state), error_class) == ("pending", "rate_limited"), rows
        assert "Retry-After 30 s" in message
        # The job's backoff alone would be at most backoff_base (2 s): the server's 30 s
        # is the floor.
        assert due >= started + timedelta(seconds=29), (due, started)


@pytest.mark.parametrize("error_class", ["worker_error", "lost"])
def test_requeue_takes_every_failure_class(sample_factory: Any, error_class: str) -> None:
    from synthq.store.db import session_scope
    from synthq.store.models import Job, Sample

    sid = sample_factory("failed", error_class=error_class, error_message="x", attempts=5)
    with session_scope() as s:
        name = s.get_one(Job, s.get_one(Sample, sid).job_id).name
    out = run_cli("requeue", name, "--failed", "--class", error_class)
    assert "requeued 1" in out.stdout, out.stdout
    with session_scope() as s:
        assert str(s.get_one(Sample, sid).state) == "pending"
