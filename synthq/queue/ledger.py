"""The ledger of leased work: one lifecycle and its transitions, for every kind of work.

A *kind* of leased work is a table whose rows a process claims for a while:
samples (generation, :mod:`synthq.queue.states`), captures (hidden states,
:mod:`synthq.queue.capture_states`) and training runs (:mod:`synthq.queue.run_states`).
Each kind is described once by a :class:`Kind` (its table, which of its states
plays which role, where its lease is kept); the transitions below are the
only code that claims, compare-and-sets, expires or requeues a row of any of
them. A kind's own module names its transitions for its callers (``complete``,
``done``, ``finish``...) and adds what is its own (the sample's result, the
capture's file), never the mechanics.

::

    waiting ──claim──▶ held ──finish──▶ done
     ▲  ▲  (offered)    │ │ │
     │  │               │ │ └──fail──▶ failed ──requeue──▶ waiting
     │  └──retry / release┘ │
     └──expire (lease passed or holder dead; failed once its attempts reach the cap)

Samples are *offered* (``queued``) before they are claimed; the other kinds are
claimed straight from ``waiting``. Every transition out of ``held`` presents the
claim token the claim wrote, so a holder whose lease was taken over cannot
write (docs/design.md, invariant 2).

The dead-holder rule is :func:`gone` (a lease passed, or a holder whose heartbeat went
silent: its ``workers`` row's, or for a kind whose row carries it, the row's own, or a
holder known dead) with :func:`synthq.queue.workers.dead_holder_here` (a row's holder that
is a process of this host that no longer exists): every kind's expiry and takeover use
them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from sqlalchemy import and_, bindparam, case, or_, select, text, tuple_, update
from sqlalchemy.orm import Session
from sqlalchemy.sql import ClauseElement

from synthq.core.retry import backoff_delay
from synthq.store.models import Worker

__all__ = ["Kind", "Transition", "TRANSITIONS", "Expired", "allowed", "cas", "cas_many", "move",
           "move_many", "apply", "moved",
           "claim_statement", "claim", "live_workers", "gone", "expire", "requeue",
           "charged", "refund", "retry_or_fail", "retry_delay"]


@dataclass(frozen=True, eq=False)
class Kind:
    """A table of leased work, described by the roles of its columns and states.

    Hashed by identity: one instance per kind, so statements built for it are cached.
    """

    name: str
    #: The ORM class of its table; its columns ``state``, ``claim`` (the token),
    #: ``worker``, ``updated_at``, ``finished_at`` and :attr:`lease` are read by role.
    model: Any
    waiting: str
    held: str
    done: str
    failed: str
    #: The state a row is claimed from when it is not :attr:`waiting` (samples: queued).
    offered: str | None = None
    #: The state a cancelled row ends in (None: the kind is cancelled with its job).
    cancelled: str | None = None
    #: The column of the lease: its end (``expires_at``), or the holder's last beat
    #: (``heartbeat_at``: the lease ends a kind's lease seconds after it).
    lease: str = "expires_at"
    #: Statements run on the session's connection, skipping the ORM's flush: the
    #: per-sample hot path (its ORM machinery cost more CPU than the statements).
    hot: bool = False
    #: What a claim charges to the row's ``attempts`` (its attempt budget): ``"claim"``
    #: every claim; ``"call"`` a claim that makes a call, not one whose :attr:`answer`
    #: column holds a stored answer (it is only processed again); None: the kind keeps
    #: no budget. :func:`charged` and :func:`refund` apply it.
    charge: str | None = None
    #: The column of a stored answer (``charge="call"``).
    answer: str | None = None
    #: Who holds a row, for the dead-holder rule (:func:`gone`): ``"worker"``, a process
    #: with a row in ``workers``, dead once that row's heartbeat is silent; ``"row"``: the
    #: row itself carries its holder's heartbeat (its :attr:`lease`), nothing else does.
    holder: str = "worker"
    #: The attempt budget the sweep holds an expired row to (``dialect name → expression``
    #: over the row and its :attr:`owner`); None: no cap, an expired row always goes back.
    budget: Callable[[str], Any] | None = None
    #: What the budget (and a kind's expiry) reads beside the row: ``(target, on clause)``.
    owner: tuple[Any, Any] | None = None
    #: The failure class (``error_class``) and message of an expired last attempt.
    expired_class: str | None = None
    expired_message: str | None = None
    #: How long a claim's lease lasts, in seconds, from what the kind's holder knows of its
    #: work (:meth:`lease_seconds`: a sample's job, a capture call's timeout; a training
    #: run's, nothing: the service's setting).
    lease_length: Callable[..., float] | None = None
    #: How often its holder renews the lease: ``n`` times a lease (after each ``1/n`` of
    #: it), and at most once in ``renew_floor`` seconds (:meth:`renew_every`); None: never
    #: renewed, the lease set at the claim outlives the work it covers.
    renew_per_lease: int | None = None
    renew_floor: float = 0.0
    #: What becomes of a held row whose work failed (:func:`retry_or_fail`): ``"backoff"``,
    #: a retryable failure due again after the job's backoff (exponential with full jitter,
    #: the server's Retry-After a floor) until its charged attempts reach the job's
    #: ``max_attempts``, a permanent one failed at once; None: no retry (no ``retry``
    #: transition), its holder only hands it back (``release``) or fails it.
    retry: str | None = None

    @property
    def lease_is_deadline(self) -> bool:
        """Whether the lease column holds the lease's end (cleared when the claim ends)."""
        return self.lease != "heartbeat_at"

    @property
    def claimable(self) -> str:
        return self.offered or self.waiting

    @property
    def inflight(self) -> tuple[str, ...]:
        """The states a lease (or a claim deadline) is kept in."""
        return (self.offered, self.held) if self.offered else (self.held,)

    def column(self, name: str) -> Any:
        return getattr(self.model, name)

    def lease_seconds(self, of: Any = None) -> float:
        """Seconds a claim's lease lasts (:attr:`lease_length`), from ``of``: what the
        kind's lease is computed from."""
        if self.lease_length is None:
            raise ValueError(f"{self.name} declares no lease length")
        return float(self.lease_length(of))

    def renew_every(self, lease: float) -> float:
        """Seconds after which the holder of a ``lease``-second lease renews it."""
        if self.renew_per_lease is None:
            raise ValueError(f"{self.name}: its lease is not renewed")
        return max(self.renew_floor, lease / self.renew_per_lease)

    def __post_init__(self) -> None:
        if self.charge not in (None, "claim", "call") or \
                (self.charge == "call") is (self.answer is None):
            raise ValueError(f"{self.name}: charge {self.charge!r} with answer {self.answer!r}")
        if (self.budget is None) is not (self.expired_class is None):
            raise ValueError(f"{self.name}: a budget needs the class its expiry fails with")
        if self.holder not in ("worker", "row") or \
                (self.holder == "row") is self.lease_is_deadline:
            raise ValueError(f"{self.name}: holder {self.holder!r} with lease {self.lease!r}")
        if self.retry not in (None, "backoff") or \
                (self.retry is not None and self.charge is None):
            raise ValueError(f"{self.name}: retry {self.retry!r} needs an attempt budget")
        if self.renew_per_lease is not None and self.renew_per_lease < 2:
            raise ValueError(f"{self.name}: a lease renewed {self.renew_per_lease} times")


