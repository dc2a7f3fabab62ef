"""jobs.pause_reason: why a job was paused, when synthq paused it itself

A job paused by synthq (a server answering 404 for ``/chat/completions`` from a
URL without ``/v1``) showed only "paused" in ``status`` and on the job page; the
reason was in a worker's log. It is kept on the job now, and cleared when the
job is resumed. A pause asked for by a user has no reason.

A plain ``ADD COLUMN``: on SQLite the table is not rebuilt, so the counters'
triggers of 0016 stay.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-01 02:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0017'
down_revision: str | None = '0016'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('jobs', sa.Column('pause_reason', sa.Text(), nullable=True))


def downgrade() -> None:
    # SQLite 3.35+ drops a column in place (no table copy, the triggers stay).
    op.drop_column('jobs', 'pause_reason')
