"""capture_calls: each call to a capture server, for the one "server is down" rule

Generation's dispatch decides that a server is down from its latest ``attempts``; a
capture stage kept its own count in memory, so two capture processes (or a capture
and the tick) could disagree. Each capture call is now a row, read by the same rule
(synthq.queue.outage).

A plain ``CREATE TABLE``: on SQLite no table is rebuilt.

Revision ID: 0036
Revises: 0035
Create Date: 2026-12-06 04:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0036'
down_revision: str | None = '0035'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ID = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    op.create_table(
        'capture_calls',
        sa.Column('id', _ID, nullable=False),
        sa.Column('capture_id', _ID, nullable=False),
        sa.Column('server', sa.String(500), nullable=False),
        sa.Column('ended_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('outcome', sa.String(32), nullable=False),
        sa.Column('error_message', sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(['capture_id'], ['captures.id'],
                                name='fk_capture_calls_capture_id_captures',
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name='pk_capture_calls'),
    )
    op.create_index('ix_capture_calls_server_id', 'capture_calls', ['server', 'id'],
                    unique=False)
    op.create_index('ix_capture_calls_capture_id', 'capture_calls', ['capture_id'],
                    unique=False)


def downgrade() -> None:
    op.drop_index('ix_capture_calls_capture_id', table_name='capture_calls')
    op.drop_index('ix_capture_calls_server_id', table_name='capture_calls')
    op.drop_table('capture_calls')