class Transition(NamedTuple):
    #: Roles of the states it accepts (``inflight``: offered and held).
    sources: tuple[str, ...]
    #: Role of the state it leads to; None: the state stays.
    target: str | None
    #: Whether the caller must present the claim token.
    token: bool
    #: A fresh attempt budget: ``attempts`` 0, ``finished_at`` cleared.
    fresh: bool = False


#: The lifecycle every kind shares, by transition: which states each accepts, where it
#: leads. A kind uses those whose states it has (a transition through a role the kind
#: lacks, such as ``cancelled`` for samples, is refused by :func:`allowed`).
TRANSITIONS: dict[str, Transition] = {
    # A kind with an offered state: the dispatcher offers a waiting row (with a token
    # and a deadline), and an offer nobody claimed goes back.
    "offer": Transition(("waiting",), "offered", False),
    "unoffer": Transition(("offered",), "waiting", True),
    "claim": Transition(("claimable",), "held", False),
    # An answer that arrived after its holder's lease was given up, kept under its old
    # token when the row is still open (the caller's conditions: no later attempt has
    # finished): the second way into held, named here like the first.
    "keep_late": Transition(("waiting", "inflight"), "held", False),
    "renew": Transition(("held",), None, True),
    "finish": Transition(("held",), "done", True),
    "retry": Transition(("held",), "waiting", True),
    "release": Transition(("held",), "waiting", True),
    "fail": Transition(("held",), "failed", True),
    # The sweep: a holder gone (lease passed, holder dead) gives the row back, or fails
    # it when its attempts reached the cap.
    "expire": Transition(("inflight",), "waiting", False),
    "expire_failed": Transition(("held",), "failed", False),
    # Repairs, with a fresh attempt budget: a failed row again (``requeue``), a done one
    # to be done again (``redo``: a kept truncated answer), a finished one whose input
    # changed (``restale``: a capture of a retokenized sample).
    "requeue": Transition(("failed",), "waiting", False, fresh=True),
    "redo": Transition(("done",), "waiting", False, fresh=True),
    "restale": Transition(("done", "failed"), "waiting", False, fresh=True),
    # A row that is nobody's held work any more: cancelled (held or not), or failed
    # before any holder took it.
    "cancel": Transition(("waiting", "inflight"), "cancelled", False),
    "refuse": Transition(("waiting",), "failed", False),
    # The state stays: a waiting row touched (its message sent again), a done one
    # annotated (what an engine measured of it).
    "touch": Transition(("waiting",), None, False),
    "annotate": Transition(("done",), None, False),
}


