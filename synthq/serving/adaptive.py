"""Adaptive in-flight limits (``--inflight auto``): one controller per server.

The dispatcher's limit stays exact (docs/design.md, invariant 5); the controller only
changes the number its room computation reads, in SQL (``servers``), so
every dispatcher and worker sees one value. About once a second the scheduler
tick (:mod:`synthq.app.tick`, for Celery beat and the embedded loop alike, before
it dispatches; the embedded loop ticks every 0.3 s in slow start, so a step is
judged as soon as its calls ended) calls :func:`tick`, which

1. reads what the server did in the last window from ``attempts`` (completed
   calls, generated tokens, time to first token, latency per token, 429/5xx,
   timeouts and stalls) and, when the server serves them, vLLM's gauges from
   its ``/metrics`` (requests waiting and running, KV-cache usage);
2. hands that :class:`~synthq.serving.controller.Window` and the controller's memory
   to :func:`~synthq.serving.controller.decide`, a pure function that returns the new
   limit and the reason;
3. writes the new target (``servers.limit_target``, what the dispatcher
   fills up to) under the dispatcher's lock, and the bound ``servers.limit``:
   the target, or while a lowered target drains, what was in flight, lowered
   further on the next ticks as calls end. So queued + running never exceeds
   ``servers.limit``, even while it moves.

The controller itself (the algorithm, pure) is :mod:`synthq.serving.controller`; the
gauges are read by :mod:`synthq.serving.gauges`. This module is the I/O that ties them:
which servers are due, their calls read, the decision written.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from synthq.core import locks
from synthq.core.enums import INFLIGHT, JobState
from synthq.core.secrets import safe_url
from synthq.queue.limits import start_limit  # read without SQLAlchemy
from synthq.serving.controller import WINDOW_SECONDS, CallRow, Decision, Window, decide, summarize
from synthq.serving.gauges import scrape as scrape_gauges
from synthq.store.db import session_scope, utcnow
from synthq.store.models import Attempt, Job, Sample, Server

__all__ = ["tick", "auto_servers", "in_slow_start", "TICK_SECONDS", "START_TICK_SECONDS"]

log = logging.getLogger(__name__)

#: Seconds between two runs of one server's controller.
TICK_SECONDS = 1.0
#: Points of history kept per server (one a tick: five minutes).
HISTORY = 300
#: The controller forgets what it learned about a server idle this long.
FORGET_AFTER = timedelta(minutes=10)


def _window(session: Session, url: str, now: datetime, limit: int, inflight: int,
            since: float, seconds: float = WINDOW_SECONDS) -> Window:
    """The server's recent calls (the newest 2,000, by id), from ``attempts``."""
    rows = session.execute(
        select(Attempt.started_at, Attempt.ended_at, Attempt.outcome, Attempt.latency_s,
               Attempt.ttft_s, Attempt.completion_tokens)
        .where(Attempt.server == url).order_by(Attempt.id.desc()).limit(2000)).all()
    calls: list[CallRow] = [
        (started.timestamp(), ended.timestamp() if ended is not None else None, outcome,
         lat, ttft, ntok) for started, ended, outcome, lat, ttft, ntok in rows]
    return summarize(calls, now=now.timestamp(), limit=limit, inflight=inflight, since=since,
                     seconds=seconds)


def auto_servers(session: Session, job_ids: Sequence[int] | None = None
                 ) -> dict[str, tuple[int, int]]:
    """Servers of active ``--inflight auto`` jobs: url → (floor, cap)."""
    query = select(Job.servers, Job.min_inflight, Job.inflight_limit).where(
        Job.state == JobState.ACTIVE, Job.inflight_auto.is_(True))
    if job_ids is not None:
        query = query.where(Job.id.in_(job_ids))
    result: dict[str, tuple[int, int]] = {}
    for urls, floor, cap in session.execute(query):
        for url in urls:
            old = result.get(url)
            result[url] = (floor, cap) if old is None else (min(old[0], floor), min(old[1], cap))
    return {u: (min(f, c), c) for u, (f, c) in result.items()}


def _inflight(session: Session, url: str) -> int:
    return session.scalar(select(func.count()).select_from(Sample).where(
        Sample.server == url, Sample.state.in_(INFLIGHT))) or 0


