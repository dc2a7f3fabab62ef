"""jobs.capture_stopped and jobs.capture_files (issue 30 items 1 and 2)

``capture_stopped``: a capture server that fails every call the same way (no synthq
connector, a connector writing other files) stops the stage after a few identical
failures (synthq.queue.streaks); the line naming the server and the cause is kept here
until ``synthq capture JOB --retry-failed`` clears it.

``capture_files``: capture server URL → its engine-files folder, the only place
files of vLLM's stock connector (named by request id) are taken from
(synthq.capture.confine).

Revision ID: 0030
Revises: 0027
Create Date: 2026-12-03 08:20:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0030'
down_revision: str | None = '0027'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_JSON = sa.JSON().with_variant(postgresql.JSONB(), 'postgresql')


def upgrade() -> None:
    op.add_column("jobs", sa.Column("capture_stopped", sa.Text(), nullable=True))
    op.add_column("jobs", sa.Column("capture_files", _JSON, server_default="{}",
                                    nullable=False))


def downgrade() -> None:
    # A plain DROP COLUMN (SQLite >= 3.35 has it): a batch rebuild renames the table,
    # which the counters' triggers on samples (migration 0016) refuse.
    op.drop_column("jobs", "capture_files")
    op.drop_column("jobs", "capture_stopped")