def _states(kind: Kind, role: str) -> tuple[str, ...]:
    if role == "inflight":
        return kind.inflight
    state = getattr(kind, role)
    if state is None:
        raise ValueError(f"{kind.name} has no {role} state")
    return (state,)


@functools.lru_cache(maxsize=128)
def allowed(kind: Kind, transition: str) -> tuple[str, ...]:
    """The states of ``kind`` that ``transition`` accepts (a ValueError when the kind has
    no state of one of its roles)."""
    t = TRANSITIONS[transition]
    if transition == "retry" and kind.retry is None:
        raise ValueError(f"{kind.name} has no retry: its holder hands it back (release)")
    if t.target is not None:
        _states(kind, t.target)
    return tuple(s for role in t.sources for s in _states(kind, role))


# -- compare-and-set --------------------------------------------------------------------


def cas(session: Session, kind: Kind, row_id: int, sources: Sequence[str],
        values: Mapping[str, Any], *, token: str | None = None,
        extra: Sequence[Any] = ()) -> bool:
    """``UPDATE kind SET values WHERE id = ? AND state IN sources [AND claim = ?]``:
    whether it won (the one compare-and-set of every kind)."""
    model = kind.model
    if kind.hot and not extra and not any(
            hasattr(v, "__clause_element__") or isinstance(v, ClauseElement)
            for v in values.values()):
        # The hot path: one statement per shape, every value a parameter.
        stmt = _cas_statement(kind, tuple(sources), tuple(values), token is not None)
        params = {f"v_{k}": v for k, v in values.items()}
        params["cas_id"] = row_id
        if token is not None:
            params["cas_token"] = token
        return session.connection().execute(stmt, params).rowcount == 1
    conds = [model.id == row_id, model.state.in_(sources), *extra]
    if token is not None:
        conds.append(model.claim == token)
    return _run(session, update(model).where(and_(*conds)).values(**values),
                hot=kind.hot).rowcount == 1  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=256)
