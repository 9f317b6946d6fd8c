"""The REST routes: thin translations to Coordinator operations."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Header, HTTPException, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, TypeAdapter, WithJsonSchema

from hptransfer.contracts.filters import TrialFilters
from hptransfer.contracts.status import HealthState, TrialStatus
from hptransfer.coordinator.service import UnknownArm
from hptransfer.jsonsafe import json_safe
from hptransfer.models.config import MAX_DEPTH, MAX_WIDTH
from hptransfer.spec.cache import MAX_PAGE
from hptransfer.spec.stages import STAGE_ORDER
from hptransfer.spec.trial import MAX_SEED, MAX_SIGMA

from .auth import require_token
from .guards import StrictJSONRoute, require_json
from .reads import check_bootstrap, require_reader, trusted
from .schemas import (
    EXAMPLE_SPEC,
    FitReport,
    Health,
    SweepPlan,
    SweepSummary,
    TrialPage,
    errors,
)

# trials a page holds with their curves (a point per evaluation each)
MAX_CURVE_PAGE = 100

router = APIRouter(route_class=StrictJSONRoute)
# the errors a mutation can meet before its handler runs: token, content type, body size
MUTATION_ERRORS = (401, 413, 415)
# the cached listings (hptransfer.api.listing) answer a matching If-None-Match with a 304
NOT_MODIFIED: dict[int | str, dict[str, Any]] = {
    304: {"description": "Not modified: If-None-Match names the listing's current ETag"}}
# Paging past this is never meaningful, and SQLite overflows past 2**63 (a 500 before).
MAX_OFFSET = 10**9
MUTATION = [Depends(require_token), Depends(require_json)]
# reads need the token too when one is set, unless HPT_PUBLIC_READS (see reads.py)
READ = [Depends(require_reader)]
TRIAL_STATUSES = "|".join(TrialStatus)
STAGES = "|".join(STAGE_ORDER)
_SUMMARIES = TypeAdapter(list[SweepSummary])


def coordinator(request: Request):
    return request.app.state.coordinator


class PublicComponent(BaseModel):
    name: str
    ok: bool


class PublicHealth(BaseModel):
    """/health without the token (when one is set): each component's state, no details."""
    status: HealthState
    components: list[PublicComponent] = []


@router.get("/health", response_model=Health | PublicHealth,
            responses={**errors(401, 422), 503: {"model": Health | PublicHealth, "description":
                       "The app database is down (`status` down)"}}, tags=["service"])
def health(request: Request, deep: bool = False) -> Any:
    """Each component: app database (migrations at head), Optuna storage, MLflow (version,
    artifacts, still the store it started with), Ray nodes and their resources, dispatcher;
    `deep=true` adds the package version and data roots seen on every Ray node (slower; a
    task on every node, so it needs the bearer token when one is set). 503 when the app
    database is down; `degraded` when another component fails. With a token set, a client
    without it sees each component's name and state only (no URLs, paths or addresses)."""
    from .health import health_report

    if deep:  # uncached, up to a minute per node: not for anyone who can reach the port
        require_token(request)
    return health_report(request.app, deep, details=trusted(request))


@router.post("/sweeps", status_code=201, response_model=SweepSummary,
             responses={200: {"model": SweepPlan, "description": "`dry_run=true`: the "
                              "sweep's price; nothing queued or stored"},
                        **errors(*MUTATION_ERRORS, 422, busy=True)},
             dependencies=MUTATION, tags=["sweeps"])
def submit_sweep(
    request: Request,
    # read as any JSON object and validated by the coordinator (field-named errors,
    # "did you mean"); published as the spec's own schema (components: SweepSpec)
    spec: Annotated[dict[str, Any],
                    WithJsonSchema({"$ref": "#/components/schemas/SweepSpec"}),
                    Body(openapi_examples={"cpu-small": {
                        "summary": "A small CPU sweep: SP vs CompleteP", "value": EXAMPLE_SPEC}})],
    idempotency_key: Annotated[str | None, Header(
        alias="Idempotency-Key", description="Retry-safe submit: the same key and body within "
        "24 h answer the sweep the first request made; the key with another body is a 422")
    ] = None,
    dry_run: Annotated[bool, Query(description="price the sweep (`hpt plan`): trials, "
                                   "tokens, FLOPs, memory per worker, device-hours and wall "
                                   "time per stage; nothing is queued or stored")] = False,
    confirm_cost: Annotated[bool, Query(description="queue a sweep whose estimate exceeds "
                                        "HPT_MAX_SWEEP_DEVICE_HOURS")] = False,
    cpus: Annotated[float | None, Query(
        gt=0, le=1e6, allow_inf_nan=False,
        description="dry_run: plan for a cluster of this many CPUs (default: this one's)")
    ] = None,
    gpus: Annotated[float | None, Query(
        ge=0, le=1e6, allow_inf_nan=False,
        description="dry_run: plan for a cluster of this many GPUs (default: this one's)")
    ] = None,
    calibrate: Annotated[bool, Query(description="dry_run: measure the throughput again "
                                     "(a CPU micro-run) instead of the cached one")] = False,
) -> Any:
    """Validate a sweep spec (JSON body), expand it and store every trial in one transaction.
    `dry_run=true`: its price instead (200, nothing stored). A sweep priced above
    HPT_MAX_SWEEP_DEVICE_HOURS is a 422 naming `confirm_cost` unless `confirm_cost=true`.

    A sync route, so FastAPI runs it in its threadpool: loading the data (hashing shards,
    tokenizing the corpus) never blocks the event loop."""
    if dry_run:
        plan = coordinator(request).plan(spec, cpus=cpus, gpus=gpus, calibrate=calibrate)
        return JSONResponse(json_safe(plan), status_code=200)
    return coordinator(request).submit(spec, idempotency_key=idempotency_key,
                                       confirm_cost=confirm_cost)


