"""`synthq jobs` and `synthq status` without SQLAlchemy or pydantic: people type them all day.

Loading SQLAlchemy, the models and pydantic-settings costs several times the
CPU of a bare Typer app. When the settings are the embedded defaults (no
``SYNTHQ_`` variable but ``SYNTHQ_DATA_DIR`` and a ``sqlite:///``
``SYNTHQ_DATABASE_URL``) and the SQLite file exists at the current schema,
these commands read it with the standard library's ``sqlite3``:

* the job list through :func:`synthq.store.counts.job_list`, and a job's status
  through :func:`synthq.views.report.job_status`: the functions the ordinary path
  calls, whose reads are plain SQL (:mod:`synthq.store.sqlread`), so the same
  figures come from the same code.

On PostgreSQL (``SYNTHQ_DATABASE_URL``, and only settings this module checks
itself: the broker URL, the API key, the worker timeout, the GPU-hour price)
``synthq status`` reads through psycopg alone, with the same functions.

Anything else (another setting, no database yet, an older schema, an unknown
job, any database error) returns None and the command takes the ordinary path,
which validates, creates and migrates, and words the errors.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from synthq.core.defaults import DATA_DIR, StatusSettings

if TYPE_CHECKING:
    import sqlite3

    from synthq.views.report import JobStatus

__all__ = ["eligible", "job_rows", "job_status"]

_ALLOWED = frozenset({"SYNTHQ_DATA_DIR", "SYNTHQ_DATABASE_URL"})


def _sqlite_path() -> Path | None:
    if any(k.startswith("SYNTHQ_") and k not in _ALLOWED for k in os.environ):
        return None
    url = os.environ.get("SYNTHQ_DATABASE_URL", "")
    if not url:
        data_dir = os.environ.get("SYNTHQ_DATA_DIR") or DATA_DIR
        return Path(data_dir) / "synthq.db"
    if not url.startswith("sqlite:///") or "?" in url:
        return None
    return Path(url.removeprefix("sqlite:///"))


def eligible() -> bool:
    """True when this module can answer (the settings need no validation then)."""
    path = _sqlite_path()
    return (path is not None and path.is_file()) or _pg_settings() is not None


#: The settings the PostgreSQL path reads or checks itself; with any other ``SYNTHQ_``
#: setting in the environment the ordinary path runs (and validates it).
_PG_ALLOWED = frozenset({"SYNTHQ_DATA_DIR", "SYNTHQ_DATABASE_URL", "SYNTHQ_BROKER_URL",
                         "SYNTHQ_WORKER_TIMEOUT", "SYNTHQ_GPU_HOUR_PRICE", "SYNTHQ_API_KEY"})


class _PgSettings(NamedTuple):
    #: A libpq URL (``postgresql://``).
    url: str
    status: StatusSettings


def _pg_settings() -> _PgSettings | None:
    """The PostgreSQL path's settings when every ``SYNTHQ_`` setting is one it checks the
    way :mod:`synthq.spec.config` does, and valid; else None (the ordinary path says why).

    ``synthq status --json`` on PostgreSQL took 6-14 s on a loaded machine: nearly all of
    it importing SQLAlchemy, pydantic-settings and the models (1.2 s of CPU) to run a
    dozen plain reads (0.05 s)."""
    env = {k: v for k, v in os.environ.items() if k.startswith("SYNTHQ_")}
    if any(k not in _PG_ALLOWED for k in env):
        return None
    url = env.get("SYNTHQ_DATABASE_URL", "").strip()
    for prefix in ("postgresql+psycopg://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            url = "postgresql://" + url[len(prefix):]
            break
    else:
        return None
    from synthq.core.defaults import GPU_HOUR_PRICE, WORKER_TIMEOUT
    from synthq.core.secrets import check_secret, check_url

    broker = env.get("SYNTHQ_BROKER_URL", "").strip()
    try:
        check_url("SYNTHQ_DATABASE_URL", url)
        check_url("SYNTHQ_BROKER_URL", broker)
        check_secret("SYNTHQ_API_KEY", env.get("SYNTHQ_API_KEY"), required=False)
        timeout = float(env.get("SYNTHQ_WORKER_TIMEOUT", WORKER_TIMEOUT))
        price_text = env.get("SYNTHQ_GPU_HOUR_PRICE", "").strip()
        price = float(price_text) if price_text else GPU_HOUR_PRICE
    except ValueError:
        return None
    if broker and not broker.startswith(("redis://", "rediss://")):
        return None
    if not math.isfinite(timeout) or (price is not None and not math.isfinite(price)):
        return None
    return _PgSettings(url, StatusSettings(worker_timeout=timeout, gpu_hour_price=price))


def _connect(mode: str) -> sqlite3.Connection | None:
    """The database file, opened ``ro`` or ``rw`` (never created) in autocommit mode, if
    the settings are the defaults and its schema is the current one; else None."""
    import sqlite3

    from synthq.store.migrate import HEAD

    path = _sqlite_path()
    if path is None or not path.is_file():
        return None
    try:
        conn = sqlite3.connect(f"{path.absolute().as_uri()}?mode={mode}", uri=True,
                               timeout=60, isolation_level=None)
    except sqlite3.Error:
        return None
    try:
        version = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    except sqlite3.Error:
        version = None
    if version is None or version[0] != HEAD:
        conn.close()
        return None
    return conn


def job_rows() -> list[dict[str, Any]] | None:
    """Every job with its counts per state, as `synthq jobs --json` prints them; or None."""
    import sqlite3

    from synthq.store.counts import job_list
    from synthq.store.sqlread import SqliteReader

    conn = _connect("ro")
    if conn is None:
        return None
    try:
        return job_list(SqliteReader(conn))
    except (sqlite3.Error, ValueError):
        return None
    finally:
        conn.close()


def job_status(ref: str | None, *, now: datetime | None = None) -> JobStatus | None:
    """The status of job ``ref`` (None: the newest), as `synthq status` prints it; or None.

    One transaction that starts with ``BEGIN IMMEDIATE``, as the ordinary path's
    do on SQLite (synthq.db): the cost report may store its fold of busy time
    (synthq.store.cost.fold_busy), and then writes it the same way. ``now``: for tests.
    """
    import sqlite3

    from synthq.core.defaults import StatusSettings
    from synthq.store.sqlread import SqliteReader
    from synthq.views.report import find_job_row
    from synthq.views.report import job_status as status_of

    pg = _pg_settings()
    if pg is not None:
        return _pg_job_status(pg, ref, now=now)
    conn = _connect("rw")
    if conn is None:
        return None
    try:
        conn.execute("BEGIN IMMEDIATE")
        reader = SqliteReader(conn)
        if ref is None:
            newest = reader.rows("SELECT max(id) FROM jobs")[0][0]
            ref = None if newest is None else str(newest)
        job = find_job_row(reader, ref) if ref is not None else None
        if job is None:
            return None  # the ordinary path says which jobs there are
        # No SYNTHQ_ setting but the database's (see _sqlite_path): the defaults hold.
        status = status_of(reader, job, now=now, settings=StatusSettings())
        conn.execute("COMMIT")
        return status
    except (sqlite3.Error, ValueError):
        return None
    finally:
        conn.close()  # without COMMIT: rolled back


# -- PostgreSQL, through psycopg alone ---------------------------------------------------

#: ``:name`` parameters of :mod:`synthq.store.sqlread`'s SQL (no ``::`` casts are used there).
_PARAM = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


class PsycopgReader:
    """:class:`synthq.store.sqlread.Reader` over a plain psycopg connection (PostgreSQL)."""

    dialect = "postgresql"

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    @staticmethod
    def _sql(sql: str) -> str:
        return _PARAM.sub(r"%(\1)s", sql.replace("%", "%%"))

    def rows(self, sql: str, params: Mapping[str, Any] | None = None) -> list[tuple[Any, ...]]:
        return [tuple(r) for r in self._conn.execute(self._sql(sql), dict(params or {}))]

    def write(self, sql: str, params: Mapping[str, Any] | None = None) -> int:
        return int(self._conn.execute(self._sql(sql), dict(params or {})).rowcount)


def _pg_job_status(pg: _PgSettings, ref: str | None, *, now: datetime | None) -> JobStatus | None:
    """:func:`job_status` on PostgreSQL: one psycopg connection, one transaction, the
    database's clock (synthq.core.clock); None for anything the ordinary path must word."""
    import time
    from datetime import UTC, timedelta

    import psycopg

    from synthq.core import clock
    from synthq.store.migrate import HEAD
    from synthq.views.report import find_job_row
    from synthq.views.report import job_status as status_of

    try:
        conn = psycopg.connect(pg.url, connect_timeout=10)
    except psycopg.Error:
        return None
    try:
        started, wall = time.monotonic(), datetime.now(UTC)
        try:
            version, server_now = conn.execute(
                "SELECT version_num, clock_timestamp() FROM alembic_version").fetchone() \
                or (None, None)
        except psycopg.Error:
            return None
        if version != HEAD:
            return None
        half = (time.monotonic() - started) / 2
        clock.calibrate(server_now, started + half, wall + timedelta(seconds=half))
        reader = PsycopgReader(conn)
        if ref is None:
            newest = reader.rows("SELECT max(id) FROM jobs")[0][0]
            ref = None if newest is None else str(newest)
        job = find_job_row(reader, ref) if ref is not None else None
        if job is None:
            return None
        status = status_of(reader, job, now=now, settings=pg.status)
        conn.commit()  # the cost report may have stored its fold of busy time
        return status
    except (psycopg.Error, ValueError):
        return None
    finally:
        conn.close()
