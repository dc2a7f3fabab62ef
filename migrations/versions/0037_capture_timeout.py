"""jobs.capture_timeout: a job's own seconds per capture call (issue 42 item 3's example)

A job whose longest example takes the engine longer than the service's
``SYNTHQ_CAPTURE_TIMEOUT`` to prefill sets its own with ``synthq capture JOB
--timeout S`` (or the API's capture settings); NULL keeps the service's.

Revision ID: 0037
Revises: 0036
Create Date: 2026-12-06 03:45:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0037'
down_revision: str | None = '0036'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("capture_timeout", sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "capture_timeout")
