"""Plain SQL that runs unchanged on PostgreSQL and on SQLite, with or without SQLAlchemy.

``synthq status`` is typed all day. On the embedded default (a SQLite file)
the CLI answers it with the standard library's ``sqlite3``
(:mod:`synthq.cli.fast`): loading SQLAlchemy alone costs more CPU than a whole
bare Typer command. So that every figure of a status keeps one definition, the
reads behind it (:mod:`synthq.views.report`, :mod:`synthq.store.cost`, and the reads of
:mod:`synthq.serving.health`, :mod:`synthq.queue.workers` and :mod:`synthq.queue.limits` they use)
are SQL text run through a :class:`Reader`: a SQLAlchemy session on the
ordinary path (PostgreSQL or SQLite), a ``sqlite3`` connection on the fast one.

The readers smooth over what the two databases return differently:

* **datetimes**: PostgreSQL's ``timestamptz`` comes back aware. SQLite holds
  the text SQLAlchemy writes for :class:`synthq.store.models.UTCDateTime`
  (``YYYY-MM-DD HH:MM:SS.ffffff``, UTC): a ``datetime`` parameter is written
  in that same form, so comparing the text compares the times, and
  :func:`read_time` parses results back to aware UTC;
* **JSON**: PostgreSQL's ``jsonb`` comes back parsed, SQLite's as text
  (:func:`read_json`); a JSON parameter is passed as ``json.dumps`` text, which
  both store into a JSON column;
* **numbers**: SQLite's booleans are 0/1 and a PostgreSQL ``sum()`` of a BIGINT
  is a ``Decimal``: wrap results in ``bool()`` / ``int()``.

The SQL itself uses only what both dialects share: ``:name`` parameters, no
``::`` casts, ``NOT flag`` instead of ``flag = false``, and the column
``"limit"`` quoted. This module imports only the standard library (the fast
path checks that with ``python -X importtime``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import sqlite3

    from sqlalchemy.orm import Session

__all__ = ["Reader", "SessionReader", "SqliteReader", "reader_of", "in_list", "read_time",
           "read_optional_time", "read_json", "SQLITE_TIME"]

#: How SQLAlchemy writes a DATETIME into SQLite (what synthq's tables hold there).
SQLITE_TIME = "%Y-%m-%d %H:%M:%S.%f"

Row = tuple[Any, ...]


class Reader(Protocol):
    """Runs SQL text on one database, in the caller's transaction."""

    #: ``"postgresql"`` or ``"sqlite"``.
    dialect: str

    def rows(self, sql: str, params: Mapping[str, Any] | None = None) -> list[Row]:
        """Every row of a SELECT, as tuples."""
        ...

    def write(self, sql: str, params: Mapping[str, Any] | None = None) -> int:
        """Run an UPDATE (or INSERT, DELETE); the number of rows it changed."""
        ...


def _sqlite_params(params: Mapping[str, Any] | None) -> dict[str, Any]:
    """``params`` with every datetime written the way SQLAlchemy stores it in SQLite."""
    return {k: v.astimezone(UTC).strftime(SQLITE_TIME) if isinstance(v, datetime) else v
            for k, v in (params or {}).items()}


class SessionReader:
    """The ordinary path: SQL text through a SQLAlchemy session (PostgreSQL or SQLite)."""

    def __init__(self, session: Session) -> None:
        from sqlalchemy import text

        self._session = session
        self._text = text
        self.dialect: str = session.get_bind().dialect.name

    def _params(self, params: Mapping[str, Any] | None) -> dict[str, Any]:
        return _sqlite_params(params) if self.dialect == "sqlite" else dict(params or {})

    def rows(self, sql: str, params: Mapping[str, Any] | None = None) -> list[Row]:
        return [tuple(r) for r in self._session.execute(self._text(sql), self._params(params))]

    def write(self, sql: str, params: Mapping[str, Any] | None = None) -> int:
        result = self._session.execute(self._text(sql), self._params(params))
        return int(result.rowcount)  # type: ignore[attr-defined]


class SqliteReader:
    """The CLI's fast path: SQL text through a standard-library ``sqlite3`` connection."""

    dialect = "sqlite"

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def rows(self, sql: str, params: Mapping[str, Any] | None = None) -> list[Row]:
        return self._conn.execute(sql, _sqlite_params(params)).fetchall()

    def write(self, sql: str, params: Mapping[str, Any] | None = None) -> int:
        return self._conn.execute(sql, _sqlite_params(params)).rowcount


def reader_of(db: Session | Reader) -> Reader:
    """``db`` itself when it is a Reader, else a :class:`SessionReader` over the session
    (so the functions of :mod:`synthq.views.report` keep taking a session, as they always did)."""
    if hasattr(db, "rows"):
        return db  # type: ignore[return-value]
    return SessionReader(db)  # type: ignore[arg-type]


def in_list(name: str, values: list[Any]) -> tuple[str, dict[str, Any]]:
    """``(:name_0, :name_1, ...)`` and its parameters, for ``column IN`` a list: neither
    sqlite3 nor plain SQL text expands a list parameter. An empty list gives ``(NULL)``,
    which matches nothing."""
    params = {f"{name}_{i}": v for i, v in enumerate(values)}
    return "(" + (", ".join(f":{k}" for k in params) or "NULL") + ")", params


def read_time(value: datetime | str) -> datetime:
    """A datetime column's value as an aware UTC datetime (SQLite gives text, PostgreSQL
    an aware datetime in the session's time zone)."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if value.tzinfo is None:
        return value.replace(tzinfo=UTC)
    return value.astimezone(UTC)


def read_optional_time(value: datetime | str | None) -> datetime | None:
    """:func:`read_time` of a nullable column (or of ``min()``/``max()`` over no rows)."""
    return None if value is None else read_time(value)


def read_json(value: Any) -> Any:
    """A JSON column's value, parsed (SQLite gives the text, PostgreSQL the object)."""
    return json.loads(value) if isinstance(value, str | bytes) else value
