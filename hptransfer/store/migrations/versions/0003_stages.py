"""staged studies: trials.stage, sweeps.study

Revision ID: 0003_stages
Revises: 0001
Create Date: 2026-11-30

A study's trials carry the stage that planned them; the sweep row holds the study's state
(stages planned, transferred HPs, stop reason), written in the same transaction as a stage's
trials so a coordinator killed while planning either planned the stage fully or not at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_stages"
down_revision: str | None = "0002_mirror"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sweeps") as batch:
        batch.add_column(sa.Column("study", sa.JSON(none_as_null=True), nullable=True))
    with op.batch_alter_table("trials") as batch:
        batch.add_column(sa.Column("stage", sa.String(32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("trials") as batch:
        batch.drop_column("stage")
    with op.batch_alter_table("sweeps") as batch:
        batch.drop_column("study")
