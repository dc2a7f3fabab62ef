"""Regenerating every turn, tool conversations, per-sample settings (issue 14)

jobs.regenerate / history_reasoning; samples.tools, tool_calls, turn,
turn_count, turns, cut_at_turn, cut_reason, overrides; attempts.turn. Every
existing row keeps its behaviour: last-turn regeneration, no tools, the job's
own settings.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-30 22:50:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0011'
down_revision: str | None = '0010'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql')


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('regenerate', sa.String(length=8), server_default='last',
                                   nullable=False))
        batch.add_column(sa.Column('history_reasoning', sa.String(length=8),
                                   server_default='drop', nullable=False))
    with op.batch_alter_table('samples') as batch:
        batch.add_column(sa.Column('tools', _JSON, nullable=True))
        batch.add_column(sa.Column('tool_calls', _JSON, nullable=True))
        batch.add_column(sa.Column('turn', sa.Integer(), server_default='0', nullable=False))
        batch.add_column(sa.Column('turn_count', sa.Integer(), nullable=True))
        batch.add_column(sa.Column('turns', _JSON, nullable=True))
        batch.add_column(sa.Column('cut_at_turn', sa.Integer(), nullable=True))
        batch.add_column(sa.Column('cut_reason', sa.Text(), nullable=True))
        batch.add_column(sa.Column('overrides', _JSON, nullable=True))
    with op.batch_alter_table('attempts') as batch:
        batch.add_column(sa.Column('turn', sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('attempts') as batch:
        batch.drop_column('turn')
    with op.batch_alter_table('samples') as batch:
        for name in ('overrides', 'cut_reason', 'cut_at_turn', 'turns', 'turn_count', 'turn',
                     'tool_calls', 'tools'):
            batch.drop_column(name)
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('history_reasoning')
        batch.drop_column('regenerate')
