"""samples.lease_expires_at is samples.expires_at: it holds a queued sample's claim
deadline as well as a running sample's lease

The old name read as "the lease" only, and the sweep's two rules (a queued sample
whose message never came, a running one whose worker went silent) both read it.
``RENAME COLUMN`` on PostgreSQL and SQLite (3.25 and later): no table is rebuilt,
and the index on (state, expires_at) follows the column under its old name.

Revision ID: 0026
Revises: 0022
Create Date: 2026-12-02 04:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = '0026'
down_revision: str | None = '0022'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute("ALTER TABLE samples RENAME COLUMN lease_expires_at TO expires_at")


def downgrade() -> None:
    op.execute("ALTER TABLE samples RENAME COLUMN expires_at TO lease_expires_at")
