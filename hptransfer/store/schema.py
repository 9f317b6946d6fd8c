"""The app database's schema: SQLAlchemy 2 ORM tables (sweeps, trials), their column types and
the status vocabulary. Alembic's env.py reads `Base.metadata`; the hand-written revisions in
migrations/versions must describe the same tables (a test compares them)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from hptransfer.contracts.status import ACTIVE, SweepStatus, TrialStatus

# The vocabulary as SQL values (hptransfer.contracts.status defines it).
SWEEP_STATUSES: tuple[str, ...] = tuple(SweepStatus)
TRIAL_STATUSES: tuple[str, ...] = tuple(TrialStatus)
ACTIVE_STATUSES: tuple[str, ...] = tuple(sorted(ACTIVE))  # of a trial or a sweep
# Sweeps stopped for good: no trial is added, leased or refreshed back to running.
STOPPED_SWEEP_STATUSES: tuple[str, ...] = tuple(s for s in SweepStatus if s.is_stopped())

# Result fields copied into their own trial columns (typed, filterable, cheap to read).
RESULT_FLOATS: tuple[str, ...] = ("final_val_loss", "flops", "wall_time_s")
RESULT_INTS: tuple[str, ...] = ("tokens", "params_non_embedding", "params_embedding")
RESULT_COLUMNS: tuple[str, ...] = (*RESULT_FLOATS, *RESULT_INTS)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite stores them naive)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        value = value.astimezone(UTC)
        # SQLite's DateTime drops the offset silently; make the UTC convention explicit.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def _json() -> JSON:
    # none_as_null: Python None is SQL NULL (not the JSON text 'null'), so IS NULL works.
    return JSON(none_as_null=True)


# Deterministic constraint/index names, so the migration and the models agree on them.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_N_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Sweep(Base):
    __tablename__ = "sweeps"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    spec: Mapped[dict[str, Any]] = mapped_column(_json())
    spec_hash: Mapped[str] = mapped_column(String(64), index=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    search: Mapped[str] = mapped_column(String(32))  # search method: grid, optuna, ...
    data_hash: Mapped[str | None] = mapped_column(String(64))
    reuse: Mapped[bool] = mapped_column(Boolean)
    max_attempts: Mapped[int] = mapped_column(Integer)
    n_trials: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    mlflow_experiment_id: Mapped[str | None] = mapped_column(String(64))
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64))  # the parent run
    error: Mapped[str | None] = mapped_column(Text)
    # A staged study's state (stages planned so far, transferred HPs); None for a plain sweep.
    study: Mapped[dict[str, Any] | None] = mapped_column(_json())
    # spec-derived numbers stored at submit, so a summary never re-validates the spec
    max_concurrent: Mapped[int | None] = mapped_column(Integer)
    planned_total: Mapped[int | None] = mapped_column(Integer)  # trials the sweep will have
    # the sweep status last copied to MLflow (the mirror's marker; NULL: never)
    mlflow_synced_status: Mapped[str | None] = mapped_column(String(16))


class Trial(Base):
    __tablename__ = "trials"
    __table_args__ = (
        UniqueConstraint("sweep_id", "idx"),
        Index("ix_trials_sweep_id_status", "sweep_id", "status"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    sweep_id: Mapped[str] = mapped_column(ForeignKey("sweeps.id", ondelete="CASCADE"))
    idx: Mapped[int] = mapped_column(Integer)  # order within the sweep
    arm: Mapped[str] = mapped_column(String(100))
    width: Mapped[int] = mapped_column(Integer)
    depth: Mapped[int] = mapped_column(Integer)
    lr: Mapped[float] = mapped_column(Double)
    sigma_base: Mapped[float] = mapped_column(Double)
    seed: Mapped[int] = mapped_column(Integer)
    spec: Mapped[dict[str, Any]] = mapped_column(_json())  # TrialSpec.model_dump(mode="json")
    content_hash: Mapped[str] = mapped_column(String(64), index=True)
    data_hash: Mapped[str | None] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), index=True)
    attempts: Mapped[int] = mapped_column(Integer)
    max_attempts: Mapped[int] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    result: Mapped[dict[str, Any] | None] = mapped_column(_json())  # TrialResult dump
    final_val_loss: Mapped[float | None] = mapped_column(Double)
    flops: Mapped[float | None] = mapped_column(Double)
    tokens: Mapped[int | None] = mapped_column(BigInteger)
    params_non_embedding: Mapped[int | None] = mapped_column(BigInteger)
    params_embedding: Mapped[int | None] = mapped_column(BigInteger)
    wall_time_s: Mapped[float | None] = mapped_column(Double)
    worker_node: Mapped[str | None] = mapped_column(String(200))
    lease_owner: Mapped[str | None] = mapped_column(String(200))  # coordinator id
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64))
    reused_from: Mapped[str | None] = mapped_column(String(32))  # id of the trial that ran
    optuna_trial_number: Mapped[int | None] = mapped_column(Integer)
    stage: Mapped[str | None] = mapped_column(String(32))  # study stage; None outside a study
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    # why a study's planner added this trial to meet a stage target; None otherwise
    reason: Mapped[str | None] = mapped_column(Text)


class Attempt(Base):
    """One lease of a trial: what its MLflow run mirrors. `seq` counts every lease (also one
    a dead coordinator left behind), so each attempt has its own deterministic run key."""

    __tablename__ = "attempts"
    __table_args__ = (Index("ix_attempts_synced", "status", "mlflow_synced_status"),)

    trial_id: Mapped[str] = mapped_column(
        ForeignKey("trials.id", ondelete="CASCADE"), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)  # 1, 2, ... per trial
    status: Mapped[str] = mapped_column(String(16))  # running, then the attempt's outcome
    error: Mapped[str | None] = mapped_column(Text)
    has_result: Mapped[bool] = mapped_column(Boolean)  # the trial's result is this attempt's
    started_at: Mapped[datetime] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64))
    # the attempt status last copied to MLflow (the mirror's marker; NULL: never)
    mlflow_synced_status: Mapped[str | None] = mapped_column(String(16))


class Submission(Base):
    """A submit's `Idempotency-Key` and the sweep it created: a retry of the same request
    (same key, same body) gets that sweep back instead of a second one, across restarts and
    servers sharing the database."""

    __tablename__ = "submissions"

    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    body_hash: Mapped[str] = mapped_column(String(64))  # sha256 of the request body
    sweep_id: Mapped[str] = mapped_column(ForeignKey("sweeps.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
