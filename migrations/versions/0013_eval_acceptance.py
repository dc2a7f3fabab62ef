"""training_runs.eval_acceptance_length: the served acceptance length of a run

Measured by greedy draft-and-verify against the target on a held-out split
(synthq.training.speculate.acceptance_length), every --eval-every steps and at
the end; nullable (runs from before, and runs with --eval-fraction 0).

Revision ID: 0013
Revises: 0011
Create Date: 2026-11-30 23:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0013'
down_revision: str | None = '0011'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('training_runs') as batch:
        batch.add_column(sa.Column('eval_acceptance_length', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('training_runs') as batch:
        batch.drop_column('eval_acceptance_length')
