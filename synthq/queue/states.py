"""Every write to samples and attempts: one module, each transition a compare-and-set.

Samples are one kind of leased work (:data:`SAMPLES`): their claim, their
compare-and-set, their expiry and their requeue are :mod:`synthq.queue.ledger`'s, the
same as captures' and training runs'. Each sample transition is an ``UPDATE ...
WHERE id=? AND state IN (allowed sources) [AND claim=?]`` and returns whether it
won. A duplicate delivery, a worker whose lease expired, or two racing workers
therefore can never write a result twice or overwrite a newer state
(docs/design.md, invariant 2). A call's ``attempts`` row is written by the
transition that records the call's outcome, in the same transaction.

::

    pending ──queue──▶ queued ──claim──▶ running ──complete──▶ done ◀─┐
       ▲  ▲               │                │ │ │                     │ retokenized
       │  └──release──────┘                │ │ └──skip──▶ skipped ───┤ (stored response,
       │  └──expire (deadline)─────────────│─┘                       │  new settings)
       │                                   └──fail──▶ failed ────────┘
       └──retry / expire (lease, dead worker)──┘        │
       └──advance_turn (a turn stored, the next one due)─┘ │
       └──────────────────────requeue───────────────────┘
    (malformed rows are inserted as skipped by enqueue)

A job's own state and settings are :mod:`synthq.queue.jobs`' (a requeue makes a finished
job active again there, in the same transaction).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    Numeric,
    and_,
    bindparam,
    case,
    cast,
    delete,
    event,
    exists,
    func,
    insert,
    or_,
    select,
    tuple_,
    update,
)
from sqlalchemy.orm import Session

from synthq.core.enums import FINISHED, INFLIGHT, JobState, SampleState
from synthq.core.errors import FailureClass
from synthq.queue import ledger
from synthq.queue.jobs import reactivate
from synthq.spec import jobspec
from synthq.spec.config import get_settings
from synthq.store.models import Attempt, Job, Sample

__all__ = [
    "SAMPLES", "SampleState", "JobState", "INFLIGHT", "FINISHED", "Claimed",
    "queue", "claim_batch", "claim", "release", "renew", "renew_many", "attempt_row",
    "complete", "store_response", "advance_turn", "skip", "retry", "fail", "lose", "keep_late",
    "requeue", "expire", "retokenized",
]

def _max_attempts(dialect: str) -> Any:
    """A sample's own bound (``requeue --max-attempts`` stores it in its overrides), else its
    job's. Read so that no stored value can fail the statement, which sweeps every job: a
    number of any size (10**12 does not fit an INTEGER cast), anything else ignored."""
    own = Sample.overrides["max_attempts"]
    if dialect == "postgresql":
        number = case((func.jsonb_typeof(own) == "number", cast(own.as_string(), Numeric)))
    else:
        number = case((func.json_type(Sample.overrides, "$.max_attempts").in_(
            ("integer", "real")), own.as_float()))
    return func.coalesce(number, Job.max_attempts)


def _lease(job: Any) -> float:
    """A running sample's lease, from its job (or the sample's view of it): the worker
    gives up on a silent server after the stall timeout, and the lease outlives that by a
    margin, so a live worker never loses it. No job (a message that names none): a
    generous one, which the first renewal makes the job's own."""
    margin = get_settings().lease_margin
    if job is None:
        return margin + 3600
    # Bounded (a job stored before its timeouts were): now + the lease must stay a date, or
    # one job's value would fail the dispatch of every job.
    return min(job.stall_timeout, job.total_timeout, jobspec.MAX_SECONDS) + margin


#: Samples as a kind of leased work: queued (offered) before they are claimed; the lease
#: (or a queued sample's claim deadline) in ``expires_at``, as long as the job's stall
#: timeout and a margin, renewed after each third of it (by the worker's keepalive); a
#: claim that makes a call is charged; a failed call backs off within its budget; an
#: expired last attempt fails as ``connection``.
SAMPLES = ledger.Kind("sample", Sample, waiting=SampleState.PENDING, held=SampleState.RUNNING,
                      done=SampleState.DONE, failed=SampleState.FAILED,
                      offered=SampleState.QUEUED, lease="expires_at", hot=True,
                      charge="call", answer="response_content", budget=_max_attempts,
                      owner=(Job, Job.id == Sample.job_id),
                      expired_class=FailureClass.CONNECTION.value,
                      expired_message="the worker stopped reporting during its last attempt",
                      lease_length=_lease, renew_per_lease=3, retry="backoff")


