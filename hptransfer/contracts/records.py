"""Frozen records the store hands out: read-only snapshots of rows (as Optuna's `FrozenTrial`),
never live ORM objects, read by attribute. `to_dict` is their one JSON-ready serialisation
(the API's sweep and trial bodies); the JSON columns (spec, result, study) stay plain dicts."""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any


class Record:
    """Base of the store's records: a shallow `to_dict` in field order."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class SweepRecord(Record):
    """One sweep row; the fields are the `sweeps` columns in table order (a test compares
    them), plus `counts` (trials per status) where the read counted them."""

    id: str
    name: str
    spec: dict[str, Any]
    spec_hash: str
    status: str
    search: str
    data_hash: str | None
    reuse: bool
    max_attempts: int
    n_trials: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    mlflow_experiment_id: str | None
    mlflow_run_id: str | None
    error: str | None
    study: dict[str, Any] | None
    max_concurrent: int | None
    planned_total: int | None
    mlflow_synced_status: str | None
    counts: dict[str, int] | None = None  # None: not counted by this read (active_sweeps)


@dataclass(frozen=True, slots=True)
class TrialRecord(Record):
    """One trial row; the fields are the `trials` columns in table order (a test compares
    them). `to_dict` adds `reused`."""

    id: str
    sweep_id: str
    idx: int
    arm: str
    width: int
    depth: int
    lr: float
    sigma_base: float
    seed: int
    spec: dict[str, Any]
    content_hash: str
    data_hash: str | None
    status: str
    attempts: int
    max_attempts: int
    error: str | None
    result: dict[str, Any] | None
    final_val_loss: float | None
    flops: float | None
    tokens: int | None
    params_non_embedding: int | None
    params_embedding: int | None
    wall_time_s: float | None
    worker_node: str | None
    lease_owner: str | None
    lease_expires_at: datetime | None
    mlflow_run_id: str | None
    reused_from: str | None
    optuna_trial_number: int | None
    stage: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    reason: str | None  # why a stage target added it (None: planned otherwise)

    @property
    def reused(self) -> bool:
        """Copied from an identical earlier trial instead of run."""
        return self.reused_from is not None

    def to_dict(self) -> dict[str, Any]:
        return {**Record.to_dict(self), "reused": self.reused}


@dataclass(frozen=True, slots=True)
class AttemptRecord(Record):
    """One lease of a trial, with what its MLflow run needs from the trial and the sweep."""

    trial_id: str
    seq: int
    status: str
    error: str | None
    started_at: datetime
    finished_at: datetime | None
    mlflow_run_id: str | None
    mlflow_synced_status: str | None
    sweep_id: str
    experiment_id: str | None
    parent_run_id: str | None
    arm: str
    spec: dict[str, Any]
    result: dict[str, Any] | None  # the trial's result when this attempt produced it
    reused_from: str | None = None  # the donor trial of a result reused, not trained


# The columns of a trial body (`TrialRecord.to_dict`), and those that hold numbers: a client's
# DataFrame keeps them when no row has a value (or no row matched)
TRIAL_COLUMNS: tuple[str, ...] = (*(f.name for f in fields(TrialRecord)), "reused")
TRIAL_NUMERIC_COLUMNS: tuple[str, ...] = tuple(
    f.name for f in fields(TrialRecord)
    if str(f.type).split(" ")[0] in ("int", "float"))
