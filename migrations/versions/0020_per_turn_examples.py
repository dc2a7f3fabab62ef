"""jobs.examples, samples.examples: one training example per regenerated turn

``--examples per-turn`` (jobs with ``--regenerate all``) makes one example per
regenerated turn: the history as it was sent for that turn plus that turn's
answer. The sample still holds one result; with several examples their ids and
masks are concatenated and ``samples.examples`` lists them (turn, tokens,
supervised). Existing jobs keep one example per conversation.

Plain ``ADD COLUMN``: on SQLite no table is rebuilt, so the counters' triggers
of 0016 stay.

Revision ID: 0020
Revises: 0018
Create Date: 2026-12-01 23:50:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0020'
down_revision: str | None = '0018'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('jobs', sa.Column('examples', sa.String(length=16),
                                    server_default='conversation', nullable=False))
    op.add_column('samples', sa.Column(
        'examples', sa.JSON().with_variant(postgresql.JSONB(), 'postgresql'), nullable=True))


def downgrade() -> None:
    op.drop_column('samples', 'examples')
    op.drop_column('jobs', 'examples')
