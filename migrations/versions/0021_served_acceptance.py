"""training_runs.served_acceptance_length / served_engine / served_engine_version

The acceptance length a real engine measured while serving the run's drafter
(``synthq serve-check``: vLLM's own spec-decode counters on the run's held-out
prompts), beside ``eval_acceptance_length`` (synthq's draft-and-verify). Plain
``ADD COLUMN``: on SQLite no table is rebuilt.

Revision ID: 0021
Revises: 0025
Create Date: 2026-12-02 00:20:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0021'
down_revision: str | None = '0025'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column('training_runs', sa.Column('served_acceptance_length', sa.Float(),
                                             nullable=True))
    op.add_column('training_runs', sa.Column('served_engine', sa.String(length=64),
                                             nullable=True))
    op.add_column('training_runs', sa.Column('served_engine_version', sa.String(length=64),
                                             nullable=True))


def downgrade() -> None:
    op.drop_column('training_runs', 'served_engine_version')
    op.drop_column('training_runs', 'served_engine')
    op.drop_column('training_runs', 'served_acceptance_length')
