"""captures, jobs.capture_*: hidden states captured through the serving engine

One row per sample whose hidden states a capture server (vLLM with
``extract_hidden_states`` and synthq's connector) has been asked for: its
state, claim, lease and attempts like a generation's, and the checked file in
synthq's store. The job says where and what to capture.

Plain ``ADD COLUMN`` and ``CREATE TABLE``: on SQLite no table is rebuilt, so the
counters' triggers of 0016 stay.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-01 23:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0022'
down_revision: str | None = '0021'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(), 'postgresql')
_ID = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    op.add_column('jobs', sa.Column('capture_servers', _JSON, server_default='[]',
                                    nullable=False))
    op.add_column('jobs', sa.Column('capture_layers', _JSON, nullable=True))
    op.add_column('jobs', sa.Column('capture_dtype', sa.String(16), server_default='float32',
                                    nullable=False))
    op.add_column('jobs', sa.Column('capture_limit', sa.Integer(), server_default='8',
                                    nullable=False))
    op.create_table(
        'captures',
        sa.Column('id', _ID, nullable=False),
        sa.Column('sample_id', _ID, nullable=False),
        sa.Column('job_id', _ID, nullable=False),
        sa.Column('state', sa.Enum('pending', 'running', 'done', 'failed', name='capturestate',
                                   native_enum=False, length=16, create_constraint=False),
                  nullable=False),
        sa.Column('tokenize_version', sa.Integer(), nullable=True),
        sa.Column('attempts', sa.Integer(), nullable=False),
        sa.Column('next_attempt_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('lease_expires_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('claim', sa.String(32), nullable=True),
        sa.Column('worker', sa.String(200), nullable=True),
        sa.Column('server', sa.String(500), nullable=True),
        sa.Column('error_class', sa.String(32), nullable=True),
        sa.Column('error_message', sa.Text(), nullable=True),
        sa.Column('path', sa.String(200), nullable=True),
        sa.Column('sha256', sa.String(64), nullable=True),
        sa.Column('bytes', sa.BigInteger(), nullable=True),
        sa.Column('num_tokens', sa.Integer(), nullable=True),
        sa.Column('layer_ids', _JSON, nullable=True),
        sa.Column('dtype', sa.String(16), nullable=True),
        sa.Column('engine', sa.String(64), nullable=True),
        sa.Column('engine_model', sa.String(500), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name='fk_captures_job_id_jobs',
                                ondelete='CASCADE'),
        sa.ForeignKeyConstraint(['sample_id'], ['samples.id'],
                                name='fk_captures_sample_id_samples', ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name='pk_captures'),
        sa.UniqueConstraint('sample_id', name='uq_captures_sample_id'),
    )
    op.create_index('ix_captures_due', 'captures',
                    ['job_id', 'state', 'next_attempt_at', 'id'], unique=False)
    op.create_index('ix_captures_server_state', 'captures', ['server', 'state'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_captures_server_state', table_name='captures')
    op.drop_index('ix_captures_due', table_name='captures')
    op.drop_table('captures')
    for column in ('capture_limit', 'capture_dtype', 'capture_layers', 'capture_servers'):
        op.drop_column('jobs', column)
