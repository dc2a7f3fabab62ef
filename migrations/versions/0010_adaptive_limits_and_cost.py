"""adaptive in-flight limits (servers.limit*) and cost settings (jobs.gpus, gpu_hour_price)

``--inflight auto`` keeps each server's current limit, the reason of its last
change, the controller's state and a short history in the ``servers`` row
every dispatcher reads; jobs record whether they follow it, their floor, and
the GPUs and GPU-hour price the cost report uses.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-30 22:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0010'
down_revision: str | None = '0009'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql')


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('inflight_auto', sa.Boolean(), server_default='0',
                                   nullable=False))
        batch.add_column(sa.Column('min_inflight', sa.Integer(), server_default='4',
                                   nullable=False))
        batch.add_column(sa.Column('gpus', sa.Integer(), server_default='1', nullable=False))
        batch.add_column(sa.Column('gpu_hour_price', sa.Float(), nullable=True))
    with op.batch_alter_table('servers') as batch:
        batch.add_column(sa.Column('limit_target', sa.Integer(), nullable=True))
        batch.add_column(sa.Column('limit', sa.Integer(), nullable=True))
        batch.add_column(sa.Column('limit_reason', sa.Text(), nullable=True))
        batch.add_column(sa.Column('limit_at', sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column('limit_state', _JSON, nullable=True))
        batch.add_column(sa.Column('limit_history', _JSON, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('servers') as batch:
        for name in ('limit_history', 'limit_state', 'limit_at', 'limit_reason', 'limit',
                     'limit_target'):
            batch.drop_column(name)
    with op.batch_alter_table('jobs') as batch:
        for name in ('gpu_hour_price', 'gpus', 'min_inflight', 'inflight_auto'):
            batch.drop_column(name)
