"""attempts by server

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 15:04:26.563750
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index('ix_attempts_server_id', 'attempts', ['server', 'id'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_attempts_server_id', table_name='attempts')
