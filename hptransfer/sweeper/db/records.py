"""Frozen records the store hands out for the MLflow mirror (read-only snapshots of rows)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class AttemptRecord:
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


@dataclass(frozen=True)
class SweepMirrorRecord:
    """A sweep whose MLflow experiment or parent run is not up to date."""

    id: str
    name: str
    spec: dict[str, Any]
    status: str
    created_at: datetime
    finished_at: datetime | None
    experiment_id: str | None
    parent_run_id: str | None
    mlflow_synced_status: str | None
