"""The REST routes: thin translations to Coordinator operations."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Query, Request

from hptransfer.status import TrialStatus

from .auth import require_token
from .schemas import EXAMPLE_SPEC, ErrorResponse, Health, SweepSummary, TrialPage

router = APIRouter()
ERRORS = {400: {"model": ErrorResponse}, 401: {"model": ErrorResponse},
          404: {"model": ErrorResponse}, 422: {"model": ErrorResponse}}
TRIAL_STATUSES = "|".join(TrialStatus)


def coordinator(request: Request):
    return request.app.state.coordinator


@router.get("/health", response_model=Health, tags=["service"])
def health(request: Request) -> dict[str, Any]:
    import ray

    c = coordinator(request)
    c.store.list_sweeps(limit=1)  # raises (-> 503 handler) if the database is gone
    return {
        "status": "ok",
        "database": c.store.url_safe,
        "ray": ray.is_initialized(),
        "ray_address": ray.get_runtime_context().gcs_address if ray.is_initialized() else None,
        "dispatcher_error": c.dispatcher.last_error if c.dispatcher else None,
        "mlflow_uri": c.settings.mlflow_uri,
    }


@router.post("/sweeps", status_code=201, response_model=SweepSummary, responses=ERRORS,
             dependencies=[Depends(require_token)], tags=["sweeps"])
def submit_sweep(
    request: Request,
    spec: Annotated[dict[str, Any], Body(openapi_examples={"cpu-small": {
        "summary": "A small CPU sweep: SP vs CompleteP", "value": EXAMPLE_SPEC}})],
) -> dict[str, Any]:
    """Validate a sweep spec (JSON body), expand it and store every trial in one transaction."""
    return coordinator(request).submit(spec)


@router.get("/sweeps", response_model=list[SweepSummary], tags=["sweeps"])
def list_sweeps(
    request: Request,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> list[dict[str, Any]]:
    return coordinator(request).summaries(limit=limit, offset=offset)


@router.get("/sweeps/{sweep_id}", response_model=SweepSummary, responses=ERRORS, tags=["sweeps"])
def get_sweep(request: Request, sweep_id: str) -> dict[str, Any]:
    """Status counts, progress and ETA of one sweep."""
    return coordinator(request).summary(sweep_id)


@router.get("/sweeps/{sweep_id}/trials", response_model=TrialPage, responses=ERRORS,
            tags=["sweeps"])
def list_trials(
    request: Request,
    sweep_id: str,
    status: Annotated[str | None, Query(pattern=f"^({TRIAL_STATUSES})$")] = None,
    arm: str | None = None,
    width: Annotated[int | None, Query(gt=0)] = None,
    depth: Annotated[int | None, Query(gt=0)] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
    offset: Annotated[int, Query(ge=0)] = 0,
) -> dict[str, Any]:
    c = coordinator(request)
    c.summary(sweep_id)  # 404 for an unknown sweep
    filters = dict(status=status, arm=arm, width=width, depth=depth)
    return {
        "total": c.store.count_trials(sweep_id, **filters),
        "limit": limit,
        "offset": offset,
        "items": c.store.trials(sweep_id, limit=limit, offset=offset, **filters),
    }


@router.post("/sweeps/{sweep_id}/cancel", response_model=SweepSummary, responses=ERRORS,
             dependencies=[Depends(require_token)], tags=["sweeps"])
def cancel_sweep(request: Request, sweep_id: str) -> dict[str, Any]:
    """Pending trials never start; running ones are cancelled."""
    return coordinator(request).cancel(sweep_id)


@router.get("/sweeps/{sweep_id}/fits", responses=ERRORS, tags=["fits"])
def get_fits(
    request: Request,
    sweep_id: str,
    bootstrap: Annotated[int, Query(ge=0, le=2000)] = 100,
    reference_arm: str | None = None,
) -> dict[str, Any]:
    """The fit report: optimal LR per shape, transfer drift, frontier, FLOP savings, N:L,
    Chinchilla; each with its inputs, residuals and a reason when there is not enough data."""
    return coordinator(request).fits(sweep_id, bootstrap=bootstrap, reference_arm=reference_arm)
