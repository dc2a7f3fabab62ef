"""`synthq jobs` and `synthq status` without SQLAlchemy or pydantic: people type them all day.

Loading SQLAlchemy, the models and pydantic-settings costs several times the
CPU of a bare Typer app. When the settings are the embedded defaults (no
``SYNTHQ_`` variable but ``SYNTHQ_DATA_DIR`` and a ``sqlite:///``
``SYNTHQ_DATABASE_URL``) and the SQLite file exists at the current schema,
these commands read it with the standard library's ``sqlite3``:

* the job list through :func:`synthq.counts.job_list`, and a job's status
  through :func:`synthq.status.job_status`: the functions the ordinary path
  calls, whose reads are plain SQL (:mod:`synthq.sqlread`), so the same
  figures come from the same code.

Anything else (PostgreSQL, another setting, no database yet, an older schema,
an unknown job, any SQLite error) returns None and the command takes the
ordinary path, which validates, creates and migrates, and words the errors.
"""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from synthq.defaults import DATA_DIR

if TYPE_CHECKING:
    import sqlite3

    from synthq.status import JobStatus

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
    return path is not None and path.is_file()


def _connect(mode: str) -> sqlite3.Connection | None:
    """The database file, opened ``ro`` or ``rw`` (never created) in autocommit mode, if
    the settings are the defaults and its schema is the current one; else None."""
    import sqlite3

    from synthq.migrate import HEAD

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

    from synthq.counts import job_list
    from synthq.sqlread import SqliteReader

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
    (synthq.cost.fold_busy), and then writes it the same way. ``now``: for tests.
    """
    import sqlite3

    from synthq.defaults import StatusSettings
    from synthq.sqlread import SqliteReader
    from synthq.status import find_job_row
    from synthq.status import job_status as status_of

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
