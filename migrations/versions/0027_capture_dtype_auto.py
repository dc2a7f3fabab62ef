"""jobs.capture_dtype defaults to ``auto``: captured files keep the engine's own dtype

A bf16 engine's files were widened to float32 by default (twice the disk). New jobs
store ``auto``; jobs made before keep the dtype they hold. PostgreSQL's column default
changes in place; SQLite cannot change a default without copying ``jobs`` (and its
triggers), and every insert of a job states the value (the model's default), so its
old server default is left as it is.

Revision ID: 0027
Revises: 0026
Create Date: 2026-12-03 07:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = '0027'
down_revision: str | None = '0026'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE jobs ALTER COLUMN capture_dtype SET DEFAULT 'auto'")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("ALTER TABLE jobs ALTER COLUMN capture_dtype SET DEFAULT 'float32'")