@router.get("/sweeps", response_model=list[SweepSummary],
            responses={**NOT_MODIFIED, **errors(401, 422)}, dependencies=READ,
            tags=["sweeps"])
async def list_sweeps(
    request: Request,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
) -> Response:
    """A page of sweep summaries, newest first. Served from the listing cache while nothing
    changed (see `hptransfer.api.listing`): the same JSON, validated against the model once;
    304 when If-None-Match names the current ETag."""
    c = coordinator(request)

    def build() -> bytes:
        return _SUMMARIES.dump_json(_SUMMARIES.validate_python(
            c.summaries(limit=limit, offset=offset)))

    return await request.app.state.listings.respond(request, ("sweeps", limit, offset), build,
                                                    "application/json")


@router.get("/sweeps/{sweep_id}", response_model=SweepSummary,
            responses=errors(401, 404, 422), dependencies=READ, tags=["sweeps"])
def get_sweep(request: Request, sweep_id: str) -> dict[str, Any]:
    """Status counts, progress and ETA of one sweep."""
    return coordinator(request).summary(sweep_id)


def trial_filters(
    status: Annotated[str | None, Query(pattern=f"^({TRIAL_STATUSES})$")] = None,
    arm: str | None = None,
    width: Annotated[int | None, Query(gt=0, le=MAX_WIDTH)] = None,
    depth: Annotated[int | None, Query(gt=0, le=MAX_DEPTH)] = None,
    sigma_base: Annotated[float | None, Query(gt=0, le=MAX_SIGMA, allow_inf_nan=False)] = None,
    seed: Annotated[int | None, Query(ge=0, le=MAX_SEED)] = None,
    stage: Annotated[str | None, Query(pattern=f"^({STAGES})$",
                                       description="a study's stage: " + STAGES)] = None,
) -> TrialFilters:
    """The trial filters of a listing's query, with the bounds the URL checks refuse past
    (one query parameter per TrialFilters field: a test compares them)."""
    return TrialFilters(status=status, arm=arm, width=width, depth=depth,
                        sigma_base=sigma_base, seed=seed, stage=stage)


@router.get("/sweeps/{sweep_id}/trials", response_model=TrialPage,
            responses=errors(401, 404, 422), dependencies=READ, tags=["sweeps"])
def list_trials(
    request: Request,
    sweep_id: str,
    filters: Annotated[TrialFilters, Depends(trial_filters)],
    limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
    curves: Annotated[bool, Query(description="each result with its loss curve (at most "
                                              f"{MAX_CURVE_PAGE} trials a page)")] = False,
) -> dict[str, Any]:
    """A page of the sweep's trials; results without their curves unless `curves=true`."""
    c = coordinator(request)
    c.summary(sweep_id)  # 404 for an unknown sweep
    if curves and limit > MAX_CURVE_PAGE:
        raise HTTPException(status_code=422, detail=(
            f"with curves=true a page holds at most {MAX_CURVE_PAGE} trials (limit={limit}): "
            "page through them, or leave the curves out"))
    return {
        "total": c.store.count_trials(sweep_id, **filters.as_dict()),
        "limit": limit,
        "offset": offset,
        "items": [t.to_dict() for t in c.store.trials(sweep_id, limit=limit, offset=offset,
                                                      curves=curves, **filters.as_dict())],
    }


@router.post("/sweeps/{sweep_id}/cancel", response_model=SweepSummary,
             responses=errors(*MUTATION_ERRORS, 404, 422), dependencies=MUTATION, tags=["sweeps"])
def cancel_sweep(request: Request, sweep_id: str) -> dict[str, Any]:
    """Pending trials never start; running ones are cancelled."""
    return coordinator(request).cancel(sweep_id)


# documented, not serialised through FitReport: the report's analyses are free-form records
@router.get("/sweeps/{sweep_id}/fits", responses={
    200: {"model": FitReport, "description": "The fit report"},
    **errors(401, 404, 422, busy=True)}, dependencies=READ, tags=["fits"])
def get_fits(
    request: Request,
    sweep_id: str,
    bootstrap: Annotated[int, Query(ge=0, le=2000)] = 100,
    reference_arm: Annotated[str | None, Query(max_length=200)] = None,
) -> dict[str, Any]:
    """The fit report: optimal LR per shape, transfer drift, frontier, FLOP savings, N:L,
    Chinchilla; each with its inputs, residuals and a reason when there is not enough data.
    A client without the token (public reads) gets the default bootstrap only."""
    check_bootstrap(request, bootstrap)
    try:
        return coordinator(request).fits(sweep_id, bootstrap=bootstrap,
                                         reference_arm=reference_arm)
    except UnknownArm as exc:  # say which arms there are
        raise HTTPException(status_code=422, detail=str(exc)) from None
