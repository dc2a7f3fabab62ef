"""The per-job counters, read in plain SQL: samples per state and error class, calls per
outcome, and the job list `synthq jobs` prints.

The triggers of migration 0016 keep ``sample_counts`` and ``call_counts``: a
few rows per job, however many samples; the sweep folds their delta rows
(:func:`compact_counts`). Apart from :mod:`synthq.views.report` (which
re-exports these) so that `synthq jobs` on its fast path (:mod:`synthq.cli.fast`)
loads only this and :mod:`synthq.store.sqlread`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from synthq.core.enums import SampleState
from synthq.store.sqlread import Reader, read_time, reader_of

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

__all__ = ["Counted", "counted", "sample_counts", "state_counts", "call_counts", "job_list",
           "compact_counts"]


class Counted(NamedTuple):
    """One key of the job's counters: samples in ``state`` with ``error_class`` at
    ``tokenize_version``, and the sums over them."""

    state: str
    error_class: str | None
    tokenize_version: int | None
    #: The response is stored.
    answered: bool
    n: int
    tokens: int
    supervised: int
    mismatches: int


def counted(db: Session | Reader, job_id: int) -> list[Counted]:
    """The job's counters (kept by the triggers of migration 0016): a few rows, however
    many samples; the delta rows of a key not yet folded are summed here."""
    rows = reader_of(db).rows(
        "SELECT state, error_class, tokenize_version, answered, sum(n), sum(tokens), "
        "sum(supervised), sum(mismatches) FROM sample_counts WHERE job_id = :job_id "
        "GROUP BY state, error_class, tokenize_version, answered", {"job_id": job_id})
    return [Counted(str(r[0]), r[1], r[2], bool(r[3]), *(int(x or 0) for x in r[4:]))
            for r in rows]


def sample_counts(db: Session | Reader, job_id: int,
                  rows: list[Counted] | None = None) -> dict[tuple[str, str | None], int]:
    """The job's samples per (state, error class)."""
    counts: dict[tuple[str, str | None], int] = {}
    for c in rows if rows is not None else counted(db, job_id):
        if c.n:
            counts[(c.state, c.error_class)] = counts.get((c.state, c.error_class), 0) + c.n
    return counts


def state_counts(db: Session | Reader, job_id: int,
                 by_class: dict[tuple[str, str | None], int] | None = None) -> dict[str, int]:
    """The job's samples per state (every state, 0 included)."""
    counts = {s.value: 0 for s in SampleState}
    for (state, _), n in (by_class if by_class is not None
                          else sample_counts(db, job_id)).items():
        counts[state] = counts.get(state, 0) + n
    return counts


def call_counts(db: Session | Reader, job_id: int) -> dict[str, int]:
    """The job's calls per outcome (``ok`` or a failure class), from the counters."""
    rows = reader_of(db).rows(
        "SELECT outcome, sum(n) FROM call_counts WHERE job_id = :job_id "
        "AND outcome IS NOT NULL GROUP BY outcome", {"job_id": job_id})
    return {str(outcome): int(n) for outcome, n in rows if n}


def job_list(db: Session | Reader) -> list[dict[str, Any]]:
    """Every job with its samples per state, as `synthq jobs --json` prints them."""
    reader = reader_of(db)
    return [{"id": job_id, "name": name, "state": state, "model": model,
             "created_at": read_time(created).isoformat(), **state_counts(reader, job_id)}
            for job_id, name, state, model, created in reader.rows(
                "SELECT id, name, state, model, created_at FROM jobs ORDER BY id")]


# -- their compaction ---------------------------------------------------------------------

#: PostgreSQL: fold each key's delta rows (appended by the triggers of migration 0016)
#: into one, and drop keys whose sums are all zero. Rows a writer appends meanwhile are not in
#: this statement's snapshot and stay; a second fold at once skips the rows the first
#: deleted. Either way every sum is unchanged.
_FOLD = """
    WITH keys AS (
        SELECT {key} FROM {table} GROUP BY {key} HAVING count(*) > 1 OR {zero}
    ), folded AS (
        DELETE FROM {table} c USING keys
        WHERE {match}
        RETURNING {returning}
    )
    INSERT INTO {table} ({key}, {sums})
    SELECT {key}, {summed} FROM folded GROUP BY {key} HAVING NOT ({zero})"""


_NULLABLE = ("error_class", "tokenize_version", "outcome")


def _fold(table: str, key: Sequence[str], sums: Sequence[str]) -> str:
    return _FOLD.format(
        table=table, key=", ".join(key), sums=", ".join(sums),
        # error_class and outcome may be NULL: a NULL key matches a NULL key.
        match=" AND ".join(f"c.{k} IS NOT DISTINCT FROM keys.{k}" if k in _NULLABLE
                           else f"c.{k} = keys.{k}" for k in key),
        returning=", ".join(f"c.{c}" for c in (*key, *sums)),
        summed=", ".join(f"sum({c})" for c in sums),
        zero=" AND ".join(f"sum({c}) = 0" for c in sums))


_FOLD_SAMPLES = _fold("sample_counts", ("job_id", "state", "error_class", "tokenize_version",
                                        "answered"),
                      ("n", "tokens", "supervised", "mismatches"))
_FOLD_CALLS = _fold("call_counts", ("job_id", "server", "outcome"), ("n", "tokens"))


def compact_counts(session: Session) -> None:
    """Keep the counter tables small (the sweep calls this): one row per key.

    The triggers never wait on one another for a counter: on PostgreSQL each
    statement appends its deltas. SQLite keeps one row per key already; only
    the keys at zero go. (The only write to the counters outside the triggers.)
    """
    from sqlalchemy import text

    if session.get_bind().dialect.name == "postgresql":
        session.execute(text(_FOLD_SAMPLES))
        session.execute(text(_FOLD_CALLS))
    else:
        session.execute(text("DELETE FROM sample_counts WHERE n = 0 AND tokens = 0 "
                             "AND supervised = 0 AND mismatches = 0"))
