"""spool_items.server: a streamed run's capture calls count toward the server's capture limit

A streamed run (``--features stream``) calls the job's capture servers for the examples
of its spool; issue 43 asks that every capture call synthq makes to a server count
toward its one ``capture_limit``. A spool row's call in flight is now the row in state
``capturing`` (a new value of the text column: no constraint to change), held under a
claim and a lease (``claim``, ``worker``, ``expires_at``, already there) on ``server``,
which the capture claim's room counts beside the running captures
(synthq.queue.capture_states.running_on).

Revision ID: 0040
Revises: 0039
Create Date: 2026-12-06 09:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0040'
down_revision: str | None = '0039'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("spool_items", sa.Column("server", sa.String(500), nullable=True))
    op.create_index("ix_spool_items_server_state", "spool_items", ["server", "state"],
                    unique=False)


def downgrade() -> None:
    op.drop_index("ix_spool_items_server_state", table_name="spool_items")
    # A row caught in flight goes back to pending: its call is not on the server's count
    # any more, and the run captures it again.
    op.execute("UPDATE spool_items SET state = 'pending', claim = NULL, expires_at = NULL "
               "WHERE state = 'capturing'")
    op.drop_column("spool_items", "server")
