"""jobs.key_settings and jobs.moves: a job moved to another model or server

``synthq requeue JOB --model NAME --server URL`` moves a job's remaining work;
each move is recorded in ``moves``, and ``key_settings`` keeps the generation
settings the samples' content keys were made under (so the same dataset
enqueued again still adds nothing). Job state ``finished`` needs no change:
states are stored as text.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-30 14:10:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0009'
down_revision: str | None = '0008'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql')


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('key_settings', _JSON, nullable=True))
        batch.add_column(sa.Column('moves', _JSON, server_default='[]', nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('moves')
        batch.drop_column('key_settings')
