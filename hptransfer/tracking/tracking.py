"""The MLflow client the mirror writes with, and the `hpt mlflow-ui` command line.

For `http(s)://` servers the HTTP retry budget is made short unless the environment already
sets it (MLFLOW_HTTP_REQUEST_MAX_RETRIES=2, MLFLOW_HTTP_REQUEST_TIMEOUT=10): MLflow's default
(7 retries, exponential back-off, 120 s timeouts) would hold a mirror pass for minutes.
The default store is SQLite (`sqlite:///<home>/mlflow.db`), switched to WAL so `mlflow ui`
can read while a sweep writes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import sys
from pathlib import Path
from typing import Any

from .params import normalize_tracking_uri, sqlite_store_file

log = logging.getLogger(__name__)

# MLflow 3.17's UI decides whether an experiment is GenAI or model training from its global
# workflow switch, not from the experiment's `mlflow.experimentKind` tag: the `workflowType`
# URL parameter, else the choice stored in the browser (GenAI by default, which lands on a
# traces overview). Every link into the UI carries the model-training choice.
UI_WORKFLOW = "workflowType=machine_learning"
UI_HOST, UI_PORT = "127.0.0.1", 5000  # where `hpt mlflow-ui` serves by default

# Environment for every MLflow server this project starts (`hpt mlflow-ui`, cluster_up.sh,
# docker-compose.yml). MLflow 3's server also runs a job runner for its GenAI jobs: eight more
# processes, measured at ~25 more CPU-seconds in its first 20 s and 2.4 GB against 0.5 GB of
# memory. hptransfer only tracks runs and proxies artifacts, so the runner stays off.
SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def ui_url(ui_base: str, experiment_id: str | None = None) -> str:
    """The MLflow UI at `ui_base` in its model-training view: the experiment list, or one
    experiment (which then opens on its training runs)."""
    page = f"experiments/{experiment_id}" if experiment_id else "experiments"
    return f"{ui_base.rstrip('/')}/#/{page}?{UI_WORKFLOW}"


def prepare_sqlite_store(tracking_uri: str) -> None:
    """Create a local SQLite tracking store now, in WAL mode: readers (mlflow ui) no longer
    block sweep writes, and the file /health watches exists from the start. No-op for others."""
    db = sqlite_store_file(tracking_uri)
    if db is None:
        return
    try:
        db.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.closing(sqlite3.connect(db, timeout=10)) as con:
            con.execute("PRAGMA journal_mode=WAL")
    except sqlite3.Error as exc:
        raise ConnectionError(f"cannot open {db}: {exc}") from exc


def open_client(tracking_uri: str) -> Any:
    """An `MlflowClient` of its own (MLflow's global fluent state is never touched)."""
    from mlflow.tracking import MlflowClient  # heavy import, only when mirroring

    uri = normalize_tracking_uri(tracking_uri)
    if uri.startswith(("http://", "https://")):
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    prepare_sqlite_store(uri)
    try:
        return MlflowClient(uri)
    except Exception as exc:  # a store that cannot be opened is "away": retried later
        raise ConnectionError(f"cannot open {uri}: {exc}") from exc


def ui_command(
    tracking_uri: str, host: str = UI_HOST, port: int = UI_PORT,
    allowed_hosts: str | None = None,
) -> list[str]:
    """argv for `hpt mlflow-ui`: `mlflow ui --backend-store-uri URI --host H --port P`
    (run it with SERVER_ENV added to the environment)."""
    uri = normalize_tracking_uri(tracking_uri)
    if uri.startswith(("http://", "https://")):
        raise ValueError(f"{uri} is already an MLflow server: open {ui_url(uri)}")
    # Prefer the mlflow script of this interpreter's environment; PATH may hold another one.
    script = Path(sys.executable).with_name("mlflow")
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "mlflow"]
    argv += ["ui", "--backend-store-uri", uri, "--host", host, "--port", str(int(port))]
    if allowed_hosts:
        argv += ["--allowed-hosts", allowed_hosts]
    return argv
