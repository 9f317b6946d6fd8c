"""sweeps and trials

Revision ID: 0001
Revises:
Create Date: 2025-01-01

Written out by hand (not create_all) so this revision stays frozen as the models evolve.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "sweeps",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("spec", sa.JSON(none_as_null=True), nullable=False),
        sa.Column("spec_hash", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("search", sa.String(32), nullable=False),
        sa.Column("data_hash", sa.String(64), nullable=True),
        sa.Column("reuse", sa.Boolean(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("n_trials", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("mlflow_experiment_id", sa.String(64), nullable=True),
        sa.Column("mlflow_run_id", sa.String(64), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_sweeps"),
    )
    op.create_index("ix_sweeps_spec_hash", "sweeps", ["spec_hash"])
    op.create_index("ix_sweeps_status", "sweeps", ["status"])
    op.create_index("ix_sweeps_created_at", "sweeps", ["created_at"])

    op.create_table(
        "trials",
        sa.Column("id", sa.String(32), nullable=False),
        sa.Column("sweep_id", sa.String(32), nullable=False),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("arm", sa.String(100), nullable=False),
        sa.Column("width", sa.Integer(), nullable=False),
        sa.Column("depth", sa.Integer(), nullable=False),
        sa.Column("lr", sa.Double(), nullable=False),
        sa.Column("sigma_base", sa.Double(), nullable=False),
        sa.Column("seed", sa.Integer(), nullable=False),
        sa.Column("spec", sa.JSON(none_as_null=True), nullable=False),
        sa.Column("content_hash", sa.String(64), nullable=False),
        sa.Column("data_hash", sa.String(64), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("max_attempts", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("result", sa.JSON(none_as_null=True), nullable=True),
        sa.Column("final_val_loss", sa.Double(), nullable=True),
        sa.Column("flops", sa.Double(), nullable=True),
        sa.Column("tokens", sa.BigInteger(), nullable=True),
        sa.Column("params_non_embedding", sa.BigInteger(), nullable=True),
        sa.Column("params_embedding", sa.BigInteger(), nullable=True),
        sa.Column("wall_time_s", sa.Double(), nullable=True),
        sa.Column("worker_node", sa.String(200), nullable=True),
        sa.Column("lease_owner", sa.String(200), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("mlflow_run_id", sa.String(64), nullable=True),
        sa.Column("reused_from", sa.String(32), nullable=True),
        sa.Column("optuna_trial_number", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_trials"),
        sa.ForeignKeyConstraint(
            ["sweep_id"], ["sweeps.id"], name="fk_trials_sweep_id_sweeps", ondelete="CASCADE"
        ),
        sa.UniqueConstraint("sweep_id", "idx", name="uq_trials_sweep_id_idx"),
    )
    # (sweep_id, status): per-sweep listings and counts; status: leasing across sweeps and
    # orphan recovery; content_hash: finding a completed trial to reuse.
    op.create_index("ix_trials_sweep_id_status", "trials", ["sweep_id", "status"])
    op.create_index("ix_trials_status", "trials", ["status"])
    op.create_index("ix_trials_content_hash", "trials", ["content_hash"])


def downgrade() -> None:
    op.drop_table("trials")
    op.drop_table("sweeps")
