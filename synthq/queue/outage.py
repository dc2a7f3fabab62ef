"""One "server is down" rule and one in-flight room, for every stage that calls a server.

A server is *down* when its latest :data:`TRIP_AFTER` calls all say it is not serving
(each failure class's :attr:`~synthq.core.errors.FailureClass.down`: refused, hanging,
stalling, or answered with an HTTP 5xx: a vLLM restart, a gateway in front of a
loading engine). A down server gets one call at a time, a probe every
:data:`PROBE_INTERVAL` seconds after its last call ended (or its last answer's
Retry-After, up to :data:`PROBE_INTERVAL_MAX`), instead of its whole limit: work does
not burn its attempts on it, and the first probe that succeeds gives the limit back.

The rule reads calls from SQL, so every process agrees on a server: generation's
dispatch reads a server's latest ``attempts`` (synthq.queue.dispatch), a capture's claim
its latest ``capture_calls`` (synthq.queue.capture_states). Each computes the room it
fills with :func:`room`, under its own lock per server (the dispatcher's advisory lock;
a capture server's), so the in-flight limit stays exact (docs/design.md, invariant 5).

A call is a row ``(outcome, error_message, ended_at)``; ``latest`` is a server's
newest first.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from synthq.core.errors import Down, FailureClass, retry_after

__all__ = ["TRIP_AFTER", "DOWN_OUTCOMES", "PROBE_INTERVAL", "PROBE_INTERVAL_MAX", "says_down",
           "is_down", "probe_due", "next_probe_s", "room"]

#: A server whose last this-many calls all said it is not serving is treated as down.
TRIP_AFTER = 3
#: Outcomes that say "the server did not serve it": refused, hanging, stalling
#: (:attr:`Down.UNANSWERED <synthq.core.errors.Down.UNANSWERED>`). A capture whose call
#: its down server never answered is not charged.
DOWN_OUTCOMES = frozenset(c for c in FailureClass if c.down is Down.UNANSWERED)
#: Seconds between probes of a down server.
PROBE_INTERVAL = 2.0
#: Longest wait between probes that a server's Retry-After can ask for.
PROBE_INTERVAL_MAX = 60.0


def says_down(outcome: str | None, message: str | None) -> bool:
    """A call that says the server is not serving: refused, hanging, stalling, or an
    HTTP 5xx answer (overloaded: 503 from a bounded queue or a gateway). A broken
    stream (an HTML page, no ``[DONE]``) is a ``server_error`` too, but not this. Each
    class's rule is its :meth:`FailureClass.says_down`."""
    failure = FailureClass.of(outcome)
    return failure is not None and failure.says_down(message)


def is_down(latest: Sequence[Any]) -> bool:
    """Whether the server whose latest calls (newest first) are ``latest`` is down."""
    return len(latest) >= TRIP_AFTER and all(says_down(o, m) for o, m, _ in latest[:TRIP_AFTER])


def next_probe_s(latest: Sequence[Any], now: datetime) -> float:
    """Seconds until a down server's next probe is due (0: due now)."""
    if not latest or latest[0][2] is None:
        return 0.0
    interval = PROBE_INTERVAL
    asked = retry_after(latest[0][1])
    if asked is not None:
        interval = min(PROBE_INTERVAL_MAX, max(interval, asked))
    return max(0.0, interval - (now - latest[0][2]).total_seconds())


def probe_due(latest: Sequence[Any], now: datetime) -> bool:
    """Whether a down server's next probe is due."""
    return next_probe_s(latest, now) <= 0.0


def room(limit: int, inflight: int, latest: Sequence[Any], now: datetime, *,
         most: int) -> int:
    """How many more calls may start on a server now, at most ``most``: its ``limit`` less
    what is in flight there, or, when it is down, one probe when none is in flight and
    its time has come. The caller holds the server's lock."""
    if is_down(latest):
        if not probe_due(latest, now):
            return 0
        limit = min(limit, 1)
    return max(0, min(most, limit - inflight))
