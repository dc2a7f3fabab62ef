"""payload safety: repaired characters, the last failed server, max response bytes

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-30 14:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0008'
down_revision: str | None = '0007'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    json_type = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
    with op.batch_alter_table('samples') as batch:
        batch.add_column(sa.Column('repairs', json_type, nullable=True))
        batch.add_column(sa.Column('last_server', sa.String(length=500), nullable=True))
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('max_response_bytes', sa.Integer(),
                                   server_default=str(4 << 20), nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('max_response_bytes')
    with op.batch_alter_table('samples') as batch:
        batch.drop_column('last_server')
        batch.drop_column('repairs')
