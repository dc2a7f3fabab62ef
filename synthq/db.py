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
from pathlib import Path
from typing import TypeVar

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from synthq.clock import utcnow
from synthq.secrets import safe_url

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["safe_url", "utcnow", "get_engine", "session_scope", "dispose_engines", "with_db_retry",
           "disk_full", "database_location", "CLAIM_PATH_ATTEMPTS"]

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
    from synthq.config import get_settings

    settings = get_settings()
    # No pre-ping: it costs a round trip per checkout (14 % of a worker's CPU);
    # a dead pooled connection fails its statement instead, which
    # with_db_retry retries on a fresh one.
    return create_engine(url, pool_size=settings.db_pool_size,
                         max_overflow=settings.db_max_overflow, pool_recycle=1800)


def _sqlite_folder(db: Path) -> None:
    """Make the data directory for the default database; any other folder must exist.

    A typo in ``SYNTHQ_DATABASE_URL`` (``sqlite:////nonexistent/dir/x.db``) must
    not quietly create folders and an empty database.
    """
    from synthq.config import get_settings
    from synthq.errors import UserError

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
        from synthq.config import get_settings

        url = get_settings().database_url
    with _lock:
        engine = _engines.get(url)
        if engine is None:
            engine = _engines[url] = _make_engine(url)
        return engine


def dispose_engines() -> None:
    """Close every pooled connection (after fork, or at the end of a test)."""
    with _lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()


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
        from synthq.config import get_settings

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
    A full disk is not transient: :class:`synthq.errors.DiskFull` at once.
    """
    for attempt in range(attempts):
        try:
            return fn()
        except (OperationalError, DBAPIError) as exc:
            if disk_full(exc):
                from synthq.errors import DiskFull

                raise DiskFull(database_location()) from exc
            transient = isinstance(exc, OperationalError) or exc.connection_invalidated
            if not transient or attempt == attempts - 1:
                raise
            delay = min(2.0, 0.1 * 2**attempt)
            log.warning("%s: transient error (%s); retrying in %.1f s", what,
                        str(exc).splitlines()[0][:200], delay)
            time.sleep(delay)
    raise AssertionError("unreachable")
