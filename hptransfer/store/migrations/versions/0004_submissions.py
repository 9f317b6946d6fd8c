"""submissions: a submit's Idempotency-Key and the sweep it created

Revision ID: 0004_submissions
Revises: 0003_stages
Create Date: 2026-12-06

POST /sweeps with an `Idempotency-Key` header records the key with a hash of the body and
the sweep it created, so a client retrying (or a script firing the same submit many times at
once) gets that sweep back instead of a new one, across restarts and several servers.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_submissions"
down_revision: str | None = "0003_stages"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "submissions",
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("body_hash", sa.String(64), nullable=False),
        sa.Column("sweep_id", sa.String(32), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("key", name="pk_submissions"),
        sa.ForeignKeyConstraint(
            ["sweep_id"], ["sweeps.id"], name="fk_submissions_sweep_id_sweeps",
            ondelete="CASCADE"
        ),
    )
    # expired keys are deleted by age
    op.create_index("ix_submissions_created_at", "submissions", ["created_at"])


def downgrade() -> None:
    op.drop_table("submissions")
