"""Engine and session factory, with the SQLite settings embedded mode needs.

PostgreSQL is the production database. SQLite serves the embedded default: it
runs in WAL mode, and every transaction starts with ``BEGIN IMMEDIATE`` so
that two threads that read then write wait for each other instead of failing
with "database is locked" on the lock upgrade.
"""

from __future__ import annotations

import errno
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from synthq.core.clock import utcnow
from synthq.core.retry import exponential
from synthq.core.secrets import safe_url

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["safe_url", "utcnow", "get_engine", "session_scope", "dispose_engines", "with_db_retry",
           "disk_full", "database_location", "CLAIM_PATH_ATTEMPTS", "service_process",
           "pg_connect_args", "heartbeat_engine", "HEARTBEAT_APPLICATION"]

_engines: dict[str, Engine] = {}
_lock = threading.Lock()



def _make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            _sqlite_folder(Path(path))
        engine = create_engine(
            url,
            connect_args={"timeout": 60, "check_same_thread": False},
            pool_size=32,
            max_overflow=64,
        )

        @event.listens_for(engine, "connect")
        def _sqlite_connect(dbapi_conn, _record):  # type: ignore[no-untyped-def]
            dbapi_conn.isolation_level = None  # we issue BEGIN ourselves
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=60000")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn):  # type: ignore[no-untyped-def]
            conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    from synthq.spec.config import get_settings

    settings = get_settings()
    # No pre-ping: it costs a round trip per checkout (14 % of a worker's CPU);
    # a dead pooled connection fails its statement instead, which
    # with_db_retry retries on a fresh one (and SQLAlchemy then recycles every
    # connection of the pool older than that failure).
    engine = create_engine(url, pool_size=settings.db_pool_size,
                           max_overflow=settings.db_max_overflow, pool_recycle=1800,
                           connect_args=pg_connect_args(service=_service["on"]))
    # Every time synthq writes is the database's (synthq.core.clock): each new connection
    # reads the server's clock.
    event.listen(engine, "connect", _calibrate)
    answer_timeout = _answer_timeout() if _service["on"] else None
    if answer_timeout:
        guarded = _guarded_connection(answer_timeout)

        @event.listens_for(engine, "do_connect")
        def _connect(_dialect, _record, cargs, cparams):  # type: ignore[no-untyped-def]
            return guarded.connect(*cargs, **cparams)

    return engine


def _calibrate(dbapi_conn: Any, _record: Any) -> None:
    """Set this process's clock on the server's (``clock_timestamp()``, read at the middle
    of the round trip): leases, heartbeats and retry times that other machines compare
    must not depend on this machine's clock."""
    from datetime import UTC, datetime

    from synthq.core import clock

    started = time.monotonic()
    wall = datetime.now(UTC)
    cur = dbapi_conn.cursor()
    try:
        cur.execute("SELECT clock_timestamp()")
        (server_now,) = cur.fetchone()
    finally:
        cur.close()
    ended = time.monotonic()
    dbapi_conn.rollback()  # the SELECT opened a transaction; the pool hands it out idle
    half = (ended - started) / 2
    clock.calibrate(server_now, started + half, wall + timedelta(seconds=half))


#: Whether this process is a service process (a generation worker, beat, ``synthq run``):
#: its PostgreSQL sessions get the statement, lock and idle-transaction limits.
_service = {"on": False}


def service_process(on: bool = True) -> None:
    """Mark this process as one of synthq's services (see ``db_statement_timeout``): the
    engines made from now on carry the server-side limits and the client's answer
    deadline. The engines made before are closed, so that none lacks them."""
    if _service["on"] != on:
        _service["on"] = on
        dispose_engines()


def _seconds_ms(seconds: float) -> int:
    return max(0, int(seconds * 1000))


