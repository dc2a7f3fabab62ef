"""A job's settings as one sample sees them: the job's, cached per process, with the
sample's overrides on top.

``synthq requeue`` may set a few settings per sample (``samples.overrides``);
the call (:mod:`synthq.serving.call`) and the re-tokenization
(:mod:`synthq.jobs.retokenize`) both read a job through :func:`effective`.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy.orm import Session

from synthq.spec import jobspec
from synthq.store.db import CLAIM_PATH_ATTEMPTS, session_scope, with_db_retry
from synthq.store.models import Job

__all__ = ["OVERRIDABLE", "Effective", "effective", "get_job"]


#: Per-sample settings ``synthq requeue`` may set (``samples.overrides``), as declared.
OVERRIDABLE = jobspec.OVERRIDABLE


class Effective:
    """A job's settings with one sample's overrides on top (read-only view)."""

    def __init__(self, job: Any, overrides: dict[str, Any]) -> None:
        self._job = job
        jobspec.apply_overrides(self, job, overrides)

    def __getattr__(self, name: str) -> Any:
        # What the overrides did not set is the job's own: only what a job has (a column,
        # a method), so a misspelt name fails here, naming the view, and never reaches
        # some other attribute of the job's object by accident.
        if name.startswith("_") or not hasattr(type(self._job), name):
            raise AttributeError(f"a job has no setting {name!r}")
        return getattr(self._job, name)


def effective(job: Any, overrides: dict[str, Any] | None) -> Any:
    """``job`` itself, or a view of it with the sample's ``overrides`` applied."""
    return Effective(job, overrides) if overrides else job


# -- jobs, cached per process --------------------------------------------------------

#: Seconds a process trusts its copy of a job's settings.
JOB_CACHE_SECONDS = 5.0
_jobs: dict[int, tuple[float, Job]] = {}


def get_job(job_id: int, session: Session | None = None) -> Job:
    """The job's settings; re-read at most every JOB_CACHE_SECONDS (call off the event loop).

    Inside a transaction pass its ``session``: on SQLite a second connection's
    ``BEGIN IMMEDIATE`` would wait for that transaction's lock (a deadlock).
    """
    now = time.monotonic()
    hit = _jobs.get(job_id)
    if hit and now - hit[0] < JOB_CACHE_SECONDS:
        return hit[1]
    if session is not None:
        job = session.get_one(Job, job_id)
        session.expunge(job)
        _jobs[job_id] = (now, job)
        return job

    def load() -> Job:
        with session_scope() as s:
            job = s.get_one(Job, job_id)
            s.expunge(job)
            return job

    job = with_db_retry(load, attempts=CLAIM_PATH_ATTEMPTS, what=f"job {job_id}")
    _jobs[job_id] = (now, job)
    return job

