"""Response models and OpenAPI examples: what /openapi.json promises each answer holds.

The models describe the bodies the routes build; where a route returns its own response
(health, the cached listings, fits) they document it without re-serialising it. Fields are
declared in the order the bodies carry them: a model that serialises a body (the sweep
summaries, the trial pages) then gives back the same bytes."""

from __future__ import annotations

import dataclasses
from typing import Any, get_args, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model

from hptransfer.contracts.records import TrialRecord
from hptransfer.contracts.status import HealthState, StageState, SweepStatus, TrialStatus

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
    model_config = ConfigDict(extra="allow")

    field: str = Field(description="the field at fault, dotted ('grid.widths.0'); '' for "
                                   "the whole request")
    message: str


class ErrorResponse(BaseModel):
    """Every error's body (guards.error_response)."""

    error: str = Field(description="what is wrong and how to fix it, in one line")
    errors: list[ErrorItem] = Field(default=[], description="per field, where fields are named")


class StageProgress(BaseModel):
    """One stage of a staged study (coordinator.study.study_progress)."""

    model_config = ConfigDict(extra="allow")

    stage: str
    planned: bool
    counts: dict[str, int]
    done: int
    total: int
    progress: float
    state: StageState


class SweepSummary(BaseModel):
    """A sweep's row (without its spec) with its progress."""

    model_config = ConfigDict(extra="allow")

    id: str
    name: str
    status: SweepStatus
    search: str | None = None
    created_at: Any = None
    started_at: Any = None
    finished_at: Any = None
    counts: dict[str, int] = Field(description="trials per status")
    total: int
    done: int
    progress: float
    eta_s: float | None = None
    waiting_for: str | None = Field(default=None, description="why pending trials cannot "
                                                              "start now, if they cannot")
    stages: list[StageProgress] | None = Field(default=None, description="a staged study: "
                                               "each stage in order with its state")
    study: dict[str, Any] | None = Field(default=None, description="a study's planner state "
                                         "(transferred HPs, stop reason)")
    error: str | None = Field(default=None, description="e.g. why a study stopped")
    mlflow_experiment_id: str | None = None
    mlflow_run_id: str | None = None
    # the rest of the sweep's row, in the order the body has carried them
    spec_hash: str | None = None
    data_hash: str | None = None
    reuse: bool | None = None
    max_attempts: int | None = None
    n_trials: int | None = None
    max_concurrent: int | None = None
    planned_total: int | None = None
    mlflow_synced_status: str | None = None


class PlanRow(BaseModel):
    """One stage's price (or the total's): every figure at the most it can reach."""

    model_config = ConfigDict(extra="allow")

    stage: str | None = None
    trials: int = Field(description="at most, with every extension round")
    planned: int = Field(description="without extension rounds")
    tokens: float
    flops: float = Field(description="analytic training FLOPs, summed over the trials")
    peak_memory_per_worker_gb: float
    workers_per_trial: list[int]
    device_hours: float = Field(description="GPU-hours (CPU-hours on a CPU sweep)")


class SweepPlan(BaseModel):
    """`POST /sweeps?dry_run=true`: what the sweep would cost on this cluster; nothing is
    queued. `throughput` says where the seconds per trial came from (this cluster's
    trials, a micro-run, or a GPU's peak FLOP/s x a stated MFU)."""

    model_config = ConfigDict(extra="allow")

    name: str
    device: str
    unit: str
    stages: list[PlanRow]
    total: dict[str, Any] = Field(description="a PlanRow plus wall_s (at most) and "
                                  "wall_s_planned (without extension rounds); null wall "
                                  "times: the trials cannot run on this cluster")
    rounds: list[dict[str, Any]]
    throughput: dict[str, Any]
    cluster: dict[str, Any]
    ceiling: dict[str, Any] = Field(description="HPT_MAX_SWEEP_DEVICE_HOURS and whether "
                                    "the estimate exceeds it (then submit needs "
                                    "confirm_cost=true)")
    warnings: list[str] = []
    text: str = Field(description="the plan as `hpt plan` prints it")