#: One sample of a message: its id and the token its dispatch gave it.
Item = tuple[int, str]


@dataclass(frozen=True, slots=True)
class Claimed:
    """A sample a worker now holds (``running``), as the claim returned it."""

    sample_id: int
    job_id: int
    #: Calls counted so far, this one included (if a call is to be made).
    attempts: int
    prompt: list[dict[str, Any]]
    server: str
    #: The token every later transition of this sample must present.
    token: str
    #: Set when an earlier attempt stored the response: no call is needed.
    response_content: str | None
    reasoning_content: str | None
    finish_reason: str | None
    completion_token_ids: bytes | None
    #: The stored answer's tool calls; the row's tools (sent with every call).
    tool_calls: list[dict[str, Any]] | None = None
    tools: dict[str, Any] | None = None
    #: Regenerating every turn: the next turn, how many there are, the answers so far.
    turn: int = 0
    turn_count: int | None = None
    turns: list[dict[str, Any]] | None = None
    #: This sample's settings over its job's (``synthq requeue --max-tokens`` ...).
    overrides: dict[str, Any] | None = None


def _exec(session: Session, statement: Any, params: Any = None) -> Any:
    """Run a Core statement on the session's connection: the ORM's bulk-update
    machinery costs more CPU than the statement itself on the hot path."""
    return session.connection().execute(statement, params)


def _cas(session: Session, sample_id: int, sources: Sequence[SampleState],
         values: dict[str, Any], *, token: str | None = None, extra: Sequence[Any] = ()) -> bool:
    return ledger.cas(session, SAMPLES, sample_id, sources, values, token=token, extra=extra)


def _move(session: Session, transition: str, sample_id: int, token: str, *, now: datetime,
          **values: Any) -> bool:
    return ledger.move(session, SAMPLES, transition, sample_id, token, now=now, **values)


def attempt_row(sample_id: int, *, server: str, worker: str | None, started_at: datetime,
                ended_at: datetime, outcome: str, error_message: str | None,
                latency_s: float | None = None, ttft_s: float | None = None,
                completion_tokens: int | None = None, turn: int | None = None) -> dict[str, Any]:
    """One call's ``attempts`` row (the worker's outcome, its hand-back after a bug, the
    sweep's ``lost``), every column named: a transaction's rows go in one INSERT, which
    takes its columns from the first row, so rows of one shape are what it can take."""
    return dict(sample_id=sample_id, server=server, worker=worker, started_at=started_at,
                ended_at=ended_at, outcome=outcome, error_message=error_message,
                latency_s=latency_s, ttft_s=ttft_s, completion_tokens=completion_tokens,
                turn=turn)


def _attempt(session: Session, attempt: dict[str, Any] | None, *, won: bool) -> None:
    """The call's row. A call whose result could not be written ended ``lost``.

    Rows are gathered and inserted in one statement just before the commit
    (the batch writer records dozens of calls per transaction).
    """
    if attempt is None:
        return
    row = dict(attempt)
    if not won:
        row["outcome"] = "lost"
        row["error_message"] = "lease lost before the result was written"
    rows = session.info.setdefault("synthq_attempts", [])
    if not rows:
        event.listen(session, "before_commit", _insert_attempts, once=True)
    rows.append(row)


def _insert_attempts(session: Session) -> None:
    rows = session.info.pop("synthq_attempts", [])
    if any(r.get("outcome") == "lost" for r in rows):
        rows = [r for r in rows if r.get("outcome") != "lost" or not _logged_by_sweep(session, r)]
    if rows:
        _exec(session, insert(Attempt), rows)


def _lost_rows(sample_id: int, worker: str | None, started: datetime) -> list[Any]:
    """Conditions on the ``lost`` rows of one call: the sweep's (it reclaimed the sample
    from a silent worker) and the worker's own. The sweep's row starts at the claim (the
    worker's own clock), a moment before the worker's; a later claim of the same sample by
    the same worker starts after it."""
    return [Attempt.sample_id == sample_id, Attempt.worker == worker, Attempt.outcome == "lost",
            Attempt.started_at.between(started - timedelta(seconds=120),
                                       started + timedelta(seconds=1))]