def _cas_statement(kind: Kind, sources: tuple[str, ...], keys: tuple[str, ...],
                   token: bool) -> Any:
    """:func:`cas`'s statement with every value a bound parameter: the same statement object
    each time, so SQLAlchemy's cache key and compiled form are reused (building one per
    write was a tenth of a worker's CPU)."""
    model = kind.model
    columns = model.__table__.c
    conds = [model.id == bindparam("cas_id"), model.state.in_(sources)]
    if token:
        conds.append(model.claim == bindparam("cas_token"))
    return update(model).where(and_(*conds)).values(
        {k: bindparam(f"v_{k}", type_=columns[k].type) for k in keys})


def cas_many(session: Session, kind: Kind, items: Sequence[tuple[int, str]],
             sources: Sequence[str], values: Mapping[str, Any], *,
             returning: Sequence[Any] = ()) -> Any:
    """:func:`cas` for many ``(id, claim token)`` pairs in one statement: the rows
    (``returning``), else how many won."""
    model = kind.model
    stmt = update(model).where(tuple_(model.id, model.claim).in_([tuple(i) for i in items]),
                               model.state.in_(sources)).values(**values)
    if returning:
        return _run(session, stmt.returning(*returning), hot=kind.hot).all()
    return int(_run(session, stmt, hot=kind.hot).rowcount or 0)


def _run(session: Session, statement: Any, params: Any = None, *, hot: bool = False) -> Any:
    """Run a Core statement: on the session's connection when ``hot`` (no ORM flush)."""
    if hot:
        return session.connection().execute(statement, params)
    return session.execute(statement, params,
                           execution_options={"synchronize_session": False})


def move(session: Session, kind: Kind, transition: str, row_id: int, token: str | None, *,
         now: datetime, extra: Sequence[Any] = (), **values: Any) -> bool:
    """One transition of :data:`TRANSITIONS` as a compare-and-set, with what it implies
    (:func:`moved`); ``extra``: the caller's own conditions on the row."""
    return cas(session, kind, row_id, allowed(kind, transition),
               moved(kind, transition, token, now=now, **values), token=token, extra=extra)


def move_many(session: Session, kind: Kind, transition: str, items: Sequence[tuple[int, str]],
              *, now: datetime, **values: Any) -> int:
    """:func:`move` for many ``(id, claim token)`` pairs in one statement: how many won."""
    # (Each pair's token is compared by cas_many.)
    return int(cas_many(session, kind, items, allowed(kind, transition),
                        moved(kind, transition, "each pair's", now=now, **values)))


def apply(session: Session, kind: Kind, transition: str, where: Sequence[Any], *,
          now: datetime, **values: Any) -> int:
    """One transition that presents no token (a repair, a cancel, a touch) over the rows
    of ``where`` in its sources: how many moved."""
    model = kind.model
    stmt = update(model).where(model.state.in_(allowed(kind, transition)), *where)
    result = _run(session, stmt.values(**moved(kind, transition, None, now=now, **values)),
                  hot=kind.hot)
    return int(result.rowcount or 0)


#: Targets that end a row's work: they stamp ``finished_at``.
_FINAL = frozenset({"done", "failed", "cancelled"})


def moved(kind: Kind, transition: str, token: str | None, *, now: Any,
          **values: Any) -> dict[str, Any]:
    """The columns :func:`move` sets: what the transition implies, then ``values`` (the
    kind's own columns; they may override any of these). Into ``held`` or ``offered``,
    the state and ``updated_at`` (the new claim and lease are the caller's); into any
    other state, the claim (and a deadline lease) cleared too; into a final state,
    ``finished_at``; a fresh budget, ``attempts`` 0 and no ``finished_at``."""
    t = TRANSITIONS[transition]
    if t.token and token is None:
        raise ValueError(f"{kind.name} {transition} needs the claim token")
    implied: dict[str, Any] = {}
    if t.target is not None:
        implied["state"] = _states(kind, t.target)[0]
        if t.target not in ("held", "offered"):
            implied["claim"] = None
            if kind.lease_is_deadline:
                implied[kind.lease] = None
        if t.target in _FINAL:
            implied["finished_at"] = now
        implied["updated_at"] = now
    if t.fresh:
        implied.update(attempts=0, finished_at=None)
    return {**implied, **values}


