"""Every write to ``captures``: each transition a compare-and-set.

::

    (done sample) ──add──▶ pending ──claim──▶ running ──done──▶ done
                             ▲  ▲                │ │
                             │  └──retry─────────┘ └──fail──▶ failed
                             └──expire (lease, dead worker)──┘   │
                             └──add (retokenized: new input_ids)──┘──requeue

A capture's claim is taken under a lock per capture server (an advisory lock on
PostgreSQL; SQLite's write transactions are serialized already), so running
captures on one server never exceed its job's ``capture_limit``, however many
processes capture at once. Its samples' rows are never written here.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Integer, String, and_, func, insert, literal, or_, select, text, update
from sqlalchemy.orm import Session

from synthq.enums import CaptureState, SampleState
from synthq.models import Capture, Job, Sample, UTCDateTime

__all__ = ["Claimed", "add_missing", "claim", "done", "retry", "fail", "expire",
           "requeue_failed", "running_on"]


@dataclass(frozen=True, slots=True)
class Claimed:
    capture_id: int
    sample_id: int
    token: str
    attempts: int


def add_missing(session: Session, job_id: int, *, now: datetime) -> int:
    """A pending capture for every done sample of the job that has none, and back to
    pending for captures of an older tokenization (their ``input_ids`` changed)."""
    has_row = select(Capture.id).where(Capture.sample_id == Sample.id).exists()
    rows = select(
        Sample.id, Sample.job_id, Sample.tokenize_version,
        literal(CaptureState.PENDING.value, String(16)), literal(0, Integer()),
        literal(now, UTCDateTime()), literal(now, UTCDateTime()),
    ).where(Sample.job_id == job_id, Sample.state == SampleState.DONE,
            Sample.input_ids.is_not(None), ~has_row)
    added = _count(session, insert(Capture).from_select(
        ["sample_id", "job_id", "tokenize_version", "state", "attempts", "created_at",
         "updated_at"], rows))
    current = select(Sample.tokenize_version).where(Sample.id == Capture.sample_id) \
        .scalar_subquery()
    restale = session.execute(update(Capture).where(
        Capture.job_id == job_id,
        Capture.state.in_([CaptureState.DONE, CaptureState.FAILED]),
        Capture.tokenize_version.is_distinct_from(current)).values(
        state=CaptureState.PENDING, tokenize_version=current, attempts=0, path=None,
        sha256=None, bytes=None, error_class=None, error_message=None, next_attempt_at=None,
        updated_at=now).execution_options(synchronize_session=False)).rowcount or 0  # type: ignore[attr-defined]
    return added + restale


def _count(session: Session, statement: Any) -> int:
    """Rows an INSERT/UPDATE changed (on the session's connection: a CursorResult)."""
    result: Any = session.connection().execute(statement)
    return int(result.rowcount or 0)


def _lock(session: Session, server: str) -> None:
    if session.get_bind().dialect.name == "postgresql":
        key = int.from_bytes(hashlib.sha256(f"capture:{server}".encode()).digest()[:8],
                             "big", signed=True)
        session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": key})


def running_on(session: Session, server: str) -> int:
    return session.scalar(select(func.count()).select_from(Capture).where(
        Capture.server == server, Capture.state == CaptureState.RUNNING)) or 0


def claim(session: Session, job_id: int, *, server: str, limit: int, most: int, worker: str,
          token: str, lease: float, now: datetime) -> list[Claimed]:
    """Up to ``most`` due pending captures of the job → running on ``server``, never
    more than ``limit`` running there in all."""
    _lock(session, server)
    room = min(most, limit - running_on(session, server))
    if room <= 0:
        return []
    due = select(Capture.id).where(
        Capture.job_id == job_id, Capture.state == CaptureState.PENDING,
        or_(Capture.next_attempt_at.is_(None), Capture.next_attempt_at <= now),
    ).order_by(Capture.id).limit(room)
    if session.get_bind().dialect.name == "postgresql":
        due = due.with_for_update(skip_locked=True)
    ids = list(session.scalars(due))
    if not ids:
        return []
    rows = session.execute(update(Capture).where(
        Capture.id.in_(ids), Capture.state == CaptureState.PENDING).values(
        state=CaptureState.RUNNING, claim=token, worker=worker, server=server,
        attempts=Capture.attempts + 1, lease_expires_at=now + timedelta(seconds=lease),
        started_at=now, updated_at=now, error_class=None, error_message=None,
    ).returning(Capture.id, Capture.sample_id, Capture.attempts)
        .execution_options(synchronize_session=False)).all()
    return [Claimed(cid, sid, token, attempts) for cid, sid, attempts in rows]


def _cas(session: Session, claimed: Claimed, values: dict[str, Any], *, now: datetime) -> bool:
    result = session.execute(update(Capture).where(
        Capture.id == claimed.capture_id, Capture.state == CaptureState.RUNNING,
        Capture.claim == claimed.token).values(updated_at=now, **values)
        .execution_options(synchronize_session=False))
    return bool(result.rowcount)  # type: ignore[attr-defined]


def done(session: Session, claimed: Claimed, *, now: datetime, path: str, sha256: str,
         nbytes: int, num_tokens: int, layer_ids: Sequence[int], dtype: str, engine: str,
         engine_model: str) -> bool:
    return _cas(session, claimed, dict(
        state=CaptureState.DONE, claim=None, lease_expires_at=None, finished_at=now, path=path,
        sha256=sha256, bytes=nbytes, num_tokens=num_tokens, layer_ids=list(layer_ids),
        dtype=dtype, engine=engine, engine_model=engine_model), now=now)


def retry(session: Session, claimed: Claimed, *, now: datetime, next_attempt_at: datetime,
          error_class: str, error_message: str) -> bool:
    return _cas(session, claimed, dict(
        state=CaptureState.PENDING, claim=None, lease_expires_at=None,
        next_attempt_at=next_attempt_at, error_class=error_class,
        error_message=error_message[:2000]), now=now)


def fail(session: Session, claimed: Claimed, *, now: datetime, error_class: str,
         error_message: str) -> bool:
    return _cas(session, claimed, dict(
        state=CaptureState.FAILED, claim=None, lease_expires_at=None, finished_at=now,
        error_class=error_class, error_message=error_message[:2000]), now=now)


def expire(session: Session, *, now: datetime, live_workers: Sequence[str] | None = None,
           job_ids: Sequence[int] | None = None, everything: bool = False) -> int:
    """Running captures whose lease passed, whose worker stopped heart-beating (not in
    ``live_workers``), or all of them (``everything``: the embedded run holds the
    data directory, so nothing else can be capturing) → pending, or failed once
    their attempts reach the job's ``max_attempts``."""
    lost = [Capture.lease_expires_at < now]
    if live_workers is not None:
        lost.append(Capture.worker.not_in(list(live_workers)) if live_workers
                    else Capture.worker.is_not(None))
    where = [Capture.state == CaptureState.RUNNING]
    if not everything:
        where.append(or_(*lost))
    if job_ids is not None:
        where.append(Capture.job_id.in_(list(job_ids)))
    limit = select(Job.max_attempts).where(Job.id == Capture.job_id).scalar_subquery()
    common = dict(claim=None, lease_expires_at=None, updated_at=now, error_class="lost",
                  error_message="the capture process stopped before it recorded the call")
    failed = session.execute(update(Capture).where(and_(*where), Capture.attempts >= limit)
                             .values(state=CaptureState.FAILED, finished_at=now, **common)
                             .execution_options(synchronize_session=False)).rowcount or 0  # type: ignore[attr-defined]
    back = session.execute(update(Capture).where(and_(*where))
                           .values(state=CaptureState.PENDING, next_attempt_at=now, **common)
                           .execution_options(synchronize_session=False)).rowcount or 0  # type: ignore[attr-defined]
    return failed + back


def requeue_failed(session: Session, job_id: int, *, now: datetime) -> int:
    return session.execute(update(Capture).where(
        Capture.job_id == job_id, Capture.state == CaptureState.FAILED).values(
        state=CaptureState.PENDING, attempts=0, next_attempt_at=None, error_class=None,
        error_message=None, finished_at=None, updated_at=now)
        .execution_options(synchronize_session=False)).rowcount or 0  # type: ignore[attr-defined]