def _trial_model() -> type[BaseModel]:
    """`Trial`, the body of one trial: TrialRecord's fields (their one definition) with the
    status as its enum, then `reused`; a field that may be None may also be left out."""
    hints = get_type_hints(TrialRecord)
    described = {
        "status": (TrialStatus, ...),
        "result": (dict[str, Any] | None, Field(default=None, description=(
            "the worker's result; its loss curve only with curves=true"))),
    }
    fields: dict[str, Any] = {
        f.name: described.get(f.name) or (hints[f.name], None if _optional(hints[f.name]) else ...)
        for f in dataclasses.fields(TrialRecord)}
    fields["reused"] = (bool, Field(description="copied from an identical earlier trial, "
                                                "not trained"))
    return create_model("Trial", __config__=ConfigDict(extra="allow"),
                        __doc__="One trial (contracts.records.TrialRecord.to_dict).", **fields)


def _optional(hint: Any) -> bool:
    return type(None) in get_args(hint)


Trial = _trial_model()


class TrialPage(BaseModel):
    total: int
    limit: int
    offset: int
    items: list[Trial]


class FitReport(BaseModel):
    """GET /sweeps/{id}/fits (coordinator.fits.fits_payload). The analyses are nested records
    whose fields depend on the analysis; `tables` holds them as rows, `text` as a report."""

    model_config = ConfigDict(extra="allow")

    n_trials: int
    status_counts: dict[str, int]
    reference_arm: str | None = None
    bootstrap: int
    seed: int
    error: str | None = None
    warnings: list[str]
    failures: dict[str, str] | list[str]
    stages: dict[str, Any] | None = Field(default=None, description="a study: the stage "
                                          "each analysis came from")
    headline: dict[str, Any] | None = None
    analyses: dict[str, dict[str, Any] | None]
    tables: dict[str, list[dict[str, Any]]] = Field(description="each analysis as rows: "
                                                    "optimal_lr, transfer, frontier, ...")
    table_columns: dict[str, list[str]] | None = Field(default=None, description="each "
                                                       "table's columns (an empty table too)")
    text: str


class ComponentHealth(BaseModel):
    name: str
    ok: bool
    detail: str
    fix: str | None = None


class Health(BaseModel):
    status: HealthState
    database: str
    ray: bool
    ray_address: str | None = None
    dispatcher_error: str | None = None
    mlflow_uri: str | None = None
    components: list[ComponentHealth] = []


# What each error status means; its body is always an ErrorResponse (guards.error_response)
ERROR_MEANINGS: dict[int, str] = {
    400: "The URL holds a NUL character, the JSON body cannot be read (not UTF-8, nested "
         "too deeply, an integer of over 4300 digits), or the database cannot store a value",
    401: "Missing or wrong bearer token (HPT_API_TOKEN is set on the server)",
    404: "No sweep with this id",
    413: "The request body is over the server's limit (HPT_MAX_REQUEST_BYTES)",
    415: "A mutation sent without 'Content-Type: application/json'",
    422: "A field, query parameter or the JSON body is invalid: `errors` names each",
    500: "An unexpected error (the server log has its traceback)",
    503: "The app database is unavailable; retry shortly",
}
_BUSY = ("; or too many fit reports are being computed: retry after the Retry-After "
         "header's seconds")
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying",
                                "schema": {"type": "integer"}}}


def errors(*statuses: int, busy: bool = False) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for a route's error answers: `statuses` plus those any route can
    give (400, 500, 503). `busy`: its 503 may also be a full computation gate."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in sorted({400, *statuses, 500, 503}):
        out[status] = {"model": ErrorResponse, "description": ERROR_MEANINGS[status]}
    if busy:
        out[503] = {**out[503], "description": ERROR_MEANINGS[503] + _BUSY,
                    "headers": _RETRY_AFTER}
    if 401 in out:
        out[401]["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
    return out


def json_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`errors` for a route whose own answers are not JSON (the HTML pages): the error
    bodies named as JSON explicitly (a `model` would take the route's media type)."""
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    return {status: {"description": r["description"], "content": {"application/json": {
        "schema": ref}}} for status, r in errors(*statuses).items()}


def sweep_spec_components() -> dict[str, Any]:
    """The sweep spec's JSON schema and its parts, as OpenAPI components: POST /sweeps'
    body refers to `SweepSpec` (the route reads the body itself: see routes.submit_sweep)."""
    from hptransfer.spec import SweepSpec

    schema = SweepSpec.model_json_schema(ref_template="#/components/schemas/{model}")
    parts = schema.pop("$defs", {})
    return {**parts, "SweepSpec": schema}