class Move:
    """One :func:`move` as a write the batch writer may merge (synthq.serving.writer): called with
    ``(session, now)`` it is that move alone; :meth:`run_merged` runs many of one shape
    (the same kind, transition and columns) as one statement on PostgreSQL. ``then``
    runs after the compare-and-set with whether it won (an attempt row, say) and gives
    the write's result (by default, whether it won)."""

    __slots__ = ("kind", "transition", "row_id", "token", "values", "then")

    def __init__(self, kind: Kind, transition: str, row_id: int, token: str, *,
                 then: Callable[[Session, bool], Any] | None = None, **values: Any) -> None:
        self.kind, self.transition, self.row_id, self.token = kind, transition, row_id, token
        self.values, self.then = values, then

    def __call__(self, session: Session, now: datetime) -> Any:
        won = move(session, self.kind, self.transition, self.row_id, self.token, now=now,
                   **self.values)
        return self.then(session, won) if self.then is not None else won

    @property
    def shape(self) -> tuple[Any, ...]:
        """Moves of one shape share one merged statement."""
        return (self.kind.name, self.transition, tuple(sorted(self.values)))

    @staticmethod
    def run_merged(session: Session, moves: Sequence[Move], now: datetime) -> list[Any]:
        """``moves`` (one shape, distinct rows) as one ``UPDATE ... FROM unnest(...)``
        compare-and-set on PostgreSQL, each row's own values and token; the results in
        order. Elsewhere, or for one move, each runs alone."""
        bind = session.get_bind()
        ids = [m.row_id for m in moves]
        if len(moves) < 2 or bind.dialect.name != "postgresql" or len(set(ids)) < len(ids):
            return [m(session, now) for m in moves]
        first = moves[0]
        kind = first.kind
        rows = [moved(kind, m.transition, m.token, now=now, **m.values) for m in moves]
        names = tuple(rows[0])
        stmt = _merged_statement(kind, tuple(allowed(kind, first.transition)), names,
                                 bind.dialect)
        columns = kind.model.__table__.c
        params: dict[str, Any] = {"ids": ids, "tokens": [m.token for m in moves]}
        for i, name in enumerate(names):
            process = columns[name].type.dialect_impl(bind.dialect).bind_processor(bind.dialect)
            values = [r[name] for r in rows]
            params[f"c{i}"] = [process(v) for v in values] if process is not None else values
        won = set(session.connection().execute(stmt, params).scalars())
        return [m.then(session, m.row_id in won) if m.then is not None else m.row_id in won
                for m in moves]


@functools.lru_cache(maxsize=64)
def _merged_statement(kind: Kind, sources: tuple[str, ...], names: tuple[str, ...],
                      dialect: Any) -> Any:
    """:meth:`Move.run_merged`'s statement: the same text for any number of rows (each
    column one array parameter), so PostgreSQL plans it once per shape."""
    table = kind.model.__table__
    columns = table.c
    cast = [f"CAST(:c{i} AS {columns[n].type.compile(dialect=dialect)}[])"
            for i, n in enumerate(names)]
    states = ", ".join(f"'{s}'" for s in sources)
    sets = ", ".join(f'"{n}" = u."c{i}"' for i, n in enumerate(names))
    outs = ", ".join(f'"c{i}"' for i in range(len(names)))
    return text(
        f'UPDATE "{table.name}" AS t SET {sets} '
        f"FROM unnest(CAST(:ids AS BIGINT[]), CAST(:tokens AS TEXT[]), {', '.join(cast)}) "
        f"AS u(id, token, {outs}) "
        f"WHERE t.id = u.id AND t.claim = u.token AND t.state IN ({states}) "
        "RETURNING t.id")


