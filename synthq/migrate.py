"""Run the Alembic migrations from code (``synthq db upgrade``, embedded start)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from alembic.config import Config

__all__ = ["HEAD", "alembic_config", "upgrade", "current_revision"]

#: The newest migration. Commands compare the database with this instead of
#: loading Alembic and every migration script at start (a test checks that it
#: is the scripts' head).
HEAD = "0035"

#: The repository root: migrations/ and alembic.ini live beside the package.
ROOT = Path(__file__).resolve().parent.parent


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


def upgrade(url: str, revision: str = "head") -> None:
    """Bring the database at ``url`` to ``revision``."""
    from alembic import command

    command.upgrade(alembic_config(url), revision)


def current_revision(conn: Any) -> str | None:
    """The database's Alembic revision (None when it was never migrated)."""
    from sqlalchemy import inspect, text

    if not inspect(conn).has_table("alembic_version"):
        return None
    return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
