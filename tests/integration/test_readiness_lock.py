"""The readiness check runs in beat's tick and in every training worker (issue 41, item
10): concurrent checks are serialized by an advisory lock, and a check that finds it
taken leaves the work to its holder (no second run for a job)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from synthq.store.db import session_scope
from synthq.store.models import Job, TrainingRun

pytestmark = [pytest.mark.integration]


def test_a_check_that_finds_the_lock_taken_does_nothing(
        pg: str, sample_factory: Callable[..., int], job_factory: Callable[..., Any]) -> None:
    from sqlalchemy import func, select, text

    from synthq.training.readiness import LOCK, check_readiness

    job_id = job_factory([]).job_id
    sample_factory("done", job_id=job_id)
    with session_scope() as s:
        job = s.get(Job, job_id)
        assert job is not None
        job.train_target = "/nowhere"
    sent: list[list[int]] = []
    with session_scope() as other:  # another process's check, under way
        assert other.scalar(text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": LOCK})
        assert check_readiness(sent.append).started == []
    first = check_readiness(sent.append)
    assert len(first.started) == 1 and sent == [first.started]
    with session_scope() as s:
        assert s.scalar(select(func.count()).select_from(TrainingRun)) == 1
