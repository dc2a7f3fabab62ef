"""spool_items, training_runs.spool_*: streamed features with a bounded spool

``synthq train JOB --features stream --spool SIZE`` (issue 43 items 1 and 2): one row per
example per epoch of a streamed run (its features captured into the run's spool, trained
on, committed by a checkpoint: the ledger's record of what each run consumed in each
epoch), and on the run the spool's bound, bytes, files, high-water mark and lead.

Revision ID: 0039
Revises: 0038
Create Date: 2026-12-06 07:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0039'
down_revision: str | None = '0038'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ID = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')
_RUN = (("spool_size", sa.BigInteger()), ("spool_bytes", sa.BigInteger()),
        ("spool_files", sa.Integer()), ("spool_high_water", sa.BigInteger()),
        ("spool_lead", sa.Integer()))


def upgrade() -> None:
    for name, type_ in _RUN:
        op.add_column("training_runs", sa.Column(name, type_, nullable=True))
    op.create_table(
        'spool_items',
        sa.Column('id', _ID, nullable=False),
        sa.Column('run_id', _ID, nullable=False),
        sa.Column('epoch', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('example', sa.String(64), nullable=False),
        sa.Column('state', sa.Enum('pending', 'spooled', 'training', 'consumed', 'failed',
                                   name='spoolstate', native_enum=False, length=16,
                                   create_constraint=False), nullable=False),
        sa.Column('claim', sa.String(32), nullable=True),
        sa.Column('worker', sa.String(200), nullable=True),
        sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('path', sa.String(200), nullable=True),
        sa.Column('bytes', sa.BigInteger(), nullable=True),
        sa.Column('step', sa.Integer(), nullable=True),
        sa.Column('captures', sa.Integer(), nullable=False),
        sa.Column('error_class', sa.String(32), nullable=True),
        sa.Column('error_message', sa.Text(), nullable=True),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(['run_id'], ['training_runs.id'],
                                name='fk_spool_items_run_id_training_runs', ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id', name='pk_spool_items'),
        sa.UniqueConstraint('run_id', 'epoch', 'example',
                            name='uq_spool_items_run_id_epoch_example'),
    )
    op.create_index('ix_spool_items_run_rank_state', 'spool_items',
                    ['run_id', 'rank', 'state'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_spool_items_run_rank_state', table_name='spool_items')
    op.drop_table('spool_items')
    for name, _ in reversed(_RUN):
        op.drop_column("training_runs", name)
