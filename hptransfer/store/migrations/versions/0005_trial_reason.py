"""trials.reason: why a study's planner added a trial

Revision ID: 0005_trial_reason
Revises: 0004_submissions
Create Date: 2026-12-06

A stage target that is not met adds trials (more seeds, or an LR near η*); each such trial
carries the reason it was added (the target, the number that missed it, what was added), so
the trial listing and the API say why it exists. NULL for every trial planned otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_trial_reason"
down_revision: str | None = "0004_submissions"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("trials") as batch:
        batch.add_column(sa.Column("reason", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("trials") as batch:
        batch.drop_column("reason")