# -- claim ------------------------------------------------------------------------------


def claim_statement(kind: Kind, where: Sequence[Any], *, token: Any, worker: Any, lease: Any,
                    now: Any, values: Mapping[str, Any] | None = None,
                    returning: Sequence[Any] = ()) -> Any:
    """``UPDATE kind SET state=held, claim=token, worker, lease, started_at, updated_at,
    attempts (the kind's charge) WHERE where``: the claim of every kind (values may be bound
    parameters, for a statement built once). ``where`` names the rows and their allowed
    states."""
    stmt = update(kind.model).where(*where).values(
        {"state": kind.held, "claim": token, kind.lease: lease, "worker": worker,
         "started_at": now, "updated_at": now, **charged(kind), **(values or {})})
    return stmt.returning(*returning) if returning else stmt


def claim(session: Session, kind: Kind, where: Sequence[Any], *, token: str, worker: str,
          lease: datetime, now: datetime, values: Mapping[str, Any] | None = None,
          returning: Sequence[Any] = ()) -> Any:
    """Run :func:`claim_statement`: the rows claimed (``returning``), else the result."""
    result = _run(session, claim_statement(
        kind, where, token=token, worker=worker, lease=lease, now=now, values=values,
        returning=returning), hot=kind.hot)
    return result.all() if returning else result


# -- expiry -----------------------------------------------------------------------------


def live_workers(*, now: datetime, timeout: float) -> Any:
    """The names of the workers whose row heart-beat within ``timeout`` seconds (a query)."""
    return select(Worker.name).where(Worker.heartbeat_at >= now - timedelta(seconds=timeout))


def gone(kind: Kind, *, now: datetime, cutoff: datetime | None = None,
         lease: float | None = None, worker_timeout: float | None = None,
         dead: Sequence[str] = ()) -> Any:
    """The dead-holder rule, for every kind (by its :attr:`Kind.holder`): an in-flight row
    whose lease passed (its end before ``cutoff``, default ``now``; a heartbeat lease: the
    holder's last beat more than ``lease`` seconds before it), or, with
    ``worker_timeout``, a held row whose holder's ``workers`` row has been silent that
    long (``kill -9``: at once, not after its lease), or a held row of a holder in
    ``dead`` (known gone: :func:`synthq.queue.workers.dead_holder_here`)."""
    model = kind.model
    cutoff = cutoff or now
    if kind.holder == "row":
        if lease is None:
            raise ValueError(f"{kind.name}: its holder's heartbeat needs the lease")
        rule = and_(model.state == kind.held,
                    kind.column(kind.lease) < cutoff - timedelta(seconds=lease))
    else:
        rule = kind.column(kind.lease) < cutoff
        if worker_timeout is not None:
            live = live_workers(now=now, timeout=worker_timeout)
            rule = rule | and_(model.state == kind.held, model.worker.is_not(None),
                               model.worker.not_in(live))
    if dead:
        rule = or_(rule, and_(model.state == kind.held, model.worker.in_(list(dead))))
    return rule


@dataclass(frozen=True, slots=True)
class Expired:
    """What :func:`expire` did: the rows it took (their ``columns``), by new state."""

    rows: list[Any]
    back: list[int]
    failed: list[int]

    def __len__(self) -> int:
        return len(self.back) + len(self.failed)


