"""jobs.stream: a job may call its servers without streaming

``synthq enqueue/run --no-stream`` stores ``stream = false``: one plain
non-streamed call per sample (no stall clock, no partial progress), at about a
third of the CPU per sample of a streamed one on short answers. Existing jobs
keep streaming.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-30 23:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0015'
down_revision: str | None = '0014'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('stream', sa.Boolean(), server_default=sa.true(),
                                   nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('stream')
