"""samples.source_id (the dataset row's own id); jobs.key_version (the prompt rule)

Existing jobs are key version 1: their prompts stop before the last assistant
turn. Jobs created from now on are version 2 (the prompt ends with the last
user turn); synthq.jobs.enqueue sets it.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 10:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('key_version', sa.Integer(), server_default='1',
                                   nullable=False))
    with op.batch_alter_table('samples') as batch:
        batch.add_column(sa.Column('source_id', sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('samples') as batch:
        batch.drop_column('source_id')
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('key_version')