def _logged_by_sweep(session: Session, row: dict[str, Any]) -> bool:
    """Whether the sweep already logged this call as ``lost`` (it reclaimed the sample from
    a silent worker, which then woke and found its lease gone): one row per cut call."""
    started = row.get("started_at")
    if started is None:
        return False
    return _exec(session, select(Attempt.id).where(
        *_lost_rows(row["sample_id"], row.get("worker"), started)).limit(1)).first() is not None


# -- dispatch and claim ----------------------------------------------------------------


def queue(session: Session, sample_ids: Sequence[int], *, server: str, token: str,
          deadline: datetime, now: datetime) -> int:
    """pending → queued, for ids the dispatcher locked. Returns how many moved."""
    result = _exec(session, _queue_statement(None), {
        "ids": list(sample_ids), "server": server, "token": token, "deadline": deadline,
        "now": now})
    return int(result.rowcount)


def queue_due(session: Session, due: Any, params: dict[str, Any], *, server: str, token: str,
              deadline: datetime, now: datetime) -> list[tuple[int, int]]:
    """pending → queued for the ids the select ``due`` picks (with ``params``; it may bind
    ``now``), in one statement: the dispatcher's take. Returns ``(id, job_id)`` per row
    moved, by id.

    ``due`` locks what it picks and skips what others hold (``FOR UPDATE SKIP
    LOCKED``), so the pick and the move are one round trip instead of two.
    """
    rows = _exec(session, _queue_statement(due), {
        **params, "server": server, "token": token, "deadline": deadline, "now": now}).all()
    return sorted((int(i), int(j)) for i, j in rows)


@functools.cache
def _queue_statement(due: Any) -> Any:
    """:func:`queue`'s statement (``due`` None: the ids a parameter) or :func:`queue_due`'s
    (built once per ``due``, which is itself built once; see :func:`_claim_statement`)."""
    columns = Sample.__table__.c
    now = bindparam("now", type_=columns["updated_at"].type)
    if due is None:
        which = Sample.id.in_(bindparam("ids", expanding=True))
    else:
        # Computed once, as a table: as ``id IN (subquery)`` the planner may rescan the
        # subquery for each row, and each rescan skips the rows this statement already
        # moved (locked by itself) and picks the next ones, past LIMIT.
        picked = due.cte("due").prefix_with("MATERIALIZED")
        which = Sample.id == picked.c.id
    stmt = (update(Sample)
            .where(which, Sample.state.in_(ledger.allowed(SAMPLES, "offer")))
            .values(ledger.moved(SAMPLES, "offer", None, now=now,
                                 server=bindparam("server", type_=columns["server"].type),
                                 claim=bindparam("token", type_=columns["claim"].type),
                                 expires_at=bindparam("deadline",
                                                      type_=columns["expires_at"].type),
                                 queued_at=now)))
    return stmt if due is None else stmt.returning(Sample.id, Sample.job_id)


def claim_batch(session: Session, items: Sequence[Item], *, new_token: str,
                lease_until: datetime, worker: str, now: datetime) -> list[Claimed]:
    """queued → running for every ``(id, token)`` that still matches, in one statement.

    Only samples of active jobs are claimed; those of paused or cancelled jobs
    go back to ``pending`` (released) in the same transaction. Each claim
    counts an attempt, unless the response is already stored (no call then).
    Stale items (another delivery won, or the sweep took the sample back) are
    left alone and simply absent from the result.
    """
    if not items:
        return []
    rows = _exec(session, _claim_statement(), {
        "items": [tuple(i) for i in items], "new_token": new_token,
        "lease_until": lease_until, "worker": worker, "now": now}).all()
    if len(rows) < len(items):
        won = {r[0] for r in rows}
        release(session, [i for i in items if i[0] not in won], now=now)
    # A queued sample always has its server (queue() sets it).
    return [Claimed(r[0], r[1], r[2], r[3] or [], r[4] or "", new_token, r[5], r[6], r[7], r[8],
                    r[9], r[10], r[11] or 0, r[12], r[13], r[14])
            for r in rows]


