"""server health

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29 16:06:26.016754
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('servers',
    sa.Column('url', sa.String(length=500), nullable=False),
    sa.Column('healthy', sa.Boolean(), nullable=False),
    sa.Column('checked_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('failures', sa.Integer(), nullable=False),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.PrimaryKeyConstraint('url', name=op.f('pk_servers'))
    )


def downgrade() -> None:
    op.drop_table('servers')
