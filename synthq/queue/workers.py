"""Workers known to SQL: who is alive, how much each can hold, how much it holds.

Each generation process (a Celery worker, or ``synthq run``) has a row in
``workers`` that it refreshes every ``heartbeat_interval`` seconds. The
dispatcher never queues more than the live workers' free capacity (so a
queued message finds a free slot at once and the queued deadline can be
short), and the sweep returns the running samples of a worker that stopped
heart-beating to ``pending`` without waiting for their leases.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from synthq.store.sqlread import Reader, read_time, reader_of

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

# SQLAlchemy, the models and socket are imported by the functions that write:
# `synthq status` reads live() (plain SQL) on its fast path, which must not load them.

__all__ = ["WorkerInfo", "new_name", "heartbeat", "unregister", "live", "free_capacity",
           "pid_alive", "gone_here", "holder_gone_here", "dead_holder_here"]


def new_name() -> str:
    """``host:pid:random``: unique per process start, so a reused pid is not mistaken."""
    import secrets
    import socket

    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    name: str
    capacity: int
    inflight: int
    heartbeat_at: datetime
    started_at: datetime
    #: Seconds its wall clock ran ahead of the database's (synthq.core.clock.skew).
    clock_skew: float | None = None


def heartbeat(session: Session, name: str, *, capacity: int, inflight: int,
              now: datetime | None = None) -> None:
    """Insert or refresh this process's row. ``now`` is the database's time
    (synthq.core.clock); the row also carries how far this machine's wall clock is off it.

    ``now`` None: the database's time read once the session is connected. A time read
    before that is the machine's wall clock when this is the process's first connection
    (:func:`synthq.store.db._calibrate` runs on connect): the first heartbeat of a worker 600 s
    ahead was stamped 10 minutes in the future, and had it died before its second beat
    it would have looked alive that long (issue 41)."""
    from sqlalchemy.dialects.postgresql import insert as pg_insert
    from sqlalchemy.dialects.sqlite import insert as sqlite_insert

    from synthq.core.clock import skew, utcnow
    from synthq.store.models import Worker

    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    if now is None:
        session.connection()  # connects (and calibrates the clock) if not yet
        now = utcnow()
    host, _, rest = name.partition(":")
    pid = int(rest.split(":", 1)[0]) if rest.split(":", 1)[0].isdigit() else os.getpid()
    off = skew()
    stmt = insert(Worker).values(name=name, host=host, pid=pid, capacity=capacity,
                                 inflight=inflight, started_at=now, heartbeat_at=now,
                                 clock_skew=off)
    session.execute(stmt.on_conflict_do_update(index_elements=["name"], set_={
        "capacity": capacity, "inflight": inflight, "heartbeat_at": now, "clock_skew": off}))


def unregister(session: Session, name: str) -> None:
    from sqlalchemy import delete

    from synthq.store.models import Worker

    session.execute(delete(Worker).where(Worker.name == name))


def live(db: Session | Reader, *, now: datetime, timeout: float) -> list[WorkerInfo]:
    """Workers that heart-beat within ``timeout`` seconds, less those of this host whose
    process is gone (a ``synthq run`` killed with -9 is not live for its last seconds):
    what ``status`` and the job page show. (The sweep judges a holder by its heartbeat
    alone, :func:`synthq.queue.ledger.gone`: a dead process's calls may hold its room on
    a server a while after it died.)"""
    rows = reader_of(db).rows(
        "SELECT name, capacity, inflight, heartbeat_at, started_at, clock_skew, host, pid "
        "FROM workers WHERE heartbeat_at >= :since ORDER BY started_at",
        {"since": now - timedelta(seconds=timeout)})
    return [WorkerInfo(name, capacity, inflight, read_time(beat), read_time(started), off)
            for name, capacity, inflight, beat, started, off, host, pid in rows
            if not gone_here(host, int(pid))]


def gone_here(host: str, pid: int) -> bool:
    """The dead-process rule: whether ``host:pid`` names a process of this host that no
    longer exists (kill -9). Its holdings need not wait out a lease or a heartbeat.
    A process of another host, or this process itself, is never judged gone here."""
    import socket

    return host == socket.gethostname() and pid != os.getpid() and not pid_alive(pid)


def holder_gone_here(holder: str | None) -> bool:
    """Whether a holder named ``host:pid`` (a training run's) is a process of this host
    that no longer exists (:func:`gone_here`); False for another host's process, a live
    one, or a holder named another way."""
    host, _, pid = (holder or "").rpartition(":")
    return pid.isdigit() and gone_here(host, int(pid))


def dead_holder_here(session: Session, kind: Any, row_id: int) -> str | None:
    """The holder of a held row of ``kind`` (a :class:`synthq.queue.ledger.Kind`) when it is
    gone (:func:`holder_gone_here`): its claim may be taken at once, not after its lease
    (the ``dead`` of :func:`synthq.queue.ledger.gone`). None otherwise."""
    from sqlalchemy import select

    model = kind.model
    held = session.scalar(select(model.worker).where(model.id == row_id,
                                                     model.state == kind.held))
    return str(held) if holder_gone_here(held) else None


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists
        return True
    return True


def free_capacity(session: Session, *, now: datetime, timeout: float) -> int:
    """Live workers' capacity minus every sample queued or running (never below 0)."""
    from sqlalchemy import func, select

    from synthq.core.enums import INFLIGHT
    from synthq.store.models import Sample, Worker

    capacity = session.scalar(
        select(func.coalesce(func.sum(Worker.capacity), 0))
        .where(Worker.heartbeat_at >= now - timedelta(seconds=timeout))) or 0
    held = session.scalar(select(func.count()).select_from(Sample)
                          .where(Sample.state.in_(INFLIGHT))) or 0
    return max(0, int(capacity) - int(held))


def prune(session: Session, *, now: datetime, older_than: float) -> int:
    """Forget workers silent for ``older_than`` seconds (kept a while for ``status``)."""
    from sqlalchemy import delete

    from synthq.store.models import Worker

    result = session.execute(delete(Worker).where(
        Worker.heartbeat_at < now - timedelta(seconds=older_than)))
    return int(result.rowcount)  # type: ignore[attr-defined]