@functools.cache
def _claim_statement() -> Any:
    """:func:`claim_batch`'s statement, built once with every value a bound parameter (the
    ``(id, claim)`` pairs expanding): SQLAlchemy reuses its cache key and compiled form.
    Building it per claim was a quarter of a refill dispatch's CPU."""
    columns = Sample.__table__.c
    pairs = tuple_(Sample.id, Sample.claim).in_(bindparam("items", expanding=True))
    job_active = exists().where(Job.id == Sample.job_id, Job.state == JobState.ACTIVE)
    now = bindparam("now", type_=columns["updated_at"].type)
    return ledger.claim_statement(
        SAMPLES, [pairs, Sample.state.in_(ledger.allowed(SAMPLES, "claim")), job_active],
        token=bindparam("new_token", type_=columns["claim"].type),
        lease=bindparam("lease_until", type_=columns["expires_at"].type),
        worker=bindparam("worker", type_=columns["worker"].type), now=now,
        returning=(Sample.id, Sample.job_id, Sample.attempts, Sample.prompt, Sample.server,
                   Sample.response_content, Sample.reasoning_content, Sample.finish_reason,
                   Sample.completion_token_ids, Sample.tool_calls, Sample.tools, Sample.turn,
                   Sample.turn_count, Sample.turns, Sample.overrides))


def claim(session: Session, sample_id: int, token: str, *, new_token: str,
          lease_until: datetime, worker: str, now: datetime) -> Claimed | None:
    """:func:`claim_batch` for one sample: the claim, or None if it lost."""
    won = claim_batch(session, [(sample_id, token)], new_token=new_token,
                      lease_until=lease_until, worker=worker, now=now)
    return won[0] if won else None


def release(session: Session, items: Sequence[Item], *, now: datetime) -> int:
    """queued → pending, for items still queued under their token (their job is not active)."""
    if not items:
        return 0
    return ledger.move_many(session, SAMPLES, "unoffer", items, now=now, server=None)


def renew(session: Session, sample_id: int, token: str, *, lease_until: datetime) -> bool:
    """running → running with a later lease. False means the lease was lost."""
    return ledger.cas(session, SAMPLES, sample_id, ledger.allowed(SAMPLES, "renew"),
                      dict(expires_at=lease_until), token=token)


def renew_many(session: Session, items: Sequence[Item], *, lease_until: datetime) -> set[int]:
    """:func:`renew` for many samples in one statement; returns the ids still held."""
    if not items:
        return set()
    rows = ledger.cas_many(session, SAMPLES, items, ledger.allowed(SAMPLES, "renew"),
                           dict(expires_at=lease_until), returning=(Sample.id,))
    return {r[0] for r in rows}


# -- outcomes of a claimed sample -------------------------------------------------------


def complete(session: Session, sample_id: int, token: str, *, now: datetime,
             attempt: dict[str, Any] | None = None, **result: Any) -> bool:
    """running → done, writing the result in the same statement (invariant 3)."""
    won = _move(session, "finish", sample_id, token, now=now, error_class=None,
                error_message=None, **result)
    _attempt(session, attempt, won=won)
    return won


def completion(sample_id: int, token: str, *, attempt: dict[str, Any] | None = None,
               **result: Any) -> ledger.Move:
    """:func:`complete` as a write the batch writer merges with the others of its shape
    (one statement for a batch's answers, synthq.serving.writer)."""
    def then(session: Session, won: bool) -> bool:
        _attempt(session, attempt, won=won)
        return won

    return ledger.Move(SAMPLES, "finish", sample_id, token, then=then, error_class=None,
                       error_message=None, **result)


def store_response(session: Session, sample_id: int, token: str, *, now: datetime,
                   attempt: dict[str, Any] | None = None, **response: Any) -> bool:
    """running → running, saving the raw response before tokenization (invariant 4)."""
    won = ledger.cas(session, SAMPLES, sample_id, ledger.allowed(SAMPLES, "renew"),
                     dict(updated_at=now, **response), token=token)
    _attempt(session, attempt, won=won)
    return won


def advance_turn(session: Session, sample_id: int, token: str, *, turn: int,
                 turns: list[dict[str, Any]], now: datetime,
                 attempt: dict[str, Any] | None = None) -> bool:
    """running → pending with the turn's answer stored and the next turn due now.

    A conversation regenerated turn by turn goes round the usual states once per
    turn (docs/design.md, "States"); each turn gets a fresh attempt budget.
    """
    won = _move(session, "release", sample_id, token, now=now, server=None,
                next_attempt_at=now, attempts=0, turn=turn, turns=turns, error_class=None,
                error_message=None)
    _attempt(session, attempt, won=won)
    return won


def skip(session: Session, sample_id: int, token: str, *, error_class: str, error_message: str,
         now: datetime) -> bool:
    """running → skipped: the sample is fine but yields no training example."""
    # Like ``fail``, into the sample's own final state.
    return _move(session, "fail", sample_id, token, now=now, state=SampleState.SKIPPED,
                 error_class=error_class, error_message=error_message)


