"""Run the Alembic migrations from code (``synthq db upgrade``, embedded start)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

__all__ = ["alembic_config", "upgrade"]

#: The repository root: migrations/ and alembic.ini live beside the package.
ROOT = Path(__file__).resolve().parent.parent


def alembic_config(url: str) -> Config:
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
    command.upgrade(alembic_config(url), revision)
