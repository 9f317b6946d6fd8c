"""GET /health's body: the component checks of `hptransfer.coordinator.health`, run inside the
server against the connections it holds, plus the dispatcher's state."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from hptransfer.contracts.status import HealthState
from hptransfer.coordinator.health import (
    Check,
    MlflowStoreWatch,
    ProbeCache,
    run_checks,
)
from hptransfer.redaction import mask_url, redact


def remember_mlflow_store(app: FastAPI) -> None:
    """Note which MLflow store the coordinator started with (after it opened it)."""
    app.state.mlflow_store = MlflowStoreWatch(app.state.coordinator.settings.mlflow_uri)
    app.state.health_probes = ProbeCache()


def health_report(app: FastAPI, deep: bool = False, details: bool = True) -> JSONResponse:
    """200 with status ok or degraded (a component failed, the API still works); 503 when the
    app database is down. Without `details` (a client without the token), each component's
    name and state only: no database path, Ray address or URLs for anyone who can reach
    the port."""
    import ray

    c = app.state.coordinator
    if getattr(app.state, "mlflow_store", None) is None:
        remember_mlflow_store(app)

    # a driver's error can quote the URL it connected to
    dispatcher_error = redact(c.dispatcher.last_error) if c.dispatcher else None

    def dispatcher() -> Check:
        if dispatcher_error:
            return Check("dispatcher", False, f"last tick failed: {dispatcher_error[:300]}",
                         "see the server log; the loop retries on its own")
        optuna_error = redact(c.dispatcher.optuna_storage.error) if c.dispatcher else None
        if optuna_error:
            return Check("dispatcher", False, f"Optuna's storage failing: {optuna_error[:300]}",
                         "Optuna sweeps wait (their results are kept), other sweeps go on; "
                         "check the database HPT_OPTUNA_URL names")
        return Check("dispatcher", True, "running" if c.dispatcher else "off (API only)")

    checks = run_checks(c.settings, deep=deep, connect_ray=False,
                        use_ray=c.dispatcher is not None, engine=c.store.engine,
                        mlflow_started_with=app.state.mlflow_store, extra=[dispatcher],
                        probes=app.state.health_probes)
    db_ok = checks[0].ok
    ray_on = ray.is_initialized()
    status = (HealthState.OK if all(ch.ok for ch in checks) else
              HealthState.DEGRADED if db_ok else HealthState.DOWN)
    if not details:
        return JSONResponse(status_code=200 if db_ok else 503, content={
            "status": status, "components": [{"name": ch.name, "ok": ch.ok} for ch in checks]})
    body: dict[str, Any] = {
        "status": status,
        "database": c.store.url_safe,
        "ray": ray_on,
        "ray_address": ray.get_runtime_context().gcs_address if ray_on else None,
        "dispatcher_error": dispatcher_error,
        "mlflow_uri": mask_url(c.settings.mlflow_uri),
        "components": [ch.to_dict() for ch in checks],
    }
    return JSONResponse(status_code=200 if db_ok else 503, content=body)
