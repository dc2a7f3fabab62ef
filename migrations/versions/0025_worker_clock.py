"""workers.clock_skew: how far a worker's wall clock is off the database's

A worker whose clock ran 120 s behind looked dead at once and its samples were
paid for twice. Every time synthq writes is the database's now (synthq.core.clock);
each worker still reports its wall clock's distance from the database's at its
heartbeat, so that ``synthq status`` can name a machine whose clock is off.

A plain ``ADD COLUMN``: on SQLite the table is not rebuilt.

Revision ID: 0025
Revises: 0020
Create Date: 2026-12-01 23:55:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0025'
down_revision: str | None = '0020'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('workers', sa.Column('clock_skew', sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column('workers', 'clock_skew')
