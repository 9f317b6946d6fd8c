"""Response models and OpenAPI examples."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

EXAMPLE_SPEC: dict[str, Any] = {
    "name": "cpu-small",
    "arms": [
        {"arch": "gpt", "parameterization": "sp"},
        {"arch": "gpt", "parameterization": "completep"},
    ],
    "grid": {
        "widths": [64, 128],
        "depths": [2, 4],
        "lrs": {"log2_min": -10, "log2_max": -4, "step": 2},
        "seeds": [0],
    },
    "fixed": {"head_dim": 32, "seq_len": 64},
    "budget": {"steps": 60, "batch_size": 8},
    "data": {"source": "stdlib", "val_tokens": 8192},
    "max_concurrent": 2,
}


class ErrorItem(BaseModel):
    field: str
    message: str


class ErrorResponse(BaseModel):
    error: str
    errors: list[ErrorItem] = []


class SweepSummary(BaseModel):
    id: str
    name: str
    status: str
    search: str | None = None
    created_at: Any = None
    started_at: Any = None
    finished_at: Any = None
    counts: dict[str, int]
    total: int
    done: int
    progress: float
    eta_s: float | None = None
    waiting_for: str | None = None  # why pending trials cannot start now, if they cannot
    # a staged study: each stage in order with its state, done/total and counts
    stages: list[dict[str, Any]] | None = None
    study: dict[str, Any] | None = None  # its planner state (transferred HPs, stop reason)
    error: str | None = None  # e.g. why a study stopped
    mlflow_experiment_id: str | None = None
    mlflow_run_id: str | None = None

    model_config = {"extra": "allow"}


class TrialPage(BaseModel):
    total: int
    limit: int
    offset: int
    items: list[dict[str, Any]]


class ComponentHealth(BaseModel):
    name: str
    ok: bool
    detail: str
    fix: str | None = None


class Health(BaseModel):
    status: str  # ok | degraded (a component failed) | down (the app database)
    database: str
    ray: bool
    ray_address: str | None = None
    dispatcher_error: str | None = None
    mlflow_uri: str | None = None
    components: list[ComponentHealth] = []
