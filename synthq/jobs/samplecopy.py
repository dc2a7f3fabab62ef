"""New samples written in bulk: a job's rows inserted in batches, one transaction each.

On PostgreSQL a binary ``COPY`` streamed while the rows are read (through a
temporary table and ``ON CONFLICT DO NOTHING`` once a batch meets a content key
the job holds); on SQLite ``INSERT … ON CONFLICT DO NOTHING``. What a job is
and how its rows are read is :mod:`synthq.jobs.enqueue`'s; this module only writes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from synthq.data.dataset import KEY_VERSION, ContentKeys, Row, raw_key
from synthq.data.turns import turn_positions
from synthq.queue import jobs
from synthq.queue.states import SampleState
from synthq.store.db import get_engine, utcnow
from synthq.store.models import Sample

__all__ = ["Counts", "insert_rows", "BATCH", "BATCH_BYTES"]

#: Rows per transaction (one COPY on PostgreSQL), at most: the reader waits for the
#: server at each batch's end, so fewer ends overlap more (5,000 rows: 41,000 rows/s;
#: 20,000: 58,000-68,000 rows/s here). A batch's rows are kept in memory for the duplicate
#: fallback, so a batch also ends after BATCH_BYTES of prompts.
BATCH = 20_000
BATCH_BYTES = 64 << 20


class Counts(Protocol):
    """What :func:`insert_rows` counts into (``synthq.jobs.enqueue.EnqueueReport``)."""

    rows: int
    inserted: int
    skipped: int
    duplicates: int
    source_ids: int
    skip_examples: list[tuple[str, str]]


#: Columns a new sample is inserted with (the rest take their defaults), in the
#: order of the tuples that :func:`insert_rows` builds.
_COPY_COLUMNS = ("job_id", "content_key", "dataset_index", "source_id", "prompt", "state",
                 "attempts", "next_attempt_at", "created_at", "updated_at", "finished_at",
                 "error_class", "error_message", "tools", "turn_count")

#: PostgreSQL's binary input of a jsonb value: a format version byte, then the JSON text.
_JSONB_VERSION = b"\x01"


class _PostgresBatches:
    """Writes each batch of new samples with a binary ``COPY``; returns how many were new.

    The rows are copied while they are read: the server inserts the rows
    already sent while the next ones are parsed and hashed, so reading and
    inserting overlap instead of taking turns.

    A batch is first copied straight into ``samples``, inside a savepoint. A
    content key the job already holds (a re-enqueue, or the same row twice in
    the dataset) makes that fail on the unique index; the batch is then copied
    again into a temporary table and inserted with ``ON CONFLICT DO NOTHING``,
    which costs the server about twice as much, and so is the next batch (a
    re-enqueue pays one failed try). Rows go in dataset order, which makes it
    id order, which is dispatch order.

    Binary ``COPY``: the server parses no text, and psycopg formats a row in C
    (measured here into a table without indexes: a fifth of the time of a text
    ``COPY`` of the same rows). A binary field must be in its column's
    binary form, so the types come from the catalog, and the jsonb columns
    travel as bytes that :func:`_sample_values` prefixed with the jsonb format
    version.
    """

    def __init__(self) -> None:
        self._types: list[int] | None = None
        self._direct = True

    def __call__(self, conn: Any, values: Iterator[tuple[Any, ...]],
                 batch: list[tuple[Any, ...]]) -> int:
        import psycopg

        cursor = conn.connection.driver_connection.cursor()
        with cursor:
            if self._types is None:
                self._types = self._column_types(cursor)
            rows: Iterable[tuple[Any, ...]] = values
            keep: list[tuple[Any, ...]] | None = batch
            if self._direct:
                try:
                    with conn.begin_nested():  # a duplicate key undoes this COPY only
                        self._copy(cursor, "samples", values, batch)
                    return len(batch)
                except psycopg.errors.UniqueViolation:
                    batch.extend(values)  # the rows not read when the error came
                    rows, keep = batch, None  # copied again, from the batch
            cols = ", ".join(_COPY_COLUMNS)
            cursor.execute(
                f"CREATE TEMP TABLE IF NOT EXISTS synthq_enqueue_rows ON COMMIT DELETE ROWS "
                f"AS SELECT {cols} FROM samples WITH NO DATA")
            self._copy(cursor, "synthq_enqueue_rows", rows, keep)
            cursor.execute(
                f"INSERT INTO samples ({cols}) SELECT {cols} FROM synthq_enqueue_rows "
                "ORDER BY dataset_index ON CONFLICT (job_id, content_key) DO NOTHING")
            added = int(cursor.rowcount)
            self._direct = added == len(batch)
            return added

    def _copy(self, cursor: Any, table: str, values: Iterable[tuple[Any, ...]],
              keep: list[tuple[Any, ...]] | None) -> None:
        """COPY ``values`` into ``table``, appending each to ``keep`` (when given)."""
        assert self._types is not None
        with cursor.copy(f"COPY {table} ({', '.join(_COPY_COLUMNS)}) FROM STDIN "
                         "(FORMAT BINARY)") as copy:
            copy.set_types(self._types)
            write = copy.write_row
            if keep is None:
                for row in values:
                    write(row)
            else:
                for row in values:
                    keep.append(row)
                    write(row)

    @staticmethod
    def _column_types(cursor: Any) -> list[int]:
        """The type oid to dump each column with: its own, bytea for the jsonb ones."""
        cursor.execute("SELECT attname, atttypid, 'jsonb'::regtype::oid, 'bytea'::regtype::oid "
                       "FROM pg_attribute WHERE attrelid = 'samples'::regclass "
                       "AND attname = ANY(%s)", [list(_COPY_COLUMNS)])
        found = {name: (oid, jsonb, bytea) for name, oid, jsonb, bytea in cursor.fetchall()}
        types = []
        for column in _COPY_COLUMNS:
            oid, jsonb, bytea = found[column]
            if column in ("prompt", "tools"):
                if oid != jsonb:
                    raise RuntimeError(f"samples.{column} is not jsonb: the database schema "
                                       "is not the one this synthq expects")
                oid = bytea  # dumps our bytes as they are: version byte + JSON text
            types.append(oid)
        return types


class _SqliteBatches:
    """SQLite: one executemany a batch; RETURNING yields only the rows that were new."""

    def __init__(self) -> None:
        self._stmt = sqlite_insert(Sample).on_conflict_do_nothing(
            index_elements=["job_id", "content_key"]).returning(Sample.id)

    def __call__(self, conn: Any, values: Iterator[tuple[Any, ...]],
                 batch: list[tuple[Any, ...]]) -> int:
        batch.extend(values)
        if not batch:
            return 0
        rows = [dict(zip(_COPY_COLUMNS, row, strict=True)) for row in batch]
        return len(conn.execute(self._stmt, rows).all())


def insert_rows(job_id: int, settings: dict[str, Any], rows: Iterable[Row],
                report: Counts,
                progress: Callable[[Any], None] | None = None, *,
                key_version: int = KEY_VERSION, regenerate: str = "last") -> None:
    """Insert ``rows`` as samples of ``job_id`` in batches, updating ``report``.

    ``key_version`` must be the job's: the rows' prompts were cut under it, and
    their content keys are computed under it. Each batch is one transaction.
    """
    engine = get_engine()
    postgres = engine.dialect.name == "postgresql"
    write = _PostgresBatches() if postgres else _SqliteBatches()
    values = _sample_values(job_id, ContentKeys(settings, key_version), rows, report,
                            postgres=postgres, regenerate=regenerate)
    while True:
        peek = next(values, None)  # no transaction for an empty last batch
        if peek is None:
            return
        batch: list[tuple[Any, ...]] = []
        with engine.begin() as conn:
            added = write(conn, _bounded(peek, values), batch)
            if added:  # a finished job has work again
                jobs.reactivate(conn, job_id, now=utcnow())
        report.inserted += added
        report.duplicates += len(batch) - added
        if progress:
            progress(report)


def _bounded(first: tuple[Any, ...], values: Iterator[tuple[Any, ...]]
             ) -> Iterator[tuple[Any, ...]]:
    """``first``, then ``values`` up to BATCH rows or BATCH_BYTES of prompts in all; never
    takes a row from ``values`` that it does not yield."""
    row, count, size = first, 1, 0
    while True:
        yield row
        size += _prompt_size(row[4])
        if count >= BATCH or size >= BATCH_BYTES:
            return
        nxt = next(values, None)
        if nxt is None:
            return
        row, count = nxt, count + 1


def _prompt_size(prompt: Any) -> int:
    """PostgreSQL's JSON bytes, or SQLite's messages counted by their text."""
    if isinstance(prompt, bytes):
        return len(prompt)
    return sum(len(m.get("content") or "") for m in prompt or () if isinstance(m, dict))


def _sample_values(job_id: int, keys: ContentKeys, rows: Iterable[Row], report: Counts,
                   *, postgres: bool, regenerate: str) -> Iterator[tuple[Any, ...]]:
    """Each row's new sample as a tuple in :data:`_COPY_COLUMNS` order; counts into ``report``.

    PostgreSQL gets the prompt as the canonical JSON that was just hashed (jsonb
    keeps no key order, so nothing is lost); SQLite the messages themselves,
    which SQLAlchemy's JSON type encodes.
    """
    from synthq.spec.config import get_settings

    now = utcnow()
    pending, skipped = SampleState.PENDING.value, SampleState.SKIPPED.value
    # Each regenerated turn is a call with the whole history so far: a 2,500-turn row
    # would be 2,500 calls with ever larger bodies.
    max_turns = get_settings().max_regenerated_turns
    for row in rows:
        report.rows += 1
        if row.source_id is not None:
            report.source_ids += 1
        tools: Any = row.tools
        if tools is not None and postgres:
            tools = _JSONB_VERSION + json.dumps(tools, ensure_ascii=False).encode("utf-8")
        reason = None if row.messages is not None else row.skip_reason or "malformed row"
        turn_count = None
        if row.messages is not None and regenerate == "all":
            turn_count = len(turn_positions(row.messages))
            if turn_count > max_turns:
                reason = (f"{turn_count:,} assistant turns to regenerate, over "
                          f"SYNTHQ_MAX_REGENERATED_TURNS={max_turns:,}")
        if reason is not None or row.messages is None:
            reason = reason or "malformed row"
            report.skipped += 1
            where = row.where or f"row {row.index + 1}"
            if len(report.skip_examples) < 10:
                report.skip_examples.append((where, reason))
            message = f"{where}: {reason}" + (f"; row: {row.raw[:500]}" if row.raw else "")
            yield (job_id, raw_key(f"{row.index}:{row.raw or reason}"), row.index,
                   row.source_id, None, skipped, 0, None, now, now, now, "invalid_input",
                   message, tools, None)
        else:
            key, prompt_json = keys.key(row.messages, row.tools)
            yield (job_id, key, row.index, row.source_id,
                   _JSONB_VERSION + prompt_json if postgres else row.messages, pending, 0,
                   now, now, now, None, None, None, tools, turn_count)
