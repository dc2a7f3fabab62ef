"""Alembic environment: the URL comes from synthq's settings (or the caller).

Every upgrade runs in one transaction, SQLite's included (synthq.store.migrate): a kill
leaves the database at its old revision, never half-way through a migration.
"""

from __future__ import annotations

from alembic import context

from synthq.spec.config import get_settings
from synthq.store.migrate import migration_engine
from synthq.store.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    return config.attributes.get("url") or get_settings().database_url


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True,
                      render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    # synthq.store.migrate.upgrade passes its connection, already in its transaction
    # (Alembic then leaves the commit to it).
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = migration_engine(_url())
    with engine.connect() as conn:
        _run(conn)
    engine.dispose()


def _run(connection) -> None:  # type: ignore[no-untyped-def]
    sqlite = connection.dialect.name == "sqlite"
    # render_as_batch: SQLite cannot ALTER most things; batch mode copies the table.
    # transactional_ddl: the migration engine's SQLite transactions hold DDL, so the
    # whole run is one transaction there too (Alembic assumes SQLite's are not).
    context.configure(connection=connection, target_metadata=target_metadata,
                      render_as_batch=sqlite, compare_type=True, transactional_ddl=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
