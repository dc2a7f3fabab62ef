"""captures.lease_expires_at is captures.expires_at, as on samples (0026)

Captures are a kind of leased work like samples (synthq.queue.ledger): one name for the
column that holds a claim's lease, read by one expiry. ``RENAME COLUMN`` on
PostgreSQL and SQLite (3.25 and later): no table is rebuilt.

Revision ID: 0035
Revises: 0030
Create Date: 2026-12-03 07:50:00
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = '0035'
down_revision: str | None = '0030'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute("ALTER TABLE captures RENAME COLUMN lease_expires_at TO expires_at")


def downgrade() -> None:
    op.execute("ALTER TABLE captures RENAME COLUMN expires_at TO lease_expires_at")