def retry(session: Session, sample_id: int, token: str, *, next_attempt_at: datetime,
          error_class: str, error_message: str, now: datetime,
          attempt: dict[str, Any] | None = None, charge: bool = True) -> bool:
    """running → pending, due again at ``next_attempt_at`` (the retry waits in SQL).

    ``charge=False`` gives the call back to the sample's attempt budget (an
    overload answer: the server asked us to come back later)."""
    extra = {} if charge else ledger.refund(SAMPLES)
    won = _move(session, "retry", sample_id, token, now=now, server=None,
                last_server=Sample.server, next_attempt_at=next_attempt_at,
                error_class=error_class, error_message=error_message, **extra)
    _attempt(session, attempt, won=won)
    return won


def fail(session: Session, sample_id: int, token: str, *, error_class: str, error_message: str,
         now: datetime, attempt: dict[str, Any] | None = None) -> bool:
    """running → failed."""
    won = _move(session, "fail", sample_id, token, now=now, error_class=error_class,
                error_message=error_message)
    _attempt(session, attempt, won=won)
    return won


def lose(session: Session, *, attempt: dict[str, Any]) -> bool:
    """The lease was lost mid-call: the sample is someone else's; only the call is logged."""
    _attempt(session, {**attempt, "outcome": "lost"}, won=True)
    return False


def keep_late(session: Session, sample_id: int, token: str, *, worker: str, server: str,
              turn: int, started_at: datetime, lease_until: datetime, now: datetime) -> bool:
    """pending, queued or running (another holder) → running under ``token`` again: an
    answer that arrived after its lease was given up (the sweep counted its worker dead,
    or the lease ran out) is kept when no later attempt has finished, i.e. the sample is
    still open at the same turn with no answer stored, and its job is not cancelled.

    The caller then writes the answer with ``token`` in the same transaction. A later
    holder's writes lose their compare-and-set from here (its renewal cuts its call); a
    later attempt that finished first makes this one lose: the result is written once.
    The ``lost`` rows of this call (the sweep's, the worker's own) go: it was answered."""
    job_open = exists().where(Job.id == Sample.job_id,
                              Job.state.in_([JobState.ACTIVE, JobState.PAUSED]))
    won = ledger.move(session, SAMPLES, "keep_late", sample_id, None, now=now,
                      extra=[Sample.response_content.is_(None), Sample.turn == turn,
                             job_open],
                      claim=token, worker=worker, server=server, expires_at=lease_until)
    if won:
        _exec(session, delete(Attempt).where(*_lost_rows(sample_id, worker, started_at)))
    return won


# -- repair ---------------------------------------------------------------------------


#: Columns of a generated answer and its example, cleared when a kept truncated
#: sample is requeued to be generated again.
_ANSWER_COLUMNS = ("response_content", "reasoning_content", "finish_reason", "prompt_tokens",
                   "completion_tokens", "prompt_token_ids", "completion_token_ids", "tool_calls",
                   "repairs", "input_ids", "loss_mask", "num_tokens", "num_supervised",
                   "tokenize_version", "token_mismatch", "cut_at_turn", "cut_reason",
                   "examples")


def requeue(session: Session, job_id: int, *, classes: Sequence[str] = (),
            sample_ids: Sequence[int] = (), now: datetime,
            overrides: dict[str, Any] | None = None) -> int:
    """failed → pending with a fresh attempt budget. Returns how many moved.

    Class ``truncated`` also takes the done samples whose answer hit max_tokens
    (a job that keeps truncated answers): done → pending, their answer cleared
    (for a conversation regenerated turn by turn, its last turn's). ``overrides``
    (max_tokens, temperature, ...) are merged into each requeued sample's own
    settings; the others keep theirs. A finished job becomes active again in the
    same transaction.
    """
    scope = [Sample.job_id == job_id]
    if classes:
        scope.append(Sample.error_class.in_(classes))
    if sample_ids:
        scope.append(Sample.id.in_(sample_ids))
    #: The sample's own columns of a requeue (ledger.requeue sets the rest).
    again = dict(next_attempt_at=now, server=None)
    kept: list[Any] = []
    if "truncated" in classes:
        kept = [Sample.job_id == job_id, Sample.state == SampleState.DONE,
                Sample.finish_reason == "length",
                *([Sample.id.in_(sample_ids)] if sample_ids else [])]
    if not overrides and not kept:
        moved = ledger.requeue(session, SAMPLES, scope, now=now, **again)
    else:
        moved = _requeue_rows(session, scope, kept, again, overrides or {}, now=now)
    if moved:
        reactivate(session, job_id, now=now)
    return moved


