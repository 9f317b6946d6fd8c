"""attempts and the MLflow mirror's markers; spec-derived sweep numbers

Revision ID: 0002_mirror
Revises: 0001
Create Date: 2026-12-01

MLflow became a mirror of this database: every lease of a trial is an `attempts` row that
the mirror copies to its own MLflow run, marking what it copied in `mlflow_synced_status`.
Sweeps keep `max_concurrent` and `planned_total` so summaries need not re-validate specs.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002_mirror"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("sweeps") as batch:
        batch.add_column(sa.Column("max_concurrent", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("planned_total", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("mlflow_synced_status", sa.String(16), nullable=True))
    # Sweeps tracked before the mirror existed count as mirrored (their runs were written by
    # the old tracker); their numbers are read from the stored JSON, without validation.
    sweeps = sa.table("sweeps", sa.column("id", sa.String), sa.column("spec", sa.JSON),
                      sa.column("status", sa.String), sa.column("n_trials", sa.Integer),
                      sa.column("search", sa.String),
                      sa.column("max_concurrent", sa.Integer),
                      sa.column("planned_total", sa.Integer),
                      sa.column("mlflow_synced_status", sa.String))
    conn = op.get_bind()
    for sid, spec, status, n_trials, search in conn.execute(
            sa.select(sweeps.c.id, sweeps.c.spec, sweeps.c.status, sweeps.c.n_trials,
                      sweeps.c.search)).all():
        value = (spec or {}).get("max_concurrent") if isinstance(spec, dict) else None
        conn.execute(sweeps.update().where(sweeps.c.id == sid).values(
            max_concurrent=value if isinstance(value, int) else None,
            planned_total=n_trials if search != "optuna" else None,
            mlflow_synced_status=status))
    op.create_table(
        "attempts",
        sa.Column("trial_id", sa.String(32), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("has_result", sa.Boolean(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("mlflow_run_id", sa.String(64), nullable=True),
        sa.Column("mlflow_synced_status", sa.String(16), nullable=True),
        sa.PrimaryKeyConstraint("trial_id", "seq", name="pk_attempts"),
        sa.ForeignKeyConstraint(
            ["trial_id"], ["trials.id"], name="fk_attempts_trial_id_trials", ondelete="CASCADE"
        ),
    )
    # the mirror's scan: attempts whose status differs from the one it last copied
    op.create_index("ix_attempts_synced", "attempts", ["status", "mlflow_synced_status"])


def downgrade() -> None:
    op.drop_table("attempts")
    with op.batch_alter_table("sweeps") as batch:
        batch.drop_column("mlflow_synced_status")
        batch.drop_column("planned_total")
        batch.drop_column("max_concurrent")
