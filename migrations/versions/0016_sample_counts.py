"""sample_counts, call_counts: per-job counters kept by triggers

``status``, ``/metrics`` and the job list counted a job's samples per state
(and joined its attempts for the calls) on every read: seconds at 1M samples.
Two counter tables make those reads O(jobs x states):

* ``sample_counts``: samples per (job, state, error class, tokenize version,
  response stored or not), with their examples' tokens, supervised tokens and token mismatches;
* ``call_counts``: calls (attempt rows) per (job, server, outcome), with their
  completion tokens.

Triggers keep them in the transaction of every change, whatever the code path
(enqueue by INSERT or COPY, every transition, requeue, a job deleted by hand):

* PostgreSQL: statement-level triggers with transition tables append one
  *delta* row per (job, state, class) a statement changed. Appending never
  waits on another writer (no hot counter row, no lock-order deadlock between
  the dispatcher, the claim and the writer); a read sums the rows; the sweep
  folds them back into one row per key (``synthq.queue.states.compact_counts``).
* SQLite (one writer at a time): row-level triggers add to one row per key.

A job's counters go with the job (a trigger on ``jobs``); deleting samples of
a job still there subtracts them. Calls are history: deleting a sample by hand
keeps its calls counted. TRUNCATE empties the counters.

The migration fills both tables from the rows already there.

On SQLite a later migration that rebuilds ``samples``, ``attempts`` or
``jobs`` (``batch_alter_table`` copies the table) drops their triggers: it
must create them again (``create_triggers`` below).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-01 02:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0016'
down_revision: str | None = '0015'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

#: A counter's key: the columns, and the expression each is computed by from a sample
#: row (``{r}``: ``NEW.``, ``OLD.``, or nothing). ``answered``: its response is stored.
_KEY_OF = {"job_id": "{r}job_id", "state": "{r}state", "error_class": "{r}error_class",
           "tokenize_version": "{r}tokenize_version",
           "answered": "({r}response_content IS NOT NULL)"}
_KEY = ", ".join(_KEY_OF)
#: What a sample adds to its key's counter: itself, its example's tokens, supervised
#: tokens, and whether its tokens differ from the server's.
_SUMS = ("n", "tokens", "supervised", "mismatches")
_VALUES = ("1", "coalesce({r}num_tokens, 0)", "coalesce({r}num_supervised, 0)",
           "CASE WHEN {r}token_mismatch THEN 1 ELSE 0 END")


def _values(row: str = "") -> list[str]:
    """The _VALUES of the row ``row`` (``NEW.``, ``OLD.``; "": the columns as they are)."""
    return [v.format(r=row) for v in _VALUES]


def _keys(row: str = "") -> list[str]:
    return [k.format(r=row) for k in _KEY_OF.values()]


def _pg_rows(table: str, sign: str) -> str:
    keys = ", ".join(f"{k} AS {name}" for k, name in zip(_keys(), _KEY_OF, strict=True))
    values = ", ".join(f"{sign}{v} AS {name}" for v, name in zip(_values(), _SUMS, strict=True))
    return f"SELECT {keys}, {values} FROM {table}"


def _pg_samples(name: str, rows: str) -> str:
    """A trigger function appending the statement's deltas, one row per key changed.
    Joined to jobs, so a cascade from a deleted job (its row already gone) adds
    nothing; a lease renewal changes no key (+1 and -1 cancel) and adds nothing."""
    sums = ", ".join(f"sum({c}) AS {c}" for c in _SUMS)
    changed = " OR ".join(f"sum({c}) <> 0" for c in _SUMS)
    return f"""
    CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO sample_counts ({_KEY}, {", ".join(_SUMS)})
        SELECT d.* FROM (SELECT {_KEY}, {sums} FROM ({rows}) r
                         GROUP BY {_KEY} HAVING {changed}) d
        WHERE EXISTS (SELECT 1 FROM jobs WHERE jobs.id = d.job_id);
        RETURN NULL;
    END $$"""


#: PostgreSQL: one function per event (a trigger with transition tables has one event).
_PG = [
    _pg_samples("synthq_samples_inserted", _pg_rows("new_rows", "")),
    _pg_samples("synthq_samples_deleted", _pg_rows("old_rows", "-")),
    _pg_samples("synthq_samples_updated",
                f"{_pg_rows('new_rows', '')} UNION ALL {_pg_rows('old_rows', '-')}"),
    """
    CREATE FUNCTION synthq_attempts_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO call_counts (job_id, server, outcome, n, tokens)
        SELECT samples.job_id, new_rows.server, new_rows.outcome, count(*),
               coalesce(sum(new_rows.completion_tokens), 0)
        FROM new_rows JOIN samples ON samples.id = new_rows.sample_id
        GROUP BY samples.job_id, new_rows.server, new_rows.outcome;
        RETURN NULL;
    END $$""",
    """
    CREATE FUNCTION synthq_jobs_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        DELETE FROM sample_counts WHERE job_id IN (SELECT id FROM old_rows);
        DELETE FROM call_counts WHERE job_id IN (SELECT id FROM old_rows);
        RETURN NULL;
    END $$""",
    """
    CREATE FUNCTION synthq_counts_truncated() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        DELETE FROM sample_counts;
        IF TG_TABLE_NAME = 'jobs' THEN
            DELETE FROM call_counts;
        END IF;
        RETURN NULL;
    END $$""",
    """CREATE TRIGGER synthq_samples_inserted AFTER INSERT ON samples
       REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT
       EXECUTE FUNCTION synthq_samples_inserted()""",
    """CREATE TRIGGER synthq_samples_deleted AFTER DELETE ON samples
       REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT
       EXECUTE FUNCTION synthq_samples_deleted()""",
    """CREATE TRIGGER synthq_samples_updated AFTER UPDATE ON samples
       REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows FOR EACH STATEMENT
       EXECUTE FUNCTION synthq_samples_updated()""",
    """CREATE TRIGGER synthq_attempts_inserted AFTER INSERT ON attempts
       REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT
       EXECUTE FUNCTION synthq_attempts_inserted()""",
    """CREATE TRIGGER synthq_jobs_deleted AFTER DELETE ON jobs
       REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT
       EXECUTE FUNCTION synthq_jobs_deleted()""",
    """CREATE TRIGGER synthq_samples_truncated AFTER TRUNCATE ON samples
       FOR EACH STATEMENT EXECUTE FUNCTION synthq_counts_truncated()""",
    """CREATE TRIGGER synthq_jobs_truncated AFTER TRUNCATE ON jobs
       FOR EACH STATEMENT EXECUTE FUNCTION synthq_counts_truncated()""",
]

_PG_DROP = [
    "DROP TRIGGER IF EXISTS synthq_samples_inserted ON samples",
    "DROP TRIGGER IF EXISTS synthq_samples_deleted ON samples",
    "DROP TRIGGER IF EXISTS synthq_samples_updated ON samples",
    "DROP TRIGGER IF EXISTS synthq_attempts_inserted ON attempts",
    "DROP TRIGGER IF EXISTS synthq_jobs_deleted ON jobs",
    "DROP TRIGGER IF EXISTS synthq_samples_truncated ON samples",
    "DROP TRIGGER IF EXISTS synthq_jobs_truncated ON jobs",
    "DROP FUNCTION IF EXISTS synthq_samples_inserted()",
    "DROP FUNCTION IF EXISTS synthq_samples_deleted()",
    "DROP FUNCTION IF EXISTS synthq_samples_updated()",
    "DROP FUNCTION IF EXISTS synthq_attempts_inserted()",
    "DROP FUNCTION IF EXISTS synthq_jobs_deleted()",
    "DROP FUNCTION IF EXISTS synthq_counts_truncated()",
]


def _sqlite_add(row: str, sign: str) -> str:
    """SQLite: add ``row`` (NEW or OLD) to its key's counter with ``sign``, creating the
    counter at 0 first; only while the job exists (a cascade from a deleted job adds
    nothing)."""
    key = " AND ".join(f"{c} IS {k}" for c, k in zip(_KEY_OF, _keys(f"{row}."), strict=True))
    values = ", ".join(f"{c} = {c} {sign} {v}"
                       for c, v in zip(_SUMS, _values(f"{row}."), strict=True))
    return f"""
        INSERT INTO sample_counts ({_KEY}, {", ".join(_SUMS)})
        SELECT {", ".join(_keys(f"{row}."))}, 0, 0, 0, 0
        WHERE EXISTS (SELECT 1 FROM jobs WHERE id = {row}.job_id)
          AND NOT EXISTS (SELECT 1 FROM sample_counts WHERE {key});
        UPDATE sample_counts SET {values}
        WHERE id = (SELECT min(id) FROM sample_counts WHERE {key});"""


_SQLITE = [
    f"""CREATE TRIGGER synthq_samples_inserted AFTER INSERT ON samples BEGIN
        {_sqlite_add('NEW', '+')}
    END""",
    f"""CREATE TRIGGER synthq_samples_deleted AFTER DELETE ON samples BEGIN
        {_sqlite_add('OLD', '-')}
    END""",
    f"""CREATE TRIGGER synthq_samples_updated AFTER UPDATE OF job_id, state, error_class,
        tokenize_version, response_content, num_tokens, num_supervised, token_mismatch
        ON samples
        WHEN OLD.job_id IS NOT NEW.job_id OR OLD.state IS NOT NEW.state
             OR OLD.error_class IS NOT NEW.error_class
             OR OLD.tokenize_version IS NOT NEW.tokenize_version
             OR (OLD.response_content IS NULL) IS NOT (NEW.response_content IS NULL)
             OR OLD.num_tokens IS NOT NEW.num_tokens
             OR OLD.num_supervised IS NOT NEW.num_supervised
             OR OLD.token_mismatch IS NOT NEW.token_mismatch BEGIN
        {_sqlite_add('OLD', '-')}
        {_sqlite_add('NEW', '+')}
    END""",
    """CREATE TRIGGER synthq_attempts_inserted AFTER INSERT ON attempts BEGIN
        INSERT INTO call_counts (job_id, server, outcome, n, tokens)
        SELECT job_id, NEW.server, NEW.outcome, 0, 0 FROM samples WHERE id = NEW.sample_id
          AND NOT EXISTS (SELECT 1 FROM call_counts WHERE job_id = samples.job_id
                          AND server = NEW.server AND outcome IS NEW.outcome);
        UPDATE call_counts SET n = n + 1, tokens = tokens + coalesce(NEW.completion_tokens, 0)
        WHERE id = (SELECT min(id) FROM call_counts
                    WHERE job_id = (SELECT job_id FROM samples WHERE id = NEW.sample_id)
                      AND server = NEW.server AND outcome IS NEW.outcome);
    END""",
    """CREATE TRIGGER synthq_jobs_deleted AFTER DELETE ON jobs BEGIN
        DELETE FROM sample_counts WHERE job_id = OLD.id;
        DELETE FROM call_counts WHERE job_id = OLD.id;
    END""",
]

_SQLITE_DROP = [f"DROP TRIGGER IF EXISTS synthq_{name}" for name in (
    "samples_inserted", "samples_deleted", "samples_updated", "attempts_inserted",
    "jobs_deleted")]


def create_triggers() -> None:
    for statement in _PG if op.get_bind().dialect.name == "postgresql" else _SQLITE:
        op.execute(statement)


def drop_triggers() -> None:
    for statement in _PG_DROP if op.get_bind().dialect.name == "postgresql" else _SQLITE_DROP:
        op.execute(statement)


def upgrade() -> None:
    id_type = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')
    op.create_table(
        'sample_counts',
        sa.Column('id', id_type, nullable=False),
        sa.Column('job_id', id_type, nullable=False),
        sa.Column('state', sa.String(length=16), nullable=False),
        sa.Column('error_class', sa.String(length=32), nullable=True),
        sa.Column('tokenize_version', sa.Integer(), nullable=True),
        sa.Column('answered', sa.Boolean(), nullable=False),
        sa.Column('n', sa.BigInteger(), nullable=False),
        sa.Column('tokens', sa.BigInteger(), nullable=False),
        sa.Column('supervised', sa.BigInteger(), nullable=False),
        sa.Column('mismatches', sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_sample_counts')),
    )
    op.create_index('ix_sample_counts_key', 'sample_counts',
                    ['job_id', 'state', 'error_class', 'tokenize_version', 'answered'],
                    unique=False)
    op.create_table(
        'call_counts',
        sa.Column('id', id_type, nullable=False),
        sa.Column('job_id', id_type, nullable=False),
        sa.Column('server', sa.String(length=500), nullable=False),
        sa.Column('outcome', sa.String(length=32), nullable=True),
        sa.Column('n', sa.BigInteger(), nullable=False),
        sa.Column('tokens', sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_call_counts')),
    )
    op.create_index('ix_call_counts_key', 'call_counts', ['job_id', 'server', 'outcome'],
                    unique=False)
    if op.get_bind().dialect.name == "postgresql":
        # No write between the backfill and the triggers (SQLite: one writer anyway).
        op.execute("LOCK TABLE jobs, samples, attempts IN SHARE ROW EXCLUSIVE MODE")
    # Backfill before the triggers exist, in this transaction: nothing counted twice.
    op.execute(f"""
        INSERT INTO sample_counts ({_KEY}, {", ".join(_SUMS)})
        SELECT {_KEY}, {", ".join(f"sum({c})" for c in _SUMS)} FROM ({_pg_rows("samples", "")}) r
        GROUP BY {_KEY}""")
    op.execute("""
        INSERT INTO call_counts (job_id, server, outcome, n, tokens)
        SELECT samples.job_id, attempts.server, attempts.outcome, count(*),
               coalesce(sum(attempts.completion_tokens), 0)
        FROM attempts JOIN samples ON samples.id = attempts.sample_id
        GROUP BY samples.job_id, attempts.server, attempts.outcome""")
    create_triggers()


def downgrade() -> None:
    drop_triggers()
    op.drop_index('ix_call_counts_key', table_name='call_counts')
    op.drop_table('call_counts')
    op.drop_index('ix_sample_counts_key', table_name='sample_counts')
    op.drop_table('sample_counts')
