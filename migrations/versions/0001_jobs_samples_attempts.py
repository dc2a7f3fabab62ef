"""jobs, samples, attempts

Revision ID: 0001
Revises:
Create Date: 2026-11-29 14:52:20.119896
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:

    op.create_table('jobs',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('model', sa.String(length=200), nullable=False),
    sa.Column('servers', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('sampling', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('extra_body', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False),
    sa.Column('max_tokens', sa.Integer(), nullable=False),
    sa.Column('total_timeout', sa.Float(), nullable=False),
    sa.Column('stall_timeout', sa.Float(), nullable=False),
    sa.Column('max_attempts', sa.Integer(), nullable=False),
    sa.Column('backoff_base', sa.Float(), nullable=False),
    sa.Column('backoff_cap', sa.Float(), nullable=False),
    sa.Column('inflight_limit', sa.Integer(), nullable=False),
    sa.Column('keep_truncated', sa.Boolean(), nullable=False),
    sa.Column('state', sa.Enum('active', 'paused', 'cancelled', name='jobstate', native_enum=False, length=16), nullable=False),
    sa.Column('dataset', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_jobs')),
    sa.UniqueConstraint('name', name=op.f('uq_jobs_name'))
    )
    op.create_table('samples',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('job_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('content_key', sa.String(length=64), nullable=False),
    sa.Column('dataset_index', sa.Integer(), nullable=False),
    sa.Column('prompt', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=True),
    sa.Column('state', sa.Enum('pending', 'queued', 'running', 'done', 'failed', 'skipped', name='samplestate', native_enum=False, length=16), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('next_attempt_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('lease_expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('claim', sa.String(length=32), nullable=True),
    sa.Column('worker', sa.String(length=200), nullable=True),
    sa.Column('server', sa.String(length=500), nullable=True),
    sa.Column('error_class', sa.String(length=32), nullable=True),
    sa.Column('error_message', sa.Text(), nullable=True),
    sa.Column('response_content', sa.Text(), nullable=True),
    sa.Column('reasoning_content', sa.Text(), nullable=True),
    sa.Column('finish_reason', sa.String(length=32), nullable=True),
    sa.Column('prompt_tokens', sa.Integer(), nullable=True),
    sa.Column('completion_tokens', sa.Integer(), nullable=True),
    sa.Column('prompt_token_ids', sa.LargeBinary(), nullable=True),
    sa.Column('completion_token_ids', sa.LargeBinary(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('queued_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_samples_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_samples')),
    sa.UniqueConstraint('job_id', 'content_key', name=op.f('uq_samples_job_id_content_key'))
    )
    op.create_index('ix_samples_dispatch', 'samples', ['job_id', 'state', 'next_attempt_at', 'id'], unique=False)
    op.create_index('ix_samples_job_finished', 'samples', ['job_id', 'finished_at'], unique=False)
    op.create_index('ix_samples_server_state', 'samples', ['server', 'state'], unique=False)
    op.create_index('ix_samples_state_lease', 'samples', ['state', 'lease_expires_at'], unique=False)
    op.create_table('attempts',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('sample_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('server', sa.String(length=500), nullable=False),
    sa.Column('worker', sa.String(length=200), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('ended_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('outcome', sa.String(length=32), nullable=True),
    sa.Column('error_message', sa.Text(), nullable=True),
    sa.Column('latency_s', sa.Float(), nullable=True),
    sa.Column('ttft_s', sa.Float(), nullable=True),
    sa.Column('completion_tokens', sa.Integer(), nullable=True),
    sa.ForeignKeyConstraint(['sample_id'], ['samples.id'], name=op.f('fk_attempts_sample_id_samples'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_attempts'))
    )
    op.create_index(op.f('ix_attempts_sample_id'), 'attempts', ['sample_id'], unique=False)



def downgrade() -> None:

    op.drop_index(op.f('ix_attempts_sample_id'), table_name='attempts')
    op.drop_table('attempts')
    op.drop_index('ix_samples_state_lease', table_name='samples')
    op.drop_index('ix_samples_server_state', table_name='samples')
    op.drop_index('ix_samples_job_finished', table_name='samples')
    op.drop_index('ix_samples_dispatch', table_name='samples')
    op.drop_table('samples')
    op.drop_table('jobs')

