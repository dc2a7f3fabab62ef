"""Run the Alembic migrations from code (``synthq db upgrade``, embedded start).

A migration killed half-way must leave the database as it was, so that a rerun
completes (issue 41: a ``synthq run`` killed during its first migration left
``table workers already exists`` for every rerun). So:

* every upgrade runs in **one transaction**. PostgreSQL's DDL is transactional.
  SQLite's is too, but pysqlite runs each DDL statement outside any transaction,
  where it commits on its own: the migration engine turns the driver's
  transaction handling off and issues ``BEGIN IMMEDIATE`` itself (SQLAlchemy's
  "serializable isolation / savepoints / transactional DDL" recipe for pysqlite);
* a **new SQLite database** is built at the head in one step: the models'
  tables, the counters' triggers (the one object the models do not describe)
  and the Alembic stamp, in that one transaction. Migrating it through every
  revision took 1-4 s; a test checks that both ways give the same schema.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from alembic.config import Config
    from sqlalchemy import Connection, Engine

__all__ = ["HEAD", "alembic_config", "upgrade", "current_revision", "migration_engine",
           "build_at_head"]

#: The newest migration. Commands compare the database with this instead of
#: loading Alembic and every migration script at start (a test checks that it
#: is the scripts' head).
HEAD = "0040"

#: The repository root: migrations/ and alembic.ini live beside the package.
ROOT = Path(__file__).resolve().parents[2]

#: Revisions whose ``create_triggers()`` makes objects the models do not hold: a
#: database built from the models runs them too (the schema test compares triggers).
TRIGGER_REVISIONS = ("0016",)


def alembic_config(url: str) -> Config:
    from alembic.config import Config

    ini = ROOT / "alembic.ini"
    if not ini.exists():
        raise RuntimeError(
            f"migrations not found beside the package ({ini}); install synthq from its "
            "repository with `pip install -e .`"
        )
    cfg = Config(str(ini))
    cfg.attributes["url"] = url
    return cfg


def migration_engine(url: str) -> Engine:
    """An engine whose transactions hold DDL, on SQLite too (see the module's docstring).

    SQLite: ``BEGIN IMMEDIATE`` takes the write lock at once, so a second process
    migrating the same file waits for the first and then finds it done; foreign keys
    stay off, as SQLite requires for the table copies of Alembic's batch mode (with
    them on, dropping the old ``jobs`` would delete or refuse its samples)."""
    from sqlalchemy import create_engine, event
    from sqlalchemy.pool import NullPool

    if not url.startswith("sqlite"):
        return create_engine(url, poolclass=NullPool)
    engine = create_engine(url, poolclass=NullPool, connect_args={"timeout": 60})

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn, _record):  # type: ignore[no-untyped-def]
        dbapi_conn.isolation_level = None  # pysqlite issues no BEGIN or COMMIT of its own
        dbapi_conn.execute("PRAGMA foreign_keys=OFF")
        dbapi_conn.execute("PRAGMA busy_timeout=60000")

    @event.listens_for(engine, "begin")
    def _begin(conn):  # type: ignore[no-untyped-def]
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def upgrade(url: str, revision: str = "head", *, from_models: bool = True) -> None:
    """Bring the database at ``url`` to ``revision``, in one transaction: a kill at any
    moment leaves it at its old revision or at ``revision``, never between.

    A new SQLite database asked for the head is built from the models
    (:func:`build_at_head`); ``from_models=False`` runs every migration instead (the
    check that the two agree). PostgreSQL always runs the migrations."""
    from alembic import command

    engine = migration_engine(url)
    try:
        with engine.connect() as conn, conn.begin():
            # Read inside the transaction: a process that waited for another's lock
            # sees what that one committed.
            if (from_models and revision == "head" and conn.dialect.name == "sqlite"
                    and _empty(conn)):
                build_at_head(conn)
                return
            cfg = alembic_config(url)
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, revision)
    finally:
        engine.dispose()


def _empty(conn: Connection) -> bool:
    """Whether the database holds no table at all (a new file)."""
    from sqlalchemy import inspect

    return not inspect(conn).get_table_names()


def build_at_head(conn: Connection) -> None:
    """Create the schema of the head on ``conn`` (an empty database, in its transaction):
    the models' tables and indexes, the triggers of :data:`TRIGGER_REVISIONS`, and the
    Alembic stamp."""
    from alembic.migration import MigrationContext
    from alembic.operations import Operations
    from alembic.script import ScriptDirectory

    from synthq.store.models import Base

    Base.metadata.create_all(conn)
    url = conn.engine.url.render_as_string(hide_password=False)
    script = ScriptDirectory.from_config(alembic_config(url))
    context = MigrationContext.configure(conn)
    with Operations.context(context):
        for revision in TRIGGER_REVISIONS:
            module = script.get_revision(revision).module  # type: ignore[union-attr]
            module.create_triggers()
    context.stamp(script, "head")


def current_revision(conn: Any) -> str | None:
    """The database's Alembic revision (None when it was never migrated)."""
    from sqlalchemy import inspect, text

    if not inspect(conn).has_table("alembic_version"):
        return None
    return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
