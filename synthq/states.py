"""Sample and job states, and every sample state transition.

Each transition is one compare-and-set ``UPDATE ... WHERE id=? AND state IN
(allowed sources) [AND claim=?]``; it returns whether it won. A duplicate
delivery, a worker whose lease expired, or two racing workers therefore can
never write a result twice or overwrite a newer state (DESIGN invariant 2).

::

    pending ──dispatch──▶ queued ──claim──▶ running ──complete──▶ done
       ▲  ▲                 │                 │ │
       │  └──release/sweep──┘                 │ └──fail──▶ failed ──requeue──┐
       │                                      │                               │
       └──────────────retry / lease sweep─────┘◀──────────────────────────────┘
    (malformed rows are inserted as skipped)
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import and_, case, exists, select, update
from sqlalchemy.orm import Session

__all__ = [
    "SampleState",
    "JobState",
    "INFLIGHT",
    "FINISHED",
    "queue",
    "claim",
    "release",
    "renew",
    "complete",
    "store_response",
    "skip",
    "retry",
    "fail",
    "requeue",
    "expire",
]


class SampleState(enum.StrEnum):
    #: Waiting to be sent, possibly until ``next_attempt_at`` (a retry's backoff).
    PENDING = "pending"
    #: A ``generate`` message was published; waiting for a worker to claim it.
    QUEUED = "queued"
    #: A worker holds the lease and is calling the server.
    RUNNING = "running"
    #: The response (and, later, its tokenization) is stored. Final.
    DONE = "done"
    #: Gave up: a permanent error, or retries exhausted. ``requeue`` revives it.
    FAILED = "failed"
    #: The dataset row was malformed; never sent. Final.
    SKIPPED = "skipped"


class JobState(enum.StrEnum):
    #: Samples are dispatched.
    ACTIVE = "active"
    #: Nothing new is dispatched; calls in flight finish.
    PAUSED = "paused"
    #: Like paused, for good (``resume`` refuses).
    CANCELLED = "cancelled"


#: States that hold a slot of a server's in-flight limit.
INFLIGHT = (SampleState.QUEUED, SampleState.RUNNING)
#: States a sample does not leave by itself.
FINISHED = (SampleState.DONE, SampleState.FAILED, SampleState.SKIPPED)


def _samples():  # type: ignore[no-untyped-def]
    from synthq.models import Sample  # late import: models imports this module

    return Sample


def _cas(
    session: Session,
    sample_id: int,
    sources: Sequence[SampleState],
    values: dict[str, Any],
    *,
    claim_token: str | None = None,
    extra: Iterable[Any] = (),
) -> bool:
    Sample = _samples()
    conds = [Sample.id == sample_id, Sample.state.in_(sources), *extra]
    if claim_token is not None:
        conds.append(Sample.claim == claim_token)
    result = session.execute(
        update(Sample).where(and_(*conds)).values(**values).execution_options(synchronize_session=False)
    )
    return result.rowcount == 1  # type: ignore[attr-defined]


def queue(
    session: Session, sample_ids: Sequence[int], *, server: str, token: str,
    deadline: datetime, now: datetime,
) -> int:
    """pending → queued, for ids the dispatcher locked. Returns how many moved."""
    Sample = _samples()
    result = session.execute(
        update(Sample)
        .where(Sample.id.in_(sample_ids), Sample.state == SampleState.PENDING)
        .values(state=SampleState.QUEUED, server=server, claim=token, lease_expires_at=deadline,
                queued_at=now, updated_at=now)
        .execution_options(synchronize_session=False)
    )
    return int(result.rowcount)  # type: ignore[attr-defined]


def claim(
    session: Session, sample_id: int, token: str, *, new_token: str, lease_until: datetime,
    worker: str, now: datetime,
) -> Any:
    """queued → running, only if the message's token still matches and the job is active.

    Counts the attempt (unless the response is already stored: no call then).
    Returns the row's ``job_id, attempts, prompt, server,
    response_content, reasoning_content, finish_reason, completion_token_ids``,
    or ``None`` if the claim lost.
    """
    from synthq.models import Job, Sample

    job_active = exists().where(Job.id == Sample.job_id, Job.state == JobState.ACTIVE)
    return session.execute(
        update(Sample)
        .where(Sample.id == sample_id, Sample.state == SampleState.QUEUED,
               Sample.claim == token, job_active)
        .values(state=SampleState.RUNNING, claim=new_token, lease_expires_at=lease_until,
                worker=worker, started_at=now, updated_at=now,
                # attempts counts calls: none is made for a response already stored.
                attempts=case((Sample.response_content.is_(None), Sample.attempts + 1),
                              else_=Sample.attempts))
        .returning(Sample.job_id, Sample.attempts, Sample.prompt, Sample.server,
                   Sample.response_content, Sample.reasoning_content, Sample.finish_reason,
                   Sample.completion_token_ids)
    ).first()


def release(session: Session, sample_id: int, token: str, *, now: datetime) -> bool:
    """queued → pending: the message arrived but the job is paused or cancelled."""
    return _cas(session, sample_id, [SampleState.QUEUED],
                dict(state=SampleState.PENDING, claim=None, server=None, lease_expires_at=None,
                     updated_at=now), claim_token=token)


def renew(session: Session, sample_id: int, token: str, *, lease_until: datetime) -> bool:
    """running → running with a later lease. False means the lease was lost."""
    return _cas(session, sample_id, [SampleState.RUNNING],
                dict(lease_expires_at=lease_until), claim_token=token)


def complete(session: Session, sample_id: int, token: str, *, now: datetime, **result: Any) -> bool:
    """running → done, writing the result in the same statement (invariant 3)."""
    return _cas(session, sample_id, [SampleState.RUNNING],
                dict(state=SampleState.DONE, claim=None, lease_expires_at=None,
                     error_class=None, error_message=None, finished_at=now, updated_at=now,
                     **result), claim_token=token)


def store_response(session: Session, sample_id: int, token: str, *, now: datetime,
                   **response: Any) -> bool:
    """running → running, saving the raw response before tokenization (invariant 4)."""
    return _cas(session, sample_id, [SampleState.RUNNING], dict(updated_at=now, **response),
                claim_token=token)


def skip(session: Session, sample_id: int, token: str, *, error_class: str, error_message: str,
         now: datetime) -> bool:
    """running → skipped: the sample is fine but yields no training example."""
    return _cas(session, sample_id, [SampleState.RUNNING],
                dict(state=SampleState.SKIPPED, claim=None, lease_expires_at=None,
                     error_class=error_class, error_message=error_message, finished_at=now,
                     updated_at=now), claim_token=token)


def retry(session: Session, sample_id: int, token: str, *, next_attempt_at: datetime,
          error_class: str, error_message: str, now: datetime) -> bool:
    """running → pending, due again at ``next_attempt_at`` (the retry waits in SQL)."""
    return _cas(session, sample_id, [SampleState.RUNNING],
                dict(state=SampleState.PENDING, claim=None, server=None, lease_expires_at=None,
                     next_attempt_at=next_attempt_at, error_class=error_class,
                     error_message=error_message, updated_at=now), claim_token=token)


def fail(session: Session, sample_id: int, token: str, *, error_class: str, error_message: str,
         now: datetime) -> bool:
    """running → failed."""
    return _cas(session, sample_id, [SampleState.RUNNING],
                dict(state=SampleState.FAILED, claim=None, lease_expires_at=None,
                     error_class=error_class, error_message=error_message, finished_at=now,
                     updated_at=now), claim_token=token)


def requeue(session: Session, job_id: int, *, classes: Sequence[str] = (),
            sample_ids: Sequence[int] = (), now: datetime) -> int:
    """failed → pending with a fresh attempt budget. Returns how many moved."""
    Sample = _samples()
    conds = [Sample.job_id == job_id, Sample.state == SampleState.FAILED]
    if classes:
        conds.append(Sample.error_class.in_(classes))
    if sample_ids:
        conds.append(Sample.id.in_(sample_ids))
    result = session.execute(
        update(Sample).where(*conds)
        .values(state=SampleState.PENDING, attempts=0, next_attempt_at=now, claim=None,
                server=None, finished_at=None, updated_at=now)
        .execution_options(synchronize_session=False)
    )
    return int(result.rowcount)  # type: ignore[attr-defined]


def expire(session: Session, *, now: datetime, cutoff: datetime | None = None,
           job_ids: Sequence[int] | None = None) -> list[tuple[int, SampleState]]:
    """Sweep: queued/running samples whose lease or queue deadline passed.

    A queued sample whose message never reached a worker, or a running one
    whose worker died, goes back to ``pending`` (due now); a running one that
    has used its last attempt becomes ``failed`` (class ``connection``).
    ``cutoff`` (default ``now``) is the lease time considered expired; the
    embedded runner passes a far future one at start to reclaim everything a
    killed run left in flight. Returns ``(sample_id, new_state)`` for each
    sample moved.
    """
    from synthq.models import Job, Sample

    rows = session.execute(
        select(Sample.id, Sample.state, Sample.attempts, Job.max_attempts)
        .join(Job, Job.id == Sample.job_id)
        .where(Sample.state.in_(INFLIGHT), Sample.lease_expires_at < (cutoff or now),
               *([Sample.job_id.in_(job_ids)] if job_ids is not None else []))
        .with_for_update(of=Sample, skip_locked=True)
    ).all()
    exhausted = [r[0] for r in rows if r[1] == SampleState.RUNNING and r[2] >= r[3]]
    back = [r[0] for r in rows if r[0] not in set(exhausted)]
    stale = [Sample.state.in_(INFLIGHT), Sample.lease_expires_at < (cutoff or now)]
    moved: list[tuple[int, SampleState]] = []
    if back:
        session.execute(
            update(Sample).where(Sample.id.in_(back), *stale)
            .values(state=SampleState.PENDING, claim=None, server=None, lease_expires_at=None,
                    next_attempt_at=now, updated_at=now)
            .execution_options(synchronize_session=False)
        )
        moved += [(i, SampleState.PENDING) for i in back]
    if exhausted:
        session.execute(
            update(Sample).where(Sample.id.in_(exhausted), *stale)
            .values(state=SampleState.FAILED, claim=None, lease_expires_at=None,
                    error_class="connection",
                    error_message="lease expired: the worker stopped reporting on its last attempt",
                    finished_at=now, updated_at=now)
            .execution_options(synchronize_session=False)
        )
        moved += [(i, SampleState.FAILED) for i in exhausted]
    return moved