def expire(session: Session, kind: Kind, *, now: datetime, gone: Any | None,
           scope: Sequence[Any] = (), columns: Sequence[Any] = (),
           back: Mapping[str, Any] | None = None) -> Expired:
    """In-flight rows whose holder is gone (``gone``: :func:`gone`; None: every one) →
    ``waiting``, or → ``failed`` (with the kind's :attr:`~Kind.expired_class`) when held
    and their attempts reached the kind's :attr:`~Kind.budget`. The rows are locked first
    (``SKIP LOCKED``: one its holder is writing is left to it); ``columns`` are read
    beside them (and the kind's :attr:`~Kind.owner`); ``back`` adds the kind's own
    columns to the move back. Returns the rows (id, state, attempts?, cap?, columns...)."""
    model = kind.model
    cap = kind.budget(session.get_bind().dialect.name) if kind.budget is not None else None
    where = [model.state.in_(kind.inflight), *([gone] if gone is not None else []), *scope]
    picked = [model.id, model.state, *([model.attempts, cap] if cap is not None else []),
              *columns]
    query = select(*picked)
    if kind.owner is not None:
        query = query.join(*kind.owner)
    rows = session.execute(query.where(*where)
                           .with_for_update(of=model, skip_locked=True)).all()
    exhausted = {r[0] for r in rows
                 if cap is not None and r[1] == kind.held and r[2] >= r[3]}
    back_ids = [r[0] for r in rows if r[0] not in exhausted]
    if back_ids:
        apply(session, kind, "expire", [model.id.in_(back_ids), *where], now=now,
              **(back or {}))
    if exhausted:
        apply(session, kind, "expire_failed", [model.id.in_(exhausted), *where], now=now,
              error_class=kind.expired_class, error_message=kind.expired_message)
    return Expired(list(rows), back_ids, sorted(exhausted))


# -- repair and retry -------------------------------------------------------------------


def requeue(session: Session, kind: Kind, where: Sequence[Any], *, now: datetime,
            **values: Any) -> int:
    """failed → waiting with a fresh attempt budget, for the rows of ``where``; how many."""
    return apply(session, kind, "requeue", where, now=now, **values)


def charged(kind: Kind) -> dict[str, Any]:
    """The column a claim sets to charge the kind's attempt budget (:attr:`Kind.charge`)."""
    if kind.charge is None:
        return {}
    attempts = kind.column("attempts")
    if kind.charge == "call" and kind.answer is not None:
        return {"attempts": case((kind.column(kind.answer).is_(None), attempts + 1),
                                 else_=attempts)}
    return {"attempts": attempts + 1}


def refund(kind: Kind) -> dict[str, Any]:
    """The column a retry sets to give its claim's charge back: an uncharged retry, whose
    call does not count against the row's attempt budget (a sample's overload answer, a
    capture whose server was down)."""
    if kind.charge is None:
        raise ValueError(f"{kind.name} keeps no attempt budget")
    attempts = kind.column("attempts")
    return {"attempts": attempts - 1}


def retry_or_fail(kind: Kind, exc: Any, attempts: int, job: Any, *,
                  charged: bool = True) -> float | None:
    """The kind's declared retry (:attr:`Kind.retry`) of a held row whose work failed with
    ``exc`` after ``attempts`` charged attempts: seconds before it is due again, or None
    when it fails. ``job``: the job's settings as the row sees them (``max_attempts``,
    ``backoff_base``, ``backoff_cap``; a sample's own overrides on top)."""
    if kind.retry is None:
        raise ValueError(f"{kind.name} has no retry: its holder hands it back (release)")
    return retry_delay(exc, attempts, max_attempts=job.max_attempts, base=job.backoff_base,
                       cap=job.backoff_cap, charged=charged)


def retry_delay(exc: Any, attempts: int, *, max_attempts: int, base: float, cap: float,
                charged: bool = True) -> float | None:
    """Retry or fail, for every kind: seconds before a failed call's row is due again
    (exponential backoff with full jitter, the server's Retry-After a floor), or None when
    it fails for good: a permanent error, or a charged call whose ``attempts`` reached
    ``max_attempts``.

    ``charged=False``: the call is not charged to the budget (a sample's overload answer),
    so the budget does not end it; the caller caps such calls itself."""
    if not getattr(exc, "retryable", False) or (charged and attempts >= max_attempts):
        return None
    return backoff_delay(attempts, base=base, cap=cap,
                         retry_after=getattr(exc, "retry_after", None))
