"""`synthq jobs` without SQLAlchemy or pydantic: people type it all day.

Loading SQLAlchemy, the models and pydantic-settings costs several times the
CPU of a bare Typer app. When the settings are the embedded defaults (no
``SYNTHQ_`` variable but ``SYNTHQ_DATA_DIR`` and a ``sqlite:///``
``SYNTHQ_DATABASE_URL``) and the SQLite file exists at the current schema,
the job list is read with the standard library's ``sqlite3`` in two queries
(the same ones :func:`synthq.query.list_jobs` makes). Anything else (PostgreSQL,
another setting, no database yet, an older schema) returns None and the
command takes the ordinary path, which validates, creates and migrates.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = ["eligible", "job_rows"]

_ALLOWED = frozenset({"SYNTHQ_DATA_DIR", "SYNTHQ_DATABASE_URL"})


def _sqlite_path() -> Path | None:
    if any(k.startswith("SYNTHQ_") and k not in _ALLOWED for k in os.environ):
        return None
    url = os.environ.get("SYNTHQ_DATABASE_URL", "")
    if not url:
        data_dir = os.environ.get("SYNTHQ_DATA_DIR") or "synthq-data"
        return Path(data_dir) / "synthq.db"
    if not url.startswith("sqlite:///") or "?" in url:
        return None
    return Path(url.removeprefix("sqlite:///"))


def eligible() -> bool:
    """True when :func:`job_rows` can answer (the settings need no validation then)."""
    path = _sqlite_path()
    return path is not None and path.is_file()


def job_rows() -> list[dict[str, Any]] | None:
    """Every job with its counts per state, as `synthq jobs --json` prints them; or None."""
    import sqlite3

    from synthq.enums import SampleState
    from synthq.migrate import HEAD

    path = _sqlite_path()
    if path is None or not path.is_file():
        return None
    try:
        conn = sqlite3.connect(f"file:{path.absolute()}?mode=ro", uri=True, timeout=60)
    except sqlite3.Error:
        return None
    try:
        version = conn.execute("SELECT version_num FROM alembic_version").fetchone()
        if version is None or version[0] != HEAD:
            return None
        counts: dict[int, dict[str, int]] = {}
        for job_id, state, n in conn.execute(
                "SELECT job_id, state, count(*) FROM samples GROUP BY job_id, state"):
            counts.setdefault(job_id, {s.value: 0 for s in SampleState})[state] = n
        rows = []
        for job_id, name, state, model, created in conn.execute(
                "SELECT id, name, state, model, created_at FROM jobs ORDER BY id"):
            at = datetime.fromisoformat(created).replace(tzinfo=UTC)
            rows.append({"id": job_id, "name": name, "state": state, "model": model,
                         "created_at": at.isoformat(),
                         **counts.get(job_id, {s.value: 0 for s in SampleState})})
        return rows
    except (sqlite3.Error, ValueError):
        return None
    finally:
        conn.close()
