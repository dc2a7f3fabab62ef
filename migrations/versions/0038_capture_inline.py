"""jobs.capture_mode and samples.inline_capture: one pass that generates and captures

``synthq run|enqueue ... --capture inline`` (issue 43 item 3): the job's generation
server is its capture server, and the final answer's call asks the engine (synthq's
connector, ``include_output_tokens``) for the hidden states of its prompt and output.
``jobs.capture_mode`` is ``stage`` (the capture stage's own calls, as before) or
``inline``; ``samples.inline_capture`` is the file name the final call asked the
engine to write (None: no inline file; the capture stage calls the engine).

Two plain ``ADD COLUMN``s: on SQLite no table is rebuilt.

Revision ID: 0038
Revises: 0037
Create Date: 2026-12-06 06:45:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0038'
down_revision: str | None = '0037'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("capture_mode", sa.String(8), nullable=False,
                                    server_default="stage"))
    op.add_column("samples", sa.Column("inline_capture", sa.String(300), nullable=True))


def downgrade() -> None:
    op.drop_column("samples", "inline_capture")
    op.drop_column("jobs", "capture_mode")