def _requeue_rows(session: Session, scope: list[Any], kept: list[Any],
                  again: dict[str, Any], overrides: dict[str, Any], *, now: datetime) -> int:
    """:func:`requeue` row by row: each sample's own overrides merged, answers cleared."""
    conds = [Sample.state == SampleState.FAILED, *scope]
    where = or_(and_(*conds), and_(*kept)) if kept else and_(*conds)
    rows = session.execute(
        select(Sample.id, Sample.state, Sample.overrides, Sample.turns)
        .where(where).with_for_update()).all()
    groups: dict[str, list[int]] = {}
    moved = 0
    for sid, state, own, answers in rows:
        merged = {**(own or {}), **overrides} or None
        if str(state) == SampleState.DONE:  # a kept truncated answer: generate it again
            values: dict[str, Any] = {**again, **dict.fromkeys(_ANSWER_COLUMNS),
                                      "overrides": merged}
            if answers:
                values.update(turns=answers[:-1], turn=len(answers) - 1)
            moved += ledger.move(session, SAMPLES, "redo", sid, None, now=now, **values)
            continue
        groups.setdefault(json.dumps(merged, sort_keys=True), []).append(sid)
    for key, ids in groups.items():
        for start in range(0, len(ids), 1000):
            chunk = ids[start:start + 1000]
            moved += ledger.requeue(session, SAMPLES, [Sample.id.in_(chunk)], now=now,
                                    overrides=json.loads(key), **again)
    return moved


def retokenized(session: Session, sample_id: int, *, still_stale: Any, state: SampleState,
                now: datetime, **values: Any) -> bool:
    """done/failed/skipped → done/failed/skipped with a new example (``synthq retokenize``).

    ``still_stale`` is the condition that made the sample eligible (it has a
    stored response and an example older than the job's tokenize version);
    a sample that another batch already recomputed is left alone.
    """
    return _cas(session, sample_id, FINISHED, dict(state=state, updated_at=now, **values),
                extra=[still_stale])


# -- the sweep --------------------------------------------------------------------------


def expire(session: Session, *, now: datetime, cutoff: datetime | None = None,
           job_ids: Sequence[int] | None = None,
           worker_timeout: float | None = None) -> list[tuple[int, SampleState]]:
    """Sweep: in-flight samples whose holder is gone.

    * a queued sample past its deadline (its message never reached a worker);
    * a running sample whose lease passed ``cutoff`` (default ``now``);
    * with ``worker_timeout``, a running sample whose worker has not
      heart-beaten for that many seconds (``kill -9``): at once, not after
      its lease.

    Each goes back to ``pending`` (due now), or to ``failed`` (class
    ``connection``) if it was running its last attempt. A running sample's
    call is logged as a ``lost`` attempt. The embedded runner passes a far
    future ``cutoff`` at start to reclaim everything a killed run left in
    flight. Returns ``(sample_id, new_state)`` for each sample moved.
    """
    expired = ledger.expire(
        session, SAMPLES, now=now,
        gone=ledger.gone(SAMPLES, now=now, cutoff=cutoff, worker_timeout=worker_timeout),
        scope=[Sample.job_id.in_(job_ids)] if job_ids is not None else [],
        columns=(Sample.server, Sample.worker, Sample.started_at,
                 Sample.response_content.is_(None),
                 case((Job.regenerate == "all", Sample.turn), else_=None)),
        back=dict(server=None,
                  last_server=case((Sample.state == SampleState.RUNNING, Sample.server),
                                   else_=Sample.last_server),
                  next_attempt_at=now))
    # The calls those workers were making never ended: log them as lost.
    # (rows: id, state, attempts, cap, server, worker, started_at, unanswered, turn)
    lost = [attempt_row(r[0], server=r[4], worker=r[5], started_at=r[6] or now, ended_at=now,
                        outcome="lost", turn=r[8],
                        error_message="the worker stopped reporting during the call")
            for r in expired.rows if r[1] == SampleState.RUNNING and r[4] and r[7]]
    if lost:
        session.execute(insert(Attempt), lost)
    return [*((i, SampleState.PENDING) for i in expired.back),
            *((i, SampleState.FAILED) for i in expired.failed)]
