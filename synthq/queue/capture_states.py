"""Every write to ``captures``: each transition a compare-and-set.

Captures are one kind of leased work (:data:`CAPTURES`): the claim, the
compare-and-set, the expiry and the requeue are :mod:`synthq.queue.ledger`'s.

::

    (done sample) ──add──▶ pending ──claim──▶ running ──done──▶ done
                             ▲  ▲                │ │
                             │  └──retry─────────┘ └──fail──▶ failed
                             └──expire (lease, dead worker)──┘   │
                             └──add (retokenized: new input_ids)──┘──requeue

A capture's claim is taken under a lock per capture server (an advisory lock on
PostgreSQL, :func:`synthq.core.locks.hold`; SQLite's write transactions are serialized
already), so running
captures on one server never exceed its job's ``capture_limit``, however many
processes capture at once. Its samples' rows are never written here.

That limit is one per server for every capture call synthq makes: the stage's (an
inline capture's fallback included), and a streamed run's spool
(:mod:`synthq.queue.spool_states`, a row ``capturing`` on the server). Both claims take
their room from :func:`room`, under the same lock, over :func:`running_on`, which counts
both kinds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Integer, String, func, insert, literal, or_, select
from sqlalchemy.orm import Session

from synthq.core import locks
from synthq.core.enums import CaptureState, JobState, SampleState, SpoolState
from synthq.core.errors import Lost
from synthq.queue import ledger, outage
from synthq.spec.config import get_settings
from synthq.store.models import Capture, CaptureCall, Job, Sample, SpoolItem, UTCDateTime

__all__ = ["CAPTURES", "Claimed", "add_missing", "claim", "done", "retry", "fail", "expire",
           "requeue_failed", "running_on", "room", "record_call", "latest_calls", "server_down",
           "next_probe_s"]

def _lease(call_timeout: float) -> float:
    """A running capture's lease, from its call's timeout (the job's ``capture_timeout``,
    else the service's): the call, then the engine's file (``capture_file_timeout``), and
    a margin. The stage ends each call within those, so it never outlives its lease."""
    settings = get_settings()
    return call_timeout + settings.capture_file_timeout + settings.lease_margin


#: Captures as a kind of leased work: claimed straight from pending, the lease in
#: ``expires_at``, set at the claim to outlive the call and its file, never renewed; every
#: claim charged; a failed call backs off within its budget.
CAPTURES = ledger.Kind("capture", Capture, waiting=CaptureState.PENDING,
                       held=CaptureState.RUNNING, done=CaptureState.DONE,
                       failed=CaptureState.FAILED, lease="expires_at", charge="claim",
                       budget=lambda dialect: Job.max_attempts,
                       owner=(Job, Job.id == Capture.job_id),
                       expired_class=Lost.error_class,
                       expired_message="the capture process stopped before it recorded the "
                                       "call",
                       lease_length=_lease, retry="backoff")


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
    restale = ledger.apply(
        session, CAPTURES, "restale",
        [Capture.job_id == job_id, Capture.tokenize_version.is_distinct_from(current)],
        now=now, tokenize_version=current, path=None, sha256=None, bytes=None,
        error_class=None, error_message=None, next_attempt_at=None)
    return added + restale


def _count(session: Session, statement: Any) -> int:
    """Rows an INSERT/UPDATE changed (on the session's connection: a CursorResult)."""
    result: Any = session.connection().execute(statement)
    return int(result.rowcount or 0)


def running_on(session: Session, server: str) -> int:
    """Capture calls in flight on ``server``, of every kind: the stage's running captures
    and streamed runs' spool rows capturing there (synthq.queue.spool_states.CAPTURE)."""
    stage = session.scalar(select(func.count()).select_from(Capture).where(
        Capture.server == server, Capture.state == CaptureState.RUNNING)) or 0
    spool = session.scalar(select(func.count()).select_from(SpoolItem).where(
        SpoolItem.server == server, SpoolItem.state == SpoolState.CAPTURING)) or 0
    return int(stage) + int(spool)


def room(session: Session, server: str, *, limit: int, most: int, now: datetime) -> int:
    """How many more capture calls may start on ``server`` now (at most ``most``), under
    its lock, held to the caller's commit: the one capture limit per server, whichever
    kind of capture claims (this module's :func:`claim`, the spool's
    :func:`synthq.queue.spool_states.start_capture`); one probe at a time while it is down
    (:func:`synthq.queue.outage.room`)."""
    locks.hold(session, f"capture:{server}")
    return outage.room(limit, running_on(session, server), latest_calls(session, server), now,
                       most=most)


def record_call(session: Session, capture_id: int, *, server: str, outcome: str,
                error_message: str | None, now: datetime) -> None:
    """One call to a capture server and how it ended (``ok`` or its failure class), in
    the transaction that records its capture's outcome: what the down rule reads."""
    session.execute(insert(CaptureCall).values(
        capture_id=capture_id, server=server, ended_at=now, outcome=outcome,
        error_message=None if error_message is None else error_message[:2000]))


def latest_calls(session: Session, server: str) -> list[Any]:
    """The server's latest TRIP_AFTER capture calls (outcome, message, end), newest first:
    what :mod:`synthq.queue.outage` reads."""
    return list(session.execute(
        select(CaptureCall.outcome, CaptureCall.error_message, CaptureCall.ended_at)
        .where(CaptureCall.server == server)
        .order_by(CaptureCall.id.desc()).limit(outage.TRIP_AFTER)).all())


def server_down(session: Session, server: str) -> bool:
    """Whether the capture server is down by its latest calls (the one rule)."""
    return outage.is_down(latest_calls(session, server))


def next_probe_s(session: Session, servers: Sequence[str], *, now: datetime) -> float | None:
    """Seconds until the next probe of those capture servers that are down; None when
    none is."""
    waits = [outage.next_probe_s(latest, now) for latest in
             (latest_calls(session, url) for url in servers) if outage.is_down(latest)]
    return min(waits) if waits else None


def claim(session: Session, job_id: int, *, server: str, limit: int, most: int, worker: str,
          token: str, lease: float, now: datetime) -> list[Claimed]:
    """Up to ``most`` due pending captures of the job → running on ``server``, never
    more than ``limit`` running there in all, nor more than one at a time (a probe, when
    its time has come) while the server is down (:func:`synthq.queue.outage.room`).
    A cancelled job's captures are never claimed (they stay pending: a cancel is final)."""
    if session.scalar(select(Job.state).where(Job.id == job_id)) == JobState.CANCELLED:
        return []
    free = room(session, server, limit=limit, most=most, now=now)
    if free <= 0:
        return []
    due = select(Capture.id).where(
        Capture.job_id == job_id, Capture.state.in_(ledger.allowed(CAPTURES, "claim")),
        or_(Capture.next_attempt_at.is_(None), Capture.next_attempt_at <= now),
    ).order_by(Capture.id).limit(free)
    if session.get_bind().dialect.name == "postgresql":
        due = due.with_for_update(skip_locked=True)
    ids = list(session.scalars(due))
    if not ids:
        return []
    rows = ledger.claim(
        session, CAPTURES, [Capture.id.in_(ids),
                            Capture.state.in_(ledger.allowed(CAPTURES, "claim"))],
        token=token, worker=worker, lease=now + timedelta(seconds=lease), now=now,
        values=dict(server=server, error_class=None, error_message=None),
        returning=(Capture.id, Capture.sample_id, Capture.attempts))
    return [Claimed(cid, sid, token, attempts) for cid, sid, attempts in rows]


def done(session: Session, claimed: Claimed, *, now: datetime, path: str, sha256: str,
         nbytes: int, num_tokens: int, layer_ids: Sequence[int], dtype: str, engine: str,
         engine_model: str) -> bool:
    """running → done, with the stored file."""
    return ledger.move(session, CAPTURES, "finish", claimed.capture_id, claimed.token, now=now,
                       path=path, sha256=sha256, bytes=nbytes, num_tokens=num_tokens,
                       layer_ids=list(layer_ids), dtype=dtype, engine=engine,
                       engine_model=engine_model)


def retry(session: Session, claimed: Claimed, *, now: datetime, next_attempt_at: datetime,
          error_class: str, error_message: str, charge: bool = True) -> bool:
    """running → pending, due again at ``next_attempt_at``; ``charge=False`` gives the
    call back to the capture's attempt budget (its server was down: nothing was computed)."""
    extra = {} if charge else ledger.refund(CAPTURES)
    return ledger.move(session, CAPTURES, "retry", claimed.capture_id, claimed.token, now=now,
                       next_attempt_at=next_attempt_at, error_class=error_class,
                       error_message=error_message[:2000], **extra)


def fail(session: Session, claimed: Claimed, *, now: datetime, error_class: str,
         error_message: str) -> bool:
    """running → failed."""
    return ledger.move(session, CAPTURES, "fail", claimed.capture_id, claimed.token, now=now,
                       error_class=error_class, error_message=error_message[:2000])


def expire(session: Session, *, now: datetime, worker_timeout: float | None = None,
           job_ids: Sequence[int] | None = None, everything: bool = False) -> int:
    """Running captures whose lease passed, whose worker stopped heart-beating (for
    ``worker_timeout`` seconds: :func:`synthq.queue.ledger.gone`), or all of them
    (``everything``: the embedded run holds the data directory, so nothing else can be
    capturing) → pending, or failed once their attempts reach the job's
    ``max_attempts``."""
    gone = ledger.gone(CAPTURES, now=now, worker_timeout=worker_timeout)
    # The row carries its expiry's class back to pending, too.
    return len(ledger.expire(
        session, CAPTURES, now=now, gone=None if everything else gone,
        scope=[Capture.job_id.in_(list(job_ids))] if job_ids is not None else [],
        back=dict(next_attempt_at=now, error_class=CAPTURES.expired_class,
                  error_message=CAPTURES.expired_message)))


def requeue_failed(session: Session, job_id: int, *, now: datetime) -> int:
    """failed → pending with a fresh attempt budget, for every failed capture of the job."""
    return ledger.requeue(session, CAPTURES, [Capture.job_id == job_id], now=now,
                          next_attempt_at=None, error_class=None, error_message=None)