#: A file each tick's window and decision are appended to (for benchmarks; unset: none).
_TRACE = os.environ.get("SYNTHQ_ADAPTIVE_TRACE")
#: This process's last tick per server (monotonic), so a loop that wakes often ticks once a second.
_last_tick: dict[str, float] = {}
#: Servers whose controller is in slow start: ticked as often as every START_TICK_SECONDS,
#: so that a step is judged as soon as its calls ended (a wave of calls ends together).
_starting: set[str] = set()
START_TICK_SECONDS = 0.3
#: The auto servers last found, per job_ids argument: (monotonic time, urls).
_known: dict[tuple[int, ...] | None, tuple[float, list[str]]] = {}


def in_slow_start() -> bool:
    """Whether a server's controller in this process is in slow start."""
    return bool(_starting)


def _spacing(url: str) -> float:
    return START_TICK_SECONDS if url in _starting else TICK_SECONDS * 0.9


def tick(job_ids: Sequence[int] | None = None, *, scrape: bool = True) -> dict[str, Decision]:
    """Run the controller of each server of the active auto jobs that is due; returns what
    each decided. Called by the beat tick and the embedded loop, as often as they like."""
    mono = time.monotonic()
    # The embedded loop calls this on every wake: ask the database which servers are auto
    # at most once a second while none of them is due.
    key = tuple(job_ids) if job_ids is not None else None
    known = _known.get(key)
    if known is not None and mono - known[0] < 1.0 and \
            all(mono - _last_tick.get(u, -1e9) < _spacing(u) for u in known[1]):
        return {}
    with session_scope() as s:
        servers = auto_servers(s, job_ids)
    _known[key] = (mono, list(servers))
    due = [u for u in servers if mono - _last_tick.get(u, -1e9) >= _spacing(u)]
    decisions: dict[str, Decision] = {}
    for url in due:
        _last_tick[url] = mono
        floor, cap = servers[url]
        gauges = scrape_gauges(url) if scrape else {}
        with session_scope() as s:
            locks.hold(s, locks.DISPATCH)  # one lock with the dispatcher's room
            now = utcnow()
            row = s.get(Server, url)
            if row is not None and row.limit_at is not None and \
                    (now - row.limit_at).total_seconds() < _spacing(url):
                continue  # another scheduler ran it a moment ago
            fresh = row is None or row.limit_target is None or row.limit_at is None or \
                now - row.limit_at > FORGET_AFTER
            limit = start_limit(floor, cap) if fresh or row is None or \
                row.limit_target is None else row.limit_target
            bound = limit if fresh or row is None or row.limit is None else row.limit
            state = None if fresh or row is None else row.limit_state
            inflight = _inflight(s, url)
            since = float((state or {}).get("changed_at", 0.0))
            window = _window(s, url, now, limit, inflight, since)
            if gauges:
                window = replace(window, waiting=gauges.get("waiting"),
                                 running=gauges.get("running"), kv_usage=gauges.get("kv_usage"))
            decision = decide(window, state, floor=floor, cap=cap)
            if decision.state.get("phase") == "start":
                _starting.add(url)
            else:
                _starting.discard(url)
            if _TRACE:
                with open(_TRACE, "a") as fh:
                    fh.write(f"{time.time():.1f} {window} -> {decision.limit} "
                             f"{decision.reason} {decision.state}\n")
            target = decision.limit
            # The dispatcher queues up to the target at once; the bound on queued +
            # running comes down only as the calls above the target end, so that it
            # holds at every moment, even while the limit moves.
            applied = max(target, min(bound, inflight))
            reason = decision.reason
            history = list(row.limit_history or []) if row is not None and not fresh else []
            history.append([round(now.timestamp(), 1), target, round(window.tokens_per_s, 1),
                            round(window.done_per_s, 2)])
            stored: str | None
            if reason:
                stored = reason
            elif fresh or row is None:
                stored = f"{applied} start (slow start)"
            else:
                stored = row.limit_reason
            _save(s, url, now, target, applied, stored, decision.state, history[-HISTORY:])
            decisions[url] = decision
            if reason:
                log.info("server %s: limit %s", safe_url(url), reason)
    return decisions


def _save(session: Session, url: str, now: datetime, target: int, bound: int,
          reason: str | None, state: dict[str, Any], history: list[Any]) -> None:
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    values = {"limit_target": target, "limit": bound, "limit_reason": reason,
              "limit_at": now, "limit_state": state, "limit_history": history}
    # A server the health probe has not met yet: a row that asks for a probe at once.
    stmt = insert(Server).values(url=url, healthy=True, checked_at=datetime(2000, 1, 1, tzinfo=UTC),
                                 failures=0, **values)
    session.execute(stmt.on_conflict_do_update(index_elements=["url"], set_=values))
