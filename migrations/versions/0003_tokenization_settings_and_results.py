"""tokenization settings and results

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29 15:08:37.318811
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Server defaults fill the rows of jobs created before this revision.
    op.add_column('jobs', sa.Column('tokenizer', sa.String(length=500), nullable=True))
    op.add_column('jobs', sa.Column('chat_template', sa.Text(), nullable=True))
    op.add_column('jobs', sa.Column('chat_template_kwargs', sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), 'postgresql'), nullable=False, server_default='{}'))
    op.add_column('jobs', sa.Column('max_seq_len', sa.Integer(), nullable=False, server_default='4096'))
    op.add_column('jobs', sa.Column('reasoning', sa.String(length=8), nullable=False, server_default='keep'))
    op.add_column('jobs', sa.Column('think_open', sa.String(length=64), nullable=False, server_default='<think>\n'))
    op.add_column('jobs', sa.Column('think_close', sa.String(length=64), nullable=False, server_default='\n</think>\n\n'))
    op.add_column('jobs', sa.Column('mask', sa.String(length=24), nullable=False, server_default='last_turn'))
    op.add_column('jobs', sa.Column('tokenize_version', sa.Integer(), nullable=False, server_default='1'))
    op.add_column('samples', sa.Column('input_ids', sa.LargeBinary(), nullable=True))
    op.add_column('samples', sa.Column('loss_mask', sa.LargeBinary(), nullable=True))
    op.add_column('samples', sa.Column('num_tokens', sa.Integer(), nullable=True))
    op.add_column('samples', sa.Column('num_supervised', sa.Integer(), nullable=True))
    op.add_column('samples', sa.Column('tokenize_version', sa.Integer(), nullable=True))
    op.add_column('samples', sa.Column('token_mismatch', sa.Boolean(), nullable=True))


def downgrade() -> None:
    op.drop_column('samples', 'token_mismatch')
    op.drop_column('samples', 'tokenize_version')
    op.drop_column('samples', 'num_supervised')
    op.drop_column('samples', 'num_tokens')
    op.drop_column('samples', 'loss_mask')
    op.drop_column('samples', 'input_ids')
    op.drop_column('jobs', 'tokenize_version')
    op.drop_column('jobs', 'mask')
    op.drop_column('jobs', 'think_close')
    op.drop_column('jobs', 'think_open')
    op.drop_column('jobs', 'reasoning')
    op.drop_column('jobs', 'max_seq_len')
    op.drop_column('jobs', 'chat_template_kwargs')
    op.drop_column('jobs', 'chat_template')
    op.drop_column('jobs', 'tokenizer')