def pg_connect_args(*, service: bool, deadline: float | None = None) -> dict[str, object]:
    """libpq connection parameters for every synthq PostgreSQL connection: TCP keepalives,
    ``tcp_user_timeout``, a connect timeout and, for a service process, the server-side
    statement, lock and idle-transaction timeouts (``options``). A URL's own query
    parameters override these (libpq takes the later value).

    ``deadline`` (the heartbeat's session, :func:`heartbeat_engine`): every limit of the
    session, the connect timeout included, at most that many seconds."""
    import math

    from synthq.spec.config import get_settings

    s = get_settings()
    statement, lock = s.db_statement_timeout, s.db_lock_timeout
    args: dict[str, object] = {
        "keepalives": 1, "keepalives_idle": s.db_keepalive_idle,
        "keepalives_interval": s.db_keepalive_interval,
        "keepalives_count": s.db_keepalive_count,
        "tcp_user_timeout": _seconds_ms(s.db_tcp_user_timeout),
        "connect_timeout": s.db_connect_timeout,
    }
    if deadline is not None:
        statement = min(statement, deadline) if statement > 0 else deadline
        lock = min(lock, deadline) if lock > 0 else deadline
        args["connect_timeout"] = min(s.db_connect_timeout, max(2, math.ceil(deadline)))
        args["tcp_user_timeout"] = _seconds_ms(min(s.db_tcp_user_timeout, deadline))
        args["application_name"] = HEARTBEAT_APPLICATION
    if service:
        # The server's own keepalives too: it ends a session whose client vanished.
        options = {"statement_timeout": _seconds_ms(statement),
                   "lock_timeout": _seconds_ms(lock),
                   "idle_in_transaction_session_timeout":
                       _seconds_ms(s.db_idle_in_transaction_timeout),
                   "tcp_keepalives_idle": s.db_keepalive_idle,
                   "tcp_keepalives_interval": s.db_keepalive_interval,
                   "tcp_keepalives_count": s.db_keepalive_count,
                   "tcp_user_timeout": _seconds_ms(s.db_tcp_user_timeout)}
        args["options"] = " ".join(f"-c {k}={v}" for k, v in options.items())
    return args


#: ``application_name`` of the heartbeat's sessions (``pg_stat_activity`` tells them apart).
HEARTBEAT_APPLICATION = "synthq-heartbeat"


def heartbeat_engine(deadline: float) -> Engine:
    """The worker heartbeat's own engine (:mod:`synthq.queue.heartbeat`): one connection, apart
    from the pool that claims and writes, whose every answer is awaited at most
    ``deadline`` seconds (the server ends its statements by then too). A stranded
    connection is dropped after that and the next beat connects again; the writer's long
    deadline (``db_statement_timeout`` + ``db_answer_margin``) no longer silences the
    worker. SQLite (one file, no network): the default engine."""
    from synthq.spec.config import get_settings

    url = get_settings().database_url
    if url.startswith("sqlite"):
        return get_engine(url)
    key = f"{url}#heartbeat"
    with _lock:
        engine = _engines.get(key)
        if engine is None:
            engine = _engines[key] = create_engine(
                url, pool_size=1, max_overflow=1, pool_recycle=1800,
                connect_args=pg_connect_args(service=True, deadline=deadline))
            event.listen(engine, "connect", _calibrate)
            guarded = _guarded_connection(deadline)

            @event.listens_for(engine, "do_connect")
            def _connect(_dialect, _record, cargs, cparams):  # type: ignore[no-untyped-def]
                return guarded.connect(*cargs, **cparams)

        return engine


def _answer_timeout() -> float | None:
    """Seconds a service process waits for any answer of the database: no statement may
    run longer than ``statement_timeout`` on the server, so a longer silence means the
    connection is dead (None: no deadline)."""
    from synthq.spec.config import get_settings

    s = get_settings()
    if s.db_statement_timeout <= 0:
        return None
    return s.db_statement_timeout + max(0.0, s.db_answer_margin)


