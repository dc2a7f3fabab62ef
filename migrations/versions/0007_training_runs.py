"""training_runs: EAGLE-3 drafter training runs; jobs.train_when/train_target/train_settings

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0007'
down_revision: str | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql')


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('train_when', sa.String(length=32), nullable=False,
                                   server_default='ready'))
        batch.add_column(sa.Column('train_target', sa.String(length=1000), nullable=True))
        batch.add_column(sa.Column('train_settings', JSON, nullable=False,
                                   server_default=sa.text("'{}'")))
    op.create_table('training_runs',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('job_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('state', sa.Enum('pending', 'running', 'done', 'failed', 'cancelled',
                               name='runstate', native_enum=False, length=16,
                               create_constraint=False), nullable=False),
    sa.Column('trigger', sa.String(length=16), nullable=False),
    sa.Column('target', sa.String(length=1000), nullable=False),
    sa.Column('settings', JSON, nullable=False),
    sa.Column('metrics', JSON, nullable=False),
    sa.Column('output_dir', sa.String(length=1000), nullable=False),
    sa.Column('checkpoint', sa.String(length=1000), nullable=True),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('total_steps', sa.Integer(), nullable=True),
    sa.Column('resumed_from', sa.Integer(), nullable=False),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('claim', sa.String(length=32), nullable=True),
    sa.Column('worker', sa.String(length=200), nullable=True),
    sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'],
                            name=op.f('fk_training_runs_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_training_runs'))
    )
    op.create_index('ix_training_runs_job_id_state', 'training_runs', ['job_id', 'state'],
                    unique=False)


def downgrade() -> None:
    op.drop_index('ix_training_runs_job_id_state', table_name='training_runs')
    op.drop_table('training_runs')
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('train_settings')
        batch.drop_column('train_target')
        batch.drop_column('train_when')
