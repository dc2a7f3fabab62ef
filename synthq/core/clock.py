"""The one clock synthq uses: timezone-aware UTC, on the database's time.

Leases, heartbeats, queued deadlines and ``next_attempt_at`` are compared by
other processes, on other machines: a worker whose clock ran 120 s behind
looked dead at once (its samples were reclaimed while it kept working, and
paid for twice), one 120 s ahead wrote retries due in everyone's future. So
with PostgreSQL every time synthq writes is the database's: each new
connection reads the server's ``clock_timestamp()`` (:mod:`synthq.store.db`), and
:func:`utcnow` is that reading plus the monotonic time elapsed since, never the
machine's wall clock. The wall clock's distance from the database's is kept
(:func:`skew`) for the worker's heartbeat, so that ``synthq status`` can name a
skewed machine. Embedded SQLite lives in this process: its clock is the
machine's, and so is :func:`utcnow` until a PostgreSQL connection is made.

Apart from :mod:`synthq.store.db` (which re-exports :func:`utcnow`) so that the
modules ``synthq status`` loads on its fast path need not import SQLAlchemy.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

__all__ = ["utcnow", "calibrate", "skew", "reset", "SKEW_WARNING_S"]

#: A worker whose wall clock is this many seconds off the database's is named by
#: ``synthq status`` (its own time is not used for anything, but its logs and any
#: other program on that machine are off).
SKEW_WARNING_S = 5.0

#: (the database's time, this process's monotonic clock at that moment, the wall
#: clock's lead over the database in seconds), or None: not calibrated.
_anchor: tuple[datetime, float, float] | None = None


def utcnow() -> datetime:
    """The current time, timezone-aware UTC: the database's clock once calibrated (the
    only clock synthq uses)."""
    anchor = _anchor
    if anchor is None:
        return datetime.now(UTC)
    return anchor[0] + timedelta(seconds=time.monotonic() - anchor[1])


def calibrate(database_now: datetime, monotonic_at: float, wall_at: datetime) -> None:
    """Take the database's time ``database_now``, read when this process's monotonic clock
    said ``monotonic_at`` and its wall clock ``wall_at`` (the middle of the round trip)."""
    global _anchor
    if database_now.tzinfo is None:
        database_now = database_now.replace(tzinfo=UTC)
    _anchor = (database_now.astimezone(UTC), monotonic_at,
               (wall_at - database_now).total_seconds())


def skew() -> float | None:
    """Seconds this machine's wall clock runs ahead of the database's (negative: behind);
    None before the first calibration."""
    anchor = _anchor
    return None if anchor is None else anchor[2]


def reset() -> None:
    """Back to the machine's clock (the engines were closed; tests switch databases)."""
    global _anchor
    _anchor = None