def _guarded_connection(deadline: float) -> type:
    """A psycopg connection class whose every wait for the server ends after ``deadline``
    seconds: the connection is then closed and the wait raises OperationalError, which
    SQLAlchemy takes for a disconnect (the pool drops it) and :func:`with_db_retry` and
    the writer retry on a fresh connection.

    TCP keepalives cannot see this failure: a proxy, a NAT or a load balancer that
    stops forwarding still acknowledges every packet, so the socket looks healthy
    while no answer will ever come (the chaos run's "half-open" PostgreSQL)."""
    import psycopg
    from psycopg import errors as pg_errors

    class Guarded(psycopg.Connection):  # type: ignore[type-arg]
        #: How this connection was opened, and the server's time just after (see _end_stranded).
        _opened: tuple[str, dict[str, Any], datetime] | None = None

        @classmethod
        def connect(cls, conninfo: str = "", **kwargs: Any) -> Any:
            conn = super().connect(conninfo, **kwargs)
            conn._opened = (conninfo, kwargs, utcnow())
            return conn

        def wait(self, gen: Any, interval: float = 0.1,
                 timeout: float | None = None) -> Any:
            if timeout is not None:  # a wait of psycopg's own with its own limit
                return super().wait(gen, interval=interval, timeout=timeout)
            try:
                return super().wait(gen, interval=interval, timeout=deadline)
            except pg_errors._WaitTimeout as exc:
                pid = self.pgconn.backend_pid
                self.pgconn.finish()  # never reuse it: its answer may still come, late
                _end_stranded(pid, self._opened, wait=min(deadline, END_STRANDED_TIMEOUT))
                raise psycopg.OperationalError(
                    f"the database did not answer within {deadline:.0f} s; the connection "
                    "was dropped (it looks half-open)") from exc

    return Guarded


#: Seconds the end of a stranded session may take (connect and one statement).
END_STRANDED_TIMEOUT = 3.0


def _end_stranded(pid: int, opened: tuple[str, dict[str, Any], datetime] | None, *,
                  wait: float) -> None:
    """End the server's side of a connection just dropped as half-open, from a fresh one.

    Closing our socket tells the server nothing when the path in between is stranded:
    its session lives on. Most often it is idle in a transaction and the server's
    ``idle_in_transaction_session_timeout`` ends it; but a session that ran a statement
    and waits for the rest of the request (the Sync of the extended protocol, or a
    message cut in two) is "active" to the server, under no timeout at all (a cancel is
    ignored while it reads from its client), and keeps the row locks of its transaction
    for good: every later write of those rows ends in ``LockNotAvailable``. So the
    session is terminated (``pg_terminate_backend``, allowed on one's own role's
    sessions) if it is still the one we opened (a backend started after it is not
    touched: a process id may be reused), so that the retry finds the rows free. Never
    raises; waits ``wait`` seconds at most (the end goes on in a thread of its own)."""
    if opened is None or not pid:
        return
    import psycopg

    conninfo, kwargs, at = opened
    params = {k: v for k, v in kwargs.items() if k not in ("options", "autocommit")}
    params["connect_timeout"] = max(1, int(END_STRANDED_TIMEOUT))
    params["options"] = f"-c statement_timeout={_seconds_ms(END_STRANDED_TIMEOUT)}"
    done = threading.Event()

    def end() -> None:
        try:
            with psycopg.connect(conninfo, autocommit=True, **params) as conn:
                row = conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE pid = %s AND backend_start <= %s", (pid, at)).fetchone()
            if row and row[0]:
                log.info("ended the server session %d of a half-open connection", pid)
        except Exception as exc:  # noqa: BLE001 - the server's own timeouts remain
            log.debug("could not end the server session %d: %s", pid, exc)
        finally:
            done.set()

    threading.Thread(target=end, name="synthq-end-stranded", daemon=True).start()
    done.wait(wait)


