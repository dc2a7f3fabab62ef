"""jobs.busy_until / busy_folded, attempts.ended_at index: the cost report at 10^6 calls

The cost report's busy time (the union of a job's call intervals per server)
read every attempt of the job on every ``status``: seconds at 10^6 calls. Now
a status folds the calls that ended before ``busy_until`` into
``busy_folded`` ({server: seconds}) once a minute, and adds only the calls
that ended since, found through an index on ``attempts.ended_at`` (which the
last minute's token rate uses too). A job starts with no fold: its first
status folds everything once.

Plain ``ADD COLUMN`` and ``CREATE INDEX``: on SQLite no table is rebuilt, so the
counters' triggers of 0016 stay.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-01 02:50:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0018'
down_revision: str | None = '0017'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('jobs', sa.Column('busy_until', sa.DateTime(timezone=True), nullable=True))
    op.add_column('jobs', sa.Column(
        'busy_folded', sa.JSON().with_variant(postgresql.JSONB(), 'postgresql'), nullable=True))
    op.create_index('ix_attempts_ended_at', 'attempts', ['ended_at'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_attempts_ended_at', table_name='attempts')
    op.drop_column('jobs', 'busy_folded')
    op.drop_column('jobs', 'busy_until')
