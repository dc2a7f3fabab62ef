"""The dispatcher.

The dispatcher moves due ``pending`` samples of active jobs to ``queued`` and
hands them to a publisher (Celery's ``generate`` queue, or the embedded
runner's thread pool), never letting queued + running on a server exceed its
limit (docs/design.md, invariant 5), nor queueing more than the live workers' free
slots. Several dispatchers may run at once (beat, and each worker's refill):
on PostgreSQL a run computes the room under a transaction-scoped advisory
lock, and ``FOR UPDATE SKIP LOCKED`` keeps two dispatchers from taking the
same sample. On SQLite every write transaction is ``BEGIN IMMEDIATE``, which
serializes them outright.

Publishing happens after the commit. If the process dies in between, or the
broker loses the message, the queued sample's deadline passes and the sweep
(:mod:`synthq.queue.sweep`) returns it to ``pending``: the table is the truth, the
broker carries hints.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import String, bindparam, func, literal, or_, select, true, union_all
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Session

from synthq.core import locks
from synthq.core.enums import INFLIGHT, JobState, SampleState
from synthq.queue import outage, states
from synthq.queue.limits import current_limits, start_limit
from synthq.queue.outage import TRIP_AFTER
from synthq.spec.config import get_settings
from synthq.store.db import session_scope, utcnow
from synthq.store.models import Attempt, Job, Sample, Server, Worker

__all__ = ["Dispatched", "Publisher", "LocalClaim", "dispatch", "inflight_by_server",
           "server_is_down", "active_servers", "adopt_stale"]


@dataclass(frozen=True, slots=True)
class Dispatched:
    sample_id: int
    token: str
    server: str
    job_id: int


#: Receives the samples one dispatcher run queued, after their commit.
Publisher = Callable[[Sequence[Dispatched]], None]


@dataclass(slots=True)
class LocalClaim:
    """A worker's refill that keeps what it queues (``dispatch(local=...)``).

    Up to ``room`` of the samples a dispatch queues are claimed for ``worker`` in
    the same transaction (queued → running, the same compare-and-set as a claim
    from a message) and handed to ``start`` after the commit: a freed slot is
    refilled without the broker round trip and a second transaction. The limit
    stays exact: they were queued under the dispatcher's lock like any other.
    """

    worker: str
    room: int
    #: The lease, in seconds, of a running sample of this job (read through the
    #: dispatch's session, which holds SQLite's write lock).
    lease: Callable[[Session, int], float]
    #: Runs the claimed samples (after the commit); must not raise.
    start: Callable[[list[states.Claimed]], None]


@dataclass(slots=True)
class _Server:
    url: str
    limit: int
    job_ids: list[int] = field(default_factory=list)
    #: Its latest calls all failed to connect: one probe at a time.
    down: bool = False
    #: It failed its health probe (synthq.serving.health): nothing is sent to it.
    unhealthy: bool = False
    #: One of its jobs has other servers too: retries prefer those.
    shared: bool = False

    @property
    def effective_limit(self) -> int:
        if self.unhealthy:
            return 0
        return 1 if self.down else self.limit


# The refill path's statements are built once, every value a bound parameter (lists
# expanding): SQLAlchemy then reuses their cache keys and compiled forms. Building them
# per dispatch was half of a refill dispatch's CPU.


@functools.cache
def _servers_statement(some: bool) -> Any:
    query = select(Job.id, Job.servers, Job.inflight_limit, Job.inflight_auto,
                   Job.min_inflight).where(Job.state == JobState.ACTIVE)
    return query.where(Job.id.in_(bindparam("job_ids", expanding=True))) if some else query


def _servers(session: Session, job_ids: Sequence[int] | None) -> list[_Server]:
    servers: dict[str, _Server] = {}
    auto: dict[str, tuple[int, int]] = {}
    params = {"job_ids": list(job_ids)} if job_ids is not None else {}
    for job_id, urls, limit, is_auto, floor in session.execute(
            _servers_statement(job_ids is not None), params):
        for url in urls:
            entry = servers.setdefault(url, _Server(url, limit))
            # Two jobs on one server: the stricter limit holds for both.
            entry.limit = min(entry.limit, limit)
            entry.job_ids.append(job_id)
            entry.shared = entry.shared or len(urls) > 1
            if is_auto:
                old = auto.get(url)
                auto[url] = (floor, limit) if old is None else (min(old[0], floor),
                                                                min(old[1], limit))
    if auto:
        # --inflight auto: the server's adaptive limit (synthq.serving.adaptive), within the cap.
        rows = current_limits(session, list(auto))
        for url, (floor, cap) in auto.items():
            row = rows.get(url)
            adaptive = row.limit_target if row is not None and row.limit_target is not None \
                else start_limit(min(floor, cap), cap)
            servers[url].limit = min(servers[url].limit, adaptive)
    return list(servers.values())


def inflight_by_server(session: Session) -> dict[str, int]:
    """Samples queued or running, per server."""
    rows = session.execute(
        select(Sample.server, func.count()).where(Sample.state.in_(INFLIGHT))
        .group_by(Sample.server)
    )
    return {url: n for url, n in rows if url}


@dataclass(slots=True)
class _Load:
    by_server: dict[str, int]
    #: Samples queued or running in all: the workers' held slots.
    held: int
    #: The live workers' capacity (None when not asked for).
    capacity: int | None
    #: Servers whose last health probe failed (what synthq.serving.health.unhealthy lists).
    sick: set[str]
    #: Each server's latest TRIP_AFTER calls, newest first (:func:`_latest_calls`).
    latest: dict[str, list[Any]] = field(default_factory=dict)


def _load(session: Session, urls: Sequence[str], *, capacity_since: datetime | None) -> _Load:
    """The in-flight count per server, the servers that failed their probe, each
    server's latest calls and (with ``capacity_since``) the live workers' capacity, in
    one statement on PostgreSQL: a refill runs this for every few freed slots, and in a
    busy worker each round trip is a wait for the GIL. Rows are tagged: 0 in flight,
    1 unhealthy, 2 capacity, 3 a latest call (SQLite reads those per server: it has no
    LATERAL)."""
    lateral = session.get_bind().dialect.name == "postgresql"
    params: dict[str, Any] = {"urls": list(urls)}
    if capacity_since is not None:
        params["since"] = capacity_since
    if lateral:
        params["latest_urls"] = list(urls)
    load = _Load({}, 0, None, set())
    calls: dict[str, list[tuple[int, Any]]] = {url: [] for url in urls}
    for tag, url, n, *call in session.execute(
            _load_statement(capacity_since is not None, lateral), params):
        if tag == 0:
            load.held += n
            if url:
                load.by_server[url] = n
        elif tag == 1 and url is not None:
            load.sick.add(url)
        elif tag == 3:
            calls[url].append((n, tuple(call)))  # n: the attempt's id
        else:
            load.capacity = int(n)
    for url in urls:
        load.latest[url] = ([c for _, c in sorted(calls[url], key=lambda r: -r[0])] if lateral
                            else _latest_calls(session, url))
    return load


@functools.cache
def _load_statement(capacity: bool, lateral: bool) -> Any:
    no_text, no_time = literal(None, String), literal(None, Attempt.__table__.c["ended_at"].type)
    parts = [
        select(literal(0), Sample.server, func.count(), no_text, no_text, no_time)
        .where(Sample.state.in_(INFLIGHT)).group_by(Sample.server),
        select(literal(1), Server.url, literal(0), no_text, no_text, no_time)
        .where(Server.url.in_(bindparam("urls", expanding=True)), Server.healthy.is_(False)),
    ]
    if capacity:
        since = bindparam("since", type_=Worker.__table__.c["heartbeat_at"].type)
        parts.append(select(literal(2), literal(None, String),
                            func.coalesce(func.sum(Worker.capacity), 0), no_text, no_text,
                            no_time)
                     .where(Worker.heartbeat_at >= since))
    if lateral:
        server = Attempt.__table__.c["server"]
        url = (func.unnest(bindparam("latest_urls", type_=ARRAY(server.type)))
               .table_valued("url").render_derived(name="u", with_types=False))
        calls = (select(Attempt.id, Attempt.outcome, Attempt.error_message, Attempt.ended_at)
                 .where(Attempt.server == url.c.url)
                 .order_by(Attempt.id.desc()).limit(TRIP_AFTER).lateral("a"))
        parts.append(select(literal(3), url.c.url, calls.c.id, calls.c.outcome,
                            calls.c.error_message, calls.c.ended_at)
                     .select_from(url.join(calls, true())))
    return union_all(*parts)


def server_is_down(session: Session, url: str) -> bool:
    """Whether the server is down by its latest generation calls (the one rule,
    :func:`synthq.queue.outage.is_down`): derived from the attempts table, so every
    dispatcher agrees. A server that answers ``/health`` but hangs or answers 503 to
    every generation is down too."""
    return outage.is_down(_latest_calls(session, url))


def _latest_calls(session: Session, url: str) -> list[Any]:
    """The server's latest TRIP_AFTER attempts (outcome, message, end), newest first:
    one read answers both "is it down" and "is its probe due"."""
    return list(session.execute(_latest_statement(), {"url": url}).all())


@functools.cache
def _latest_statement() -> Any:
    return (select(Attempt.outcome, Attempt.error_message, Attempt.ended_at)
            .where(Attempt.server == bindparam("url", type_=Attempt.__table__.c["server"].type))
            .order_by(Attempt.id.desc()).limit(TRIP_AFTER))


#: Advisory-lock key that serializes dispatchers (room per server and worker capacity).
_LOCK_KEY = locks.DISPATCH


def _preference(server: _Server) -> str | None:
    """The first round's filter for a server (a :func:`_take_statement` kind); the second
    round takes any due sample.

    A probe of a down server takes a sample that has not failed yet ("fresh"), so
    probing does not wear out one sample's attempts; with other servers on the job, a
    sample that just failed on this server goes to another one first ("elsewhere").
    """
    if server.down:
        return "fresh"
    if server.shared:
        return "elsewhere"
    return None


def _fallback(server: _Server) -> str | None:
    """The second round's filter: any due sample, except that a down server's probe never
    takes one that last failed on it while the job has other servers to send it to (a
    chaos run's probe took a sample retried from the hanging server while the good one
    was at its limit: the retry went back where it had just hung)."""
    return "elsewhere" if server.down and server.shared else None


@functools.cache
def _take_statement(kind: str | None) -> Any:
    """Up to ``:room`` due samples of ``:job_ids`` (locked, others' locks skipped), in
    the order they fell due; ``kind`` is :func:`_preference`'s filter."""
    extra: list[Any] = []
    if kind == "fresh":
        extra = [Sample.attempts == 0]
    elif kind == "elsewhere":
        url = bindparam("url", type_=Sample.__table__.c["last_server"].type)
        extra = [or_(Sample.last_server.is_(None), Sample.last_server != url)]
    return (select(Sample.id)
            .where(Sample.job_id.in_(bindparam("job_ids", expanding=True)),
                   Sample.state == SampleState.PENDING,
                   Sample.next_attempt_at <= bindparam(
                       "now", type_=Sample.__table__.c["next_attempt_at"].type), *extra)
            .order_by(Sample.next_attempt_at, Sample.id)
            .limit(bindparam("room"))
            .with_for_update(of=Sample, skip_locked=True))


def _take(s: Session, server: _Server, room: int, now: datetime, queued_timeout: float,
          kind: str | None) -> list[Dispatched]:
    """Move up to ``room`` due samples of the server's jobs (of :func:`_preference`'s
    ``kind``) to queued, in one statement (the rows locked, others' locks skipped)."""
    params = {"job_ids": list(server.job_ids), "room": room}
    if kind == "elsewhere":
        params["url"] = server.url
    token = secrets.token_hex(16)
    rows = states.queue_due(s, _take_statement(kind), params, server=server.url, token=token,
                            now=now, deadline=now + timedelta(seconds=queued_timeout))
    return [Dispatched(i, token, server.url, job_id) for i, job_id in rows]


def active_servers(job_ids: Sequence[int] | None = None) -> list[str]:
    """Base URLs of the active jobs' servers (what the health probe watches)."""
    with session_scope() as s:
        return [x.url for x in _servers(s, job_ids)]


def dispatch(publish: Publisher, *, job_ids: Sequence[int] | None = None,
             server: str | None = None, capacity: int | None = None,
             local: LocalClaim | None = None) -> int:
    """Queue what is due, within each server's limit and the workers' free slots.

    ``capacity`` is how many more samples may be queued in all; by default
    the live workers' free capacity (``workers`` table) when a broker is
    configured, unbounded in embedded mode (the runner passes its own). One
    transaction under one advisory lock (PostgreSQL), so concurrent
    dispatchers never overfill a server or the workers. ``publish`` gets each
    server's samples after the commit; with ``local``, the worker's own share
    is claimed for it instead (:class:`LocalClaim`). Returns the count.
    """
    settings = get_settings()
    with session_scope() as s:
        locks.hold(s, _LOCK_KEY)
        now = utcnow()
        servers = _servers(s, job_ids)
        if server is not None:
            servers = [x for x in servers if x.url == server]
        if not servers:
            return 0
        count_workers = capacity is None and not settings.embedded
        seen = _load(s, [x.url for x in servers], capacity_since=now - timedelta(
            seconds=settings.worker_timeout) if count_workers else None)
        load = seen.by_server
        if count_workers:
            capacity = max(0, (seen.capacity or 0) - seen.held)
        free = capacity if capacity is not None else 1 << 62
        if free <= 0:
            return 0
        latest = seen.latest
        for entry in servers:
            entry.unhealthy = entry.url in seen.sick
            entry.down = outage.is_down(latest[entry.url])
        # Most room first: when there is less work than room, it goes where room is.
        servers.sort(key=lambda x: load.get(x.url, 0) - x.effective_limit)
        rooms = {x.url: outage.room(0 if x.unhealthy else x.limit, load.get(x.url, 0),
                                    latest[x.url], now, most=settings.dispatch_batch)
                 for x in servers}
        taken_by: dict[str, list[Dispatched]] = {}
        # Round 1: each server's preferred samples; round 2: whatever is left.
        for preferred in (True, False):
            for entry in servers:
                room = min(rooms[entry.url], free)
                kind = _preference(entry)
                # Round 2 is for servers with a preference; a down server's probe is one.
                second_needed = kind is not None and not (entry.down and taken_by.get(entry.url))
                if room <= 0 or (not preferred and not second_needed):
                    continue
                taken = _take(s, entry, room, now, settings.queued_timeout,
                              kind if preferred else _fallback(entry))
                taken_by.setdefault(entry.url, []).extend(taken)
                rooms[entry.url] -= len(taken)
                free -= len(taken)
        batches = [b for b in taken_by.values() if b]
        claimed: list[states.Claimed] = []
        if local is not None and local.room > 0 and batches:
            claimed, batches = _claim_locally(s, local, batches, now)
    if claimed:
        local.start(claimed)  # type: ignore[union-attr]
    for i, batch in enumerate(batches):
        try:
            publish(batch)
        except Exception:
            # The broker is unreachable: hand back what was not sent, so these
            # samples do not sit queued until their deadline.
            unsent = [(d.sample_id, d.token) for b in batches[i:] for d in b]
            with session_scope() as s:
                states.release(s, unsent, now=utcnow())
            raise
    return len(claimed) + sum(len(b) for b in batches)


def _claim_locally(s: Session, local: LocalClaim, batches: list[list[Dispatched]],
                   now: datetime) -> tuple[list[states.Claimed], list[list[Dispatched]]]:
    """Claim up to ``local.room`` of the queued samples for ``local.worker``, spread
    over the servers; returns them and what is left to publish."""
    mine: list[Dispatched] = []
    left = [list(b) for b in batches]
    while len(mine) < local.room and any(left):
        for b in left:  # one from each server in turn
            if b and len(mine) < local.room:
                mine.append(b.pop(0))
    lease = max(local.lease(s, job_id) for job_id in {d.job_id for d in mine})
    claimed = states.claim_batch(s, [(d.sample_id, d.token) for d in mine],
                                 new_token=secrets.token_hex(16),
                                 lease_until=now + timedelta(seconds=lease),
                                 worker=local.worker, now=now)
    return claimed, [b for b in left if b]


def adopt_stale(local: LocalClaim, *, older_than: float) -> int:
    """Claim for ``local.worker`` up to ``local.room`` samples queued more than
    ``older_than`` seconds ago whose message never arrived; returns how many.

    The dispatcher queues only into live workers' free slots, so a queued sample is
    claimed within moments of its message; one still queued while this worker has
    free slots was carried by a message that is stuck or lost (a half-open broker
    connection). SQL is the truth: the claim is the usual compare-and-set on the
    sample's id and token, so a message that does arrive later finds it taken."""
    if local.room <= 0:
        return 0
    with session_scope() as s:
        now = utcnow()
        rows = s.execute(
            select(Sample.id, Sample.claim, Sample.job_id)
            .where(Sample.state == SampleState.QUEUED,
                   Sample.queued_at < now - timedelta(seconds=older_than))
            .order_by(Sample.queued_at).limit(local.room)
            .with_for_update(of=Sample, skip_locked=True)).all()
        if not rows:
            return 0
        lease = max(local.lease(s, job_id) for _, _, job_id in rows)
        claimed = states.claim_batch(s, [(i, tok) for i, tok, _ in rows if tok],
                                     new_token=secrets.token_hex(16),
                                     lease_until=now + timedelta(seconds=lease),
                                     worker=local.worker, now=now)
    if claimed:
        local.start(claimed)
    return len(claimed)
