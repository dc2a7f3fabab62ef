"""`alembic upgrade head` on an empty database equals the models, on both backends."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine

from synthq.migrate import upgrade
from synthq.models import Base

pytestmark = pytest.mark.integration


def _diff(url: str) -> list:
    engine = create_engine(url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}),
                                Base.metadata)
    engine.dispose()
    return diff


def test_postgres_head_matches_models(pg: str) -> None:
    assert _diff(pg) == []


def test_sqlite_head_matches_models(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}"
    upgrade(url)
    assert _diff(url) == []


def test_drift_is_detected(tmp_path: Path) -> None:
    """The comparison can fail: a column missing from the database shows up."""
    from sqlalchemy import text

    url = f"sqlite:///{tmp_path / 'y.db'}"
    upgrade(url)
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("ALTER TABLE attempts DROP COLUMN ttft_s"))
    engine.dispose()
    assert any("ttft_s" in str(d) for d in _diff(url))


def test_head_constant_is_the_scripts_head() -> None:
    """Commands compare the database with migrate.HEAD; it must be the newest script."""
    from alembic.script import ScriptDirectory

    from synthq.migrate import HEAD, alembic_config

    assert ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head() == HEAD