def _sqlite_folder(db: Path) -> None:
    """Make the data directory for the default database; any other folder must exist.

    A typo in ``SYNTHQ_DATABASE_URL`` (``sqlite:////nonexistent/dir/x.db``) must
    not quietly create folders and an empty database.
    """
    from synthq.core.errors import UserError
    from synthq.spec.config import get_settings

    if db.parent.is_dir():
        return
    default = get_settings().data_dir / "synthq.db"
    if db.absolute() == default.absolute():
        db.parent.mkdir(parents=True, exist_ok=True)
        return
    raise UserError(f"the folder {db.parent} of the SQLite database does not exist "
                    "(create it, or fix SYNTHQ_DATABASE_URL)")


def get_engine(url: str | None = None) -> Engine:
    """The engine for ``url`` (default: the configured database), made once per process."""
    if url is None:
        from synthq.spec.config import get_settings

        url = get_settings().database_url
    with _lock:
        engine = _engines.get(url)
        if engine is None:
            engine = _engines[url] = _make_engine(url)
        return engine


def dispose_engines() -> None:
    """Close every pooled connection (after fork, or at the end of a test)."""
    from synthq.core import clock

    with _lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()
    clock.reset()  # the next connection sets it again (tests switch databases)


@contextmanager
def session_scope(engine: Engine | None = None) -> Iterator[Session]:
    """A session in one transaction: committed on success, rolled back on error."""
    factory = sessionmaker(bind=engine or get_engine(), expire_on_commit=False)
    with factory() as session, session.begin():
        yield session


def disk_full(exc: BaseException) -> bool:
    """The database's disk is full: SQLite's SQLITE_FULL ("database or disk is full"),
    PostgreSQL's SQLSTATE 53100 (disk_full), or ENOSPC. Not a transient error."""
    orig = getattr(exc, "orig", None) or exc
    if getattr(orig, "sqlstate", None) == "53100":
        return True
    if isinstance(orig, sqlite3.Error) and (
            getattr(orig, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
            or "database or disk is full" in str(orig)):
        return True
    if isinstance(orig, OSError) and orig.errno == errno.ENOSPC:
        return True
    return "No space left on device" in str(exc)


def database_location(url: str | None = None) -> str:
    """Where the database keeps its files, for a message: the SQLite file's directory,
    or the PostgreSQL server (password masked)."""
    if url is None:
        from synthq.spec.config import get_settings

        url = get_settings().database_url
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        return str(Path(path).resolve().parent) if path and path != ":memory:" else url
    return f"the PostgreSQL server of {safe_url(url)}"


#: Tries of every statement on a worker's claim path (the job's settings, the claim, a
#: release): about 31 s, as long as the queued deadline, past which the sweep hands the
#: samples out again anyway. One policy, so that no read there gives up before the
#: claim would have (a job read that gave up after 3 s left its samples queued).
CLAIM_PATH_ATTEMPTS = 20


def with_db_retry(fn: Callable[[], T], *, attempts: int = 6, what: str = "database") -> T:
    """Run ``fn`` (one whole transaction), again after a transient database error.

    A dropped connection, a full connection table or a locked SQLite file must
    not strand a sample whose answer is in hand: 6 tries over about 6 s.
    Each try must be a complete, idempotent transaction (our CAS writes are).
    A full disk is not transient: :class:`synthq.core.errors.DiskFull` at once.
    """
    for attempt in range(attempts):
        try:
            return fn()
        except (OperationalError, DBAPIError) as exc:
            if disk_full(exc):
                from synthq.core.errors import DiskFull

                raise DiskFull(database_location()) from exc
            transient = isinstance(exc, OperationalError) or exc.connection_invalidated
            if not transient or attempt + 1 == attempts:
                raise
            delay = exponential(attempt + 1, base=0.1, cap=2.0)
            log.warning("%s: transient error (%s); retrying in %.1f s", what,
                        str(exc).splitlines()[0][:200], delay)
            time.sleep(delay)
    raise AssertionError("unreachable")
