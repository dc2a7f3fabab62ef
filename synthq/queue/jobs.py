"""Every write to a job's state and settings: each state change a compare-and-set.

A job's samples are :mod:`synthq.queue.states`'; a job is the row that holds their
settings and whether they are worked on::

    job: active ⇄ paused (pause / resume);  active, paused, finished ──cancel──▶ cancelled
         active ──finish (every sample terminal)──▶ finished
         finished ──reactivate (samples added or requeued)──▶ active

Its settings are written by :func:`update_job` (and the job's own transitions) only; the
REST API's writes go through :mod:`synthq.app.service`, which the CLI shares.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import case, exists, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from synthq.core.enums import JobState, SampleState
from synthq.store.models import Job, Sample

__all__ = ["JobState", "OPEN", "JOB_TRANSITIONS", "create_job", "update_job", "finish_jobs",
           "reactivate", "move_job", "set_job_state", "set_capture_stopped"]

#: Sample states that keep a job from being finished.
OPEN = (SampleState.PENDING, SampleState.QUEUED, SampleState.RUNNING)

#: Allowed sources of each job transition a user asks for (pause, resume, cancel).
JOB_TRANSITIONS: dict[JobState, tuple[JobState, ...]] = {
    JobState.PAUSED: (JobState.ACTIVE, JobState.PAUSED),
    JobState.ACTIVE: (JobState.PAUSED, JobState.ACTIVE),
    JobState.CANCELLED: (JobState.ACTIVE, JobState.PAUSED, JobState.FINISHED,
                         JobState.CANCELLED),
}


def create_job(session: Session, values: dict[str, Any], *, key_version: int,
               now: datetime) -> Job | None:
    """A new, active job with ``values`` (a JobSpec's fields), or None when a job of that
    name exists (``INSERT ... ON CONFLICT DO NOTHING``: two first enqueues of one job
    racing both succeed, one of them finding the other's job)."""
    dialect = session.get_bind().dialect.name
    ins = pg_insert if dialect == "postgresql" else sqlite_insert
    job_id = session.execute(
        ins(Job).values(**values, state=JobState.ACTIVE, key_version=key_version, moves=[],
                        created_at=now, updated_at=now)
        .on_conflict_do_nothing(index_elements=["name"]).returning(Job.id)).scalar()
    return None if job_id is None else session.get_one(Job, job_id)


def update_job(session: Session, job: Job, changes: dict[str, Any], *, now: datetime) -> None:
    """Change a job's operational settings (servers, timeouts, limits); not its state."""
    if "state" in changes:
        raise ValueError("a job's state changes only through its transitions")
    for key, value in changes.items():
        setattr(job, key, value)
    if changes:
        job.updated_at = now


def _no_open_sample() -> Any:
    return ~exists().where(Sample.job_id == Job.id, Sample.state.in_(OPEN))


def finish_jobs(session: Session, *, now: datetime,
                job_ids: Sequence[int] | None = None) -> list[int]:
    """active → finished for every job (of ``job_ids``) whose samples are all terminal.

    The job rows are locked first (``SKIP LOCKED``: an enqueue or requeue
    holding one is adding work), and the check runs again in a later
    statement, which sees whatever such a transaction committed. Returns the
    ids finished.
    """
    scope = [Job.id.in_(job_ids)] if job_ids is not None else []
    candidates = list(session.scalars(
        select(Job.id).where(Job.state == JobState.ACTIVE, _no_open_sample(), *scope)))
    if not candidates:
        return []
    locked = list(session.scalars(
        select(Job.id).where(Job.id.in_(candidates), Job.state == JobState.ACTIVE)
        .with_for_update(skip_locked=True)))
    if not locked:
        return []
    rows = session.connection().execute(
        update(Job).where(Job.id.in_(locked), Job.state == JobState.ACTIVE, _no_open_sample())
        .values(state=JobState.FINISHED, updated_at=now).returning(Job.id)).all()
    return [r[0] for r in rows]


def reactivate(session: Any, job_id: int, *, now: datetime) -> bool:
    """finished → active, in the transaction that added or requeued samples.

    ``session`` is a Session or a Connection. The job row is locked even when
    the job is not finished, so that :func:`finish_jobs` waits for this
    transaction's samples instead of finishing the job under them.
    """
    result = session.execute(
        update(Job).where(Job.id == job_id)
        .values(state=case((Job.state == JobState.FINISHED, JobState.ACTIVE.value),
                           else_=Job.state),
                updated_at=case((Job.state == JobState.FINISHED, now), else_=Job.updated_at))
        .returning(Job.state).execution_options(synchronize_session=False))
    state = result.scalar()
    return state is not None and str(state) == JobState.ACTIVE


def move_job(session: Session, job: Job, *, model: str | None, servers: list[str] | None,
             requeued: int, now: datetime) -> dict[str, Any]:
    """Point a job's remaining work at another model and/or servers; records the move.

    The first model change keeps the settings the content keys were made
    under in ``key_settings``. Returns the recorded move.
    """
    move: dict[str, Any] = {"at": now.isoformat(), "requeued": requeued}
    changes: dict[str, Any] = {}
    if model is not None and model != job.model:
        if job.key_settings is None:
            changes["key_settings"] = job.generation_settings()
        move["model"] = [job.model, model]
        changes["model"] = model
    if servers is not None and servers != list(job.servers):
        move["servers"] = [list(job.servers), servers]
        changes["servers"] = servers
    changes["moves"] = [*(job.moves or []), move]
    update_job(session, job, changes, now=now)
    session.flush()
    return move


def set_job_state(session: Session, job_id: int, target: JobState, *, now: datetime,
                  reason: str | None = None) -> bool:
    """pause (active → paused), resume (paused → active), cancel (→ cancelled), as a CAS.

    ``reason``: why synthq pauses the job itself (shown by ``status``); any other
    transition clears it."""
    result = session.execute(
        update(Job).where(Job.id == job_id, Job.state.in_(JOB_TRANSITIONS[target]))
        .values(state=target, updated_at=now,
                pause_reason=reason if target == JobState.PAUSED else None)
        .execution_options(synchronize_session=False))
    return result.rowcount == 1  # type: ignore[attr-defined]


def set_capture_stopped(session: Session, job_id: int, reason: str | None, *,
                        now: datetime) -> bool:
    """Stop the job's capture stage with ``reason`` (synthq.queue.streaks), or (None) let it run
    again. Generation is not touched. True when the row changed."""
    stopped = Job.capture_stopped.is_(None) if reason is not None \
        else Job.capture_stopped.is_not(None)
    result = session.execute(update(Job).where(Job.id == job_id, stopped)
                             .values(capture_stopped=reason, updated_at=now)
                             .execution_options(synchronize_session=False))
    return result.rowcount == 1  # type: ignore[attr-defined]
