"""MLflow tracking for sweeps: one experiment per sweep, a parent run, one nested run per trial.

`Tracker` talks to MLflow only through its own `MlflowClient(tracking_uri)`; it never touches
MLflow's global fluent state (tracking URI, active run), so several sweeps can be tracked from
one process and from several threads.

What happens when MLflow is unreachable
---------------------------------------
MLflow is a side channel: no public method of `Tracker` raises. A call that fails

* logs a warning, increments `Tracker.failures` and sets `Tracker.last_error`;
* returns None (start_sweep, start_trial) or False (the others);
* appends its record to the *outbox*: JSON lines under `outbox_dir`, one file per trial
  (`<sweep>/trial-<trial>.jsonl`) and one per sweep (`<sweep>/sweep.jsonl`);
* opens a circuit breaker: for `retry_after_s` seconds later calls skip MLflow entirely and
  go straight to the outbox, so a dead server costs one timeout, not one per call.

Records are replayed, in order and with their original timestamps, by `flush_outbox()` (call
it at start-up or at the end of a sweep; any Tracker opened on the same outbox directory can
do it, also one pointed at another tracking URI), and automatically for one trial the next
time that trial logs while MLflow answers. Once a trial has queued records its later records
queue behind them, so a finish is never applied before the start it depends on. Replay is
idempotent where it matters: experiments and parent runs are looked up by name/tag before
being created, and a trial's run is looked up by its `hpt.trial_id` tag and start time.
Records that can never succeed (MLflow rejects them: invalid or conflicting values, a run that
does not exist; or a bad argument) are not retried: they go to `<outbox>/rejected.jsonl` with
the error, so one bad record cannot block its file.

When a start failed, its caller holds no run id; pass `sweep_id=` / `trial_id=` to the later
calls (trial ids must be unique across sweeps: the app DB's trial key) so that their records
queue behind the start. `run_id_for(trial_id)` reports the run once a replay has created it.

For `http(s)://` servers the HTTP retry budget is made short unless the environment already
sets it (MLFLOW_HTTP_REQUEST_MAX_RETRIES=2, MLFLOW_HTTP_REQUEST_TIMEOUT=10): MLflow's default
(7 retries, exponential back-off, 120 s timeouts) would stall the coordinator for minutes.

The default store is SQLite (`sqlite:///<home>/mlflow.db`); MLflow's file store is not used
(it raises unless MLFLOW_ALLOW_FILE_STORE is set). SQLite databases are switched to WAL so
`mlflow ui` can read while a sweep writes.

The outbox files live in `mlflow_outbox`; flattening, key/value limits and URI helpers in
`mlflow_params`.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import sqlite3
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .outbox import Outbox, now_ms
from .params import (
    MAX_KEY,
    MAX_METRICS_PER_BATCH,
    MAX_PARAM_VALUE,
    flatten,
    mlflow_key,
    mlflow_params,
    mlflow_tags,
    normalize_tracking_uri,
    run_name,
    safe_name,
    sqlite_path,
    table_params,
    to_float,
)

# The public entry points; MAX_KEY, MAX_PARAM_VALUE, flatten and mlflow_key live in
# mlflow_params and stay importable from here.
__all__ = [
    "MAX_KEY", "MAX_PARAM_VALUE", "Tracker", "flatten", "mlflow_key", "ui_command",
]

log = logging.getLogger(__name__)

ERROR_TAIL = 4000  # characters of a trial's error kept in its hpt.error tag

CURVE_METRICS = ("train_loss", "val_loss", "lr", "tokens")
FINAL_METRICS = (
    "final_val_loss", "final_train_loss", "flops", "flops_per_token", "tokens", "tokens_per_s",
    "wall_time_s", "mfu", "params_non_embedding", "params_embedding",
)
RUN_STATUS = {
    "completed": "FINISHED", "pruned": "FINISHED", "diverged": "FINISHED",
    "finished": "FINISHED", "done": "FINISHED", "stopped": "FINISHED",  # a study stopped on purpose
    "failed": "FAILED", "error": "FAILED",
    "cancelled": "KILLED", "canceled": "KILLED", "killed": "KILLED",
}
# MLflow error codes that mean "this record is wrong", not "MLflow is away": never retried.
# Every other MlflowException, OSError (connection, timeout) or database error is transient.
REJECTED_CODES = frozenset({
    "INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS", "RESOURCE_DOES_NOT_EXIST",
    "INVALID_STATE", "BAD_REQUEST",
})


def ui_command(
    tracking_uri: str, host: str = "127.0.0.1", port: int = 5000,
    allowed_hosts: str | None = None,
) -> list[str]:
    """argv for `hpt mlflow-ui`: `mlflow ui --backend-store-uri URI --host H --port P`."""
    uri = normalize_tracking_uri(tracking_uri)
    if uri.startswith(("http://", "https://")):
        raise ValueError(f"{uri} is already an MLflow server: open it in a browser")
    # Prefer the mlflow script of this interpreter's environment; PATH may hold another one.
    script = Path(sys.executable).with_name("mlflow")
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "mlflow"]
    argv += ["ui", "--backend-store-uri", uri, "--host", host, "--port", str(int(port))]
    if allowed_hosts:
        argv += ["--allowed-hosts", allowed_hosts]
    return argv


# ------------------------------------------------------------------------------------------
# errors


def _quotable(text: str) -> bool:
    """Safe inside a quoted MLflow search-filter literal."""
    return "'" not in text and "\\" not in text


def _is_transient(exc: BaseException) -> bool:
    """Worth retrying later (MLflow away or busy) rather than a record MLflow will never take.
    Anything else (bad values, bugs) would block its outbox file forever if it were retried."""
    if isinstance(exc, OSError):  # requests' ConnectionError/Timeout are OSErrors too
        return True
    if type(exc).__module__.startswith(("sqlalchemy", "sqlite3")):  # e.g. "database is locked"
        return True
    code = getattr(exc, "error_code", None)
    return code is not None and code not in REJECTED_CODES


def _run_gone(exc: BaseException) -> bool:
    """The run itself does not exist: no later step of the record can succeed either."""
    return getattr(exc, "error_code", None) == "RESOURCE_DOES_NOT_EXIST"


class _Unresolved(Exception):
    """A record names a sweep or run that does not exist (yet): keep it queued."""


# ------------------------------------------------------------------------------------------
# tracker


@dataclass
class _SweepRef:
    sweep_id: str
    name: str | None = None
    experiment_id: str | None = None
    parent_run_id: str | None = None

    @property
    def ids(self) -> tuple[str, str] | None:
        """(experiment_id, parent_run_id) once both are known."""
        if self.experiment_id and self.parent_run_id:
            return self.experiment_id, self.parent_run_id
        return None


@dataclass
class _TrialRef:
    trial_id: str
    sweep_id: str | None = None
    run_id: str | None = None


class Tracker:
    """MLflow records of sweeps and trials; every public method swallows and records errors."""

    def __init__(
        self,
        tracking_uri: str,
        artifact_location: str | None = None,
        *,
        outbox_dir: str | Path | None = None,
        retry_after_s: float = 30.0,
    ) -> None:
        self.tracking_uri = normalize_tracking_uri(tracking_uri)
        self.retry_after_s = retry_after_s
        self.failures = 0
        self.last_error: str | None = None
        db = sqlite_path(self.tracking_uri)
        # Default roots sit next to a SQLite DB; for servers the server picks the artifact root.
        self.artifact_root = artifact_location or (str(db.parent / "mlartifacts") if db else None)
        default_outbox = db.parent / "mlflow-outbox" if db else Path("mlflow-outbox")
        self.outbox = Outbox(outbox_dir or os.environ.get("HPT_MLFLOW_OUTBOX") or default_outbox)
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._state = threading.RLock()
        self._down_until = 0.0
        self._sweeps: dict[str, _SweepRef] = {}
        self._parent_to_sweep: dict[str, str] = {}
        self._trials: dict[str, _TrialRef] = {}
        self._run_to_trial: dict[str, str] = {}
        self._logged: dict[str, dict[str, int]] = {}  # run -> metric -> highest step logged
        if self.tracking_uri.startswith(("http://", "https://")):
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        if db is not None:
            self._prepare_sqlite(db)

    # -- public API ------------------------------------------------------------------------

    def start_sweep(
        self, sweep_id: str, name: str, spec: Mapping[str, Any],
        tags: Mapping[str, Any] | None = None,
    ) -> tuple[str, str] | None:
        """Experiment `hpt/{name}/{sweep_id}` + parent run; (experiment_id, parent_run_id)."""
        try:
            sweep_id = str(sweep_id)
            with self._state:
                ref = self._sweeps.setdefault(sweep_id, _SweepRef(sweep_id))
                ref.name = name
            if ref.ids:
                return ref.ids
            path = self.outbox.sweep_path(sweep_id)
            if path.exists():
                self._auto_replay(path)
                if ref.ids:
                    return ref.ids
                if self._has_start(path):
                    return None  # already queued: a coordinator retrying must not pile up copies
            record = {
                "op": "start_sweep", "ts": now_ms(), "sweep_id": sweep_id, "name": name,
                "spec": dict(spec), "tags": {str(k): str(v) for k, v in (tags or {}).items()},
            }
            return self._submit("start_sweep", path, record)
        except Exception as exc:
            self._note_failure("start_sweep", exc)
            return None

    def start_trial(
        self, experiment_id: str | None, parent_run_id: str | None, trial_id: str, arm: str,
        trial_spec: Mapping[str, Any], *, sweep_id: str | None = None,
    ) -> str | None:
        """Nested run for one trial; its run id, or None if it was queued or failed."""
        try:
            trial_id = str(trial_id)
            sweep_id = str(sweep_id) if sweep_id is not None else None
            with self._state:
                if sweep_id is None and parent_run_id:
                    sweep_id = self._parent_to_sweep.get(parent_run_id)
                if sweep_id is not None and not (experiment_id and parent_run_id):
                    ref = self._sweeps.get(sweep_id)
                    if ref is not None:
                        experiment_id = experiment_id or ref.experiment_id
                        parent_run_id = parent_run_id or ref.parent_run_id
                trial = self._trials.setdefault(trial_id, _TrialRef(trial_id))
                trial.sweep_id = sweep_id or trial.sweep_id
                trial.run_id = None  # a retried trial gets a new run, not the last attempt's
            if not (experiment_id and parent_run_id) and sweep_id is not None:
                # The sweep's own start may still be queued: replay it first if MLflow is back.
                sweep_file = self.outbox.sweep_path(sweep_id)
                if sweep_file.exists():
                    self._auto_replay(sweep_file)
            record = {
                "op": "start_trial", "ts": now_ms(), "sweep_id": sweep_id, "trial_id": trial_id,
                "arm": str(arm), "spec": dict(trial_spec), "experiment_id": experiment_id,
                "parent_run_id": parent_run_id,
            }
            return self._submit("start_trial", self.outbox.trial_path(sweep_id, trial_id), record)
        except Exception as exc:
            self._note_failure("start_trial", exc)
            return None

    def log_metrics(
        self, run_id: str | None, points: list[dict[str, Any]], *, trial_id: str | None = None,
    ) -> bool:
        """Curve points {step, train_loss, val_loss?, lr, tokens} in log_batch calls of <= 1000
        metrics; (metric, step) pairs already logged by this Tracker are skipped."""
        try:
            if not points:
                return True
            run_id, trial_id, path = self._route(run_id, trial_id)
            record = {
                "op": "log_metrics", "ts": now_ms(), "run_id": run_id, "trial_id": trial_id,
                "points": list(points),
            }
            return bool(self._submit("log_metrics", path, record))
        except Exception as exc:
            self._note_failure("log_metrics", exc)
            return False

    def finish_trial(
        self, run_id: str | None, result: Mapping[str, Any], status: str,
        *, trial_id: str | None = None,
    ) -> bool:
        """Param table, curve, final metrics, `param_table.json`, hpt.status, run status."""
        try:
            run_id, trial_id, path = self._route(run_id, trial_id)
            record = {
                "op": "finish_trial", "ts": now_ms(), "run_id": run_id, "trial_id": trial_id,
                "result": dict(result or {}), "status": str(status),
            }
            return bool(self._submit("finish_trial", path, record))
        except Exception as exc:
            self._note_failure("finish_trial", exc)
            return False

    def finish_sweep(
        self, parent_run_id: str | None, status: str,
        artifacts: Mapping[str, bytes | str] | None = None, *, sweep_id: str | None = None,
    ) -> bool:
        """Log artifacts (name -> bytes/str; "fits/fit.png" keeps its folder), end the parent."""
        try:
            if sweep_id is None and parent_run_id:
                sweep_id = self._parent_to_sweep.get(parent_run_id)
            sweep_id = str(sweep_id) if sweep_id is not None else None
            if parent_run_id is None and sweep_id is not None:
                ref = self._sweeps.get(sweep_id)
                parent_run_id = ref.parent_run_id if ref else None
            if parent_run_id is None and sweep_id is None:
                raise ValueError("finish_sweep needs parent_run_id or sweep_id")
            encoded = []
            for name, content in (artifacts or {}).items():
                _check_artifact_name(name)
                if isinstance(content, bytes | bytearray):
                    encoded.append({"name": name, "b64": base64.b64encode(content).decode()})
                else:
                    encoded.append({"name": name, "text": str(content)})
            record = {
                "op": "finish_sweep", "ts": now_ms(), "sweep_id": sweep_id,
                "parent_run_id": parent_run_id, "status": str(status), "artifacts": encoded,
            }
            path = (
                self.outbox.sweep_path(sweep_id) if sweep_id is not None
                else self.outbox.run_path(parent_run_id or "_")
            )
            return bool(self._submit("finish_sweep", path, record))
        except Exception as exc:
            self._note_failure("finish_sweep", exc)
            return False

    def flush_outbox(self) -> int:
        """Replay queued records (ignores the circuit breaker); the number applied. Stops at the
        first transport failure and leaves the rest queued."""
        applied = 0
        try:
            with self.outbox.replaying() as mine:
                if not mine:
                    log.info("another process is replaying the MLflow outbox")
                    return 0
                for path in self.outbox.files():
                    n, stopped = self._replay(path)
                    applied += n
                    if stopped:
                        break
            if applied:
                log.info("replayed %d queued MLflow records", applied)
        except Exception as exc:
            self._note_failure("flush_outbox", exc)
        return applied

    def pending(self) -> int:
        """Records waiting in the outbox."""
        try:
            return self.outbox.pending()
        except Exception as exc:
            self._note_failure("pending", exc)
            return 0

    def run_id_for(self, trial_id: str) -> str | None:
        """The trial's MLflow run, once known to this Tracker (e.g. after a replay created it)."""
        ref = self._trials.get(str(trial_id))
        return ref.run_id if ref else None

    def open_trial_runs(self, sweep_id: str) -> dict[str, str] | None:
        """{run id: trial id} of the sweep's trial runs still marked RUNNING (e.g. attempts a
        dead coordinator left behind, some never recorded in the app DB); None if MLflow is
        away or the sweep is not in MLflow yet, so the caller can fall back on what it has."""
        try:
            if not self.available:
                return None
            experiment_id, _ = self._resolve_sweep(str(sweep_id), {})
            client, found, token = self._get_client(), {}, None
            while True:
                page = client.search_runs(
                    [experiment_id],
                    "tags.`hpt.role` = 'trial' and attributes.status = 'RUNNING'",
                    max_results=1000, page_token=token,
                )
                found.update({run.info.run_id: run.data.tags.get("hpt.trial_id", "")
                              for run in page})
                token = page.token
                if not token:
                    return found
        except _Unresolved:
            return None
        except Exception as exc:
            self._note_failure("open_trial_runs", exc)
            return None

    def sweep_ids_for(self, sweep_id: str) -> tuple[str, str] | None:
        """(experiment_id, parent_run_id) of the sweep, once known to this Tracker."""
        ref = self._sweeps.get(str(sweep_id))
        return ref.ids if ref else None

    @property
    def available(self) -> bool:
        """False while the circuit breaker is open after a transport failure."""
        return time.monotonic() >= self._down_until

    # -- plumbing ----------------------------------------------------------------------------

    def _prepare_sqlite(self, db: Path) -> None:
        try:
            db.parent.mkdir(parents=True, exist_ok=True)
            # WAL persists in the file: readers (mlflow ui) no longer block sweep writes.
            with contextlib.closing(sqlite3.connect(db, timeout=10)) as con:
                con.execute("PRAGMA journal_mode=WAL")
        except Exception as exc:
            log.warning("could not prepare %s for MLflow: %s", db, exc)

    def _get_client(self) -> Any:
        with self._client_lock:
            if self._client is None:
                from mlflow.tracking import MlflowClient  # heavy import, only when tracking

                try:
                    self._client = MlflowClient(self.tracking_uri)
                except Exception as exc:
                    # A store that cannot be opened (locked DB, bad URI) is "away": queue records.
                    raise ConnectionError(f"cannot open {self.tracking_uri}: {exc}") from exc
            return self._client

    def _count_error(self, what: str, exc: BaseException) -> None:
        with self._state:
            self.failures += 1
            self.last_error = f"{what}: {type(exc).__name__}: {str(exc)[:500]}"

    def _note_failure(self, what: str, exc: BaseException) -> None:
        self._count_error(what, exc)
        log.warning("MLflow %s failed: %s", what, self.last_error)

    def _reject(self, what: str, record: Any, exc: BaseException) -> None:
        """A record MLflow will never take: count it and park it in rejected.jsonl."""
        self._note_failure(what, exc)
        self.outbox.reject(record, str(exc)[:2000])

    def _trip(self, what: str, exc: BaseException) -> None:
        was_up = self.available
        self._down_until = time.monotonic() + self.retry_after_s
        self._count_error(what, exc)
        if was_up:  # one warning per outage, not one per call
            log.warning(
                "MLflow unreachable (%s); queueing records in %s for %.0f s",
                self.last_error, self.outbox.root, self.retry_after_s,
            )

    def _route(self, run_id: str | None, trial_id: str | None) -> tuple[str | None, str, Path]:
        """(run id if known, trial id, outbox file) for a trial-level record."""
        with self._state:
            if trial_id is None and run_id is not None:
                trial_id = self._run_to_trial.get(run_id)
            if trial_id is not None:
                trial_id = str(trial_id)
                ref = self._trials.setdefault(trial_id, _TrialRef(trial_id))
                run_id = run_id or ref.run_id
                return run_id, trial_id, self.outbox.trial_path(ref.sweep_id, trial_id)
        if run_id is None:
            raise ValueError("need run_id or trial_id")
        # A run started by another process: queue under its run id.
        return run_id, f"run:{run_id}", self.outbox.run_path(run_id)

    def _has_start(self, path: Path) -> bool:
        for line in self.outbox.read(path):
            with contextlib.suppress(ValueError):
                if json.loads(line).get("op") == "start_sweep":
                    return True
        return False

    def _auto_replay(self, path: Path) -> None:
        if not self.available:
            return
        with self.outbox.replaying() as mine:
            if mine:
                self._replay(path)

    def _submit(self, what: str, path: Path, record: dict[str, Any]) -> Any:
        """Apply now, or queue behind earlier records / while MLflow is away."""
        if path.exists():
            self._auto_replay(path)
        needs_run = record["op"] in ("log_metrics", "finish_trial") and not record.get("run_id")
        if needs_run:  # a replay may just have created the run
            ref = self._trials.get(record.get("trial_id") or "")
            record["run_id"] = ref.run_id if ref else None
            needs_run = not record["run_id"]
        if path.exists() or needs_run or not self.available:
            self.outbox.append(path, record)
            return None
        try:
            return self._apply(record, {})
        except _Unresolved as exc:
            log.info("MLflow %s queued: %s", what, exc)
            self.outbox.append(path, record)
        except Exception as exc:
            if _is_transient(exc):
                self._trip(what, exc)
                self.outbox.append(path, record)
            else:
                self._reject(what, record, exc)
        return None

    def _replay(self, path: Path) -> tuple[int, bool]:
        """Apply a file's records in order; (records applied, stopped on a transport error)."""
        applied = 0
        for _ in range(5):  # again while records keep arriving from other threads meanwhile
            n, stopped, gone = self._replay_once(path)
            applied += n
            if stopped or gone or n == 0:
                break
        return applied, stopped

    def _replay_once(self, path: Path) -> tuple[int, bool, bool]:
        lines = self.outbox.read(path)
        ctx: dict[str, Any] = {"replay": True}
        done = applied = 0
        stopped = False
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                self.outbox.reject(line, "unreadable outbox line")
                done += 1
                continue
            try:
                self._apply(record, ctx)
                applied += record.get("op") != "bind"
                self._down_until = 0.0  # MLflow answered: close the breaker
            except _Unresolved as exc:
                log.info("MLflow outbox %s waits: %s", path.name, exc)
                break
            except Exception as exc:
                if _is_transient(exc):
                    self._trip("replay", exc)
                    stopped = True
                    break
                self._reject("replay", record, exc)
            done += 1
        # Carry the ids resolved so far, so the rest does not create a second run.
        head = [{"op": "bind", **{k: v for k, v in ctx.items() if k != "replay"}}]
        gone = self.outbox.rewrite(path, done, head if len(ctx) > 1 else [])
        return applied, stopped, gone

    # -- applying records ----------------------------------------------------------------------

    def _apply(self, record: dict[str, Any], ctx: dict[str, Any]) -> Any:
        handler: Callable[[dict[str, Any], dict[str, Any]], Any] = {
            "start_sweep": self._apply_start_sweep,
            "start_trial": self._apply_start_trial,
            "log_metrics": self._apply_log_metrics,
            "finish_trial": self._apply_finish_trial,
            "finish_sweep": self._apply_finish_sweep,
            "bind": self._apply_bind,
        }[record["op"]]
        return handler(record, ctx)

    def _apply_bind(self, record: dict[str, Any], ctx: dict[str, Any]) -> bool:
        ctx.update({k: v for k, v in record.items() if k != "op" and v is not None})
        return True

    def _artifact_location(self, name: str, sweep_id: str) -> str | None:
        if not self.artifact_root:
            return None
        root = self.artifact_root
        if "://" in root:
            return f"{root.rstrip('/')}/{safe_name(name)}/{safe_name(sweep_id)}"
        return str(Path(root).expanduser().resolve() / safe_name(name) / safe_name(sweep_id))

    def _apply_start_sweep(self, record: dict[str, Any], ctx: dict[str, Any]) -> tuple[str, str]:
        from mlflow.exceptions import MlflowException

        client = self._get_client()
        sweep_id, name, ts = record["sweep_id"], record["name"], record["ts"]
        tags = mlflow_tags({**record.get("tags", {}), "hpt.sweep_id": sweep_id, "hpt.name": name})
        exp_name = f"hpt/{name}/{sweep_id}"
        exp = client.get_experiment_by_name(exp_name)
        if exp is None:
            try:
                experiment_id = client.create_experiment(
                    exp_name, artifact_location=self._artifact_location(name, sweep_id), tags=tags
                )
            except MlflowException as exc:  # another coordinator won the race
                if getattr(exc, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
                    raise
                exp = client.get_experiment_by_name(exp_name)
                experiment_id = exp.experiment_id
        else:
            experiment_id = exp.experiment_id
            if exp.lifecycle_stage == "deleted":
                client.restore_experiment(experiment_id)
        parent = None
        if exp is not None:  # resuming: reuse the sweep's parent run rather than add one
            parent = self._find_parent_run(experiment_id)
        params = mlflow_params(flatten(record.get("spec") or {}))
        if parent is None:
            parent = client.create_run(
                experiment_id, start_time=ts, run_name=name,
                tags={**tags, "hpt.role": "sweep", "hpt.status": "running"},
            )
        else:
            client.update_run(parent.info.run_id, status="RUNNING")
            old = parent.data.params
            changed = sorted(k for k in params if k in old and old[k] != params[k])
            if changed:  # MLflow params are immutable: keep the first values, say so
                log.warning("sweep %s spec changed on resume (%s...)", sweep_id, changed[:5])
            params = {k: v for k, v in params.items() if k not in old}
        parent_run_id = parent.info.run_id
        # The ids are what the caller needs; a rejected param must not cost them.
        self._tolerant("start_sweep params", lambda: self._log_batch(
            parent_run_id, params=params, tags={"hpt.status": "running"}))
        spec_text = json.dumps(record.get("spec") or {}, indent=2, sort_keys=True, default=str)
        self._tolerant("start_sweep artifact", lambda: client.log_text(
            parent_run_id, spec_text, "sweep_spec.json"))
        self._bind_sweep(sweep_id, experiment_id, parent_run_id, name=name)
        ctx.update(sweep_id=sweep_id, experiment_id=experiment_id, parent_run_id=parent_run_id)
        return experiment_id, parent_run_id

    def _find_parent_run(self, experiment_id: str) -> Any:
        """The sweep's parent run in its experiment, or None."""
        found = self._get_client().search_runs(
            [experiment_id], "tags.`hpt.role` = 'sweep'", max_results=1
        )
        return found[0] if found else None

    def _bind_sweep(
        self, sweep_id: str, experiment_id: str, parent_run_id: str, name: str | None = None,
    ) -> None:
        with self._state:
            ref = self._sweeps.setdefault(sweep_id, _SweepRef(sweep_id))
            ref.experiment_id, ref.parent_run_id = experiment_id, parent_run_id
            if name is not None:
                ref.name = name
            self._parent_to_sweep[parent_run_id] = sweep_id

    def _resolve_sweep(self, sweep_id: str | None, ctx: dict[str, Any]) -> tuple[str, str]:
        if ctx.get("experiment_id") and ctx.get("parent_run_id"):
            return ctx["experiment_id"], ctx["parent_run_id"]
        if sweep_id is None:
            raise _Unresolved("record names neither a sweep nor its runs")
        ref = self._sweeps.get(sweep_id)
        if ref and ref.ids:
            return ref.ids
        client = self._get_client()
        if not _quotable(sweep_id):
            raise _Unresolved(f"cannot search for sweep id {sweep_id!r}")
        exps = client.search_experiments(filter_string=f"tags.`hpt.sweep_id` = '{sweep_id}'")
        for exp in exps:
            parent = self._find_parent_run(exp.experiment_id)
            if parent is not None:
                self._bind_sweep(sweep_id, exp.experiment_id, parent.info.run_id)
                return exp.experiment_id, parent.info.run_id
        raise _Unresolved(f"sweep {sweep_id} is not in MLflow yet")

    def _apply_start_trial(self, record: dict[str, Any], ctx: dict[str, Any]) -> str:
        client = self._get_client()
        trial_id, arm, spec = record["trial_id"], record["arm"], record.get("spec") or {}
        sweep_id = record.get("sweep_id")
        experiment_id, parent_run_id = record.get("experiment_id"), record.get("parent_run_id")
        if not (experiment_id and parent_run_id):
            experiment_id, parent_run_id = self._resolve_sweep(sweep_id, ctx)
        if sweep_id is None:
            sweep_id = self._sweep_of_parent(parent_run_id)
        run_id = None
        if ctx.get("replay") and _quotable(trial_id):
            # A replay that crashed before rewriting its file may have created this run; the
            # start time pins the attempt (a retried trial keeps its id but gets a new run).
            found = client.search_runs(
                [experiment_id],
                f"tags.`hpt.trial_id` = '{trial_id}' and attributes.start_time = {record['ts']}",
                max_results=1,
            )
            run_id = found[0].info.run_id if found else None
        if run_id is None:
            tags = {
                "mlflow.parentRunId": parent_run_id, "hpt.trial_id": trial_id,
                "hpt.sweep_id": sweep_id or "", "hpt.arm": arm, "hpt.status": "running",
                "hpt.role": "trial",
            }
            run = client.create_run(
                experiment_id, start_time=record["ts"], tags=tags, run_name=run_name(arm, spec)
            )
            run_id = run.info.run_id
            params = mlflow_params(flatten(spec))
            self._tolerant("start_trial params", lambda: self._log_batch(run_id, params=params))
        with self._state:
            ref = self._trials.setdefault(trial_id, _TrialRef(trial_id))
            ref.run_id, ref.sweep_id = run_id, sweep_id or ref.sweep_id
            self._run_to_trial[run_id] = trial_id
        ctx.update(run_id=run_id, experiment_id=experiment_id, parent_run_id=parent_run_id)
        return run_id

    def _sweep_of_parent(self, parent_run_id: str) -> str | None:
        sweep_id = self._parent_to_sweep.get(parent_run_id)
        if sweep_id is None:  # sweep started by an earlier coordinator process
            tags = self._get_client().get_run(parent_run_id).data.tags
            sweep_id = tags.get("hpt.sweep_id")
            if sweep_id:
                with self._state:
                    self._parent_to_sweep[parent_run_id] = sweep_id
        return sweep_id

    def _resolve_run(self, record: dict[str, Any], ctx: dict[str, Any]) -> str:
        run_id = record.get("run_id") or ctx.get("run_id")
        trial_id = record.get("trial_id")
        if not run_id and trial_id:
            ref = self._trials.get(trial_id)
            run_id = ref.run_id if ref else None
            if not run_id and ref is not None and ref.sweep_id is not None and _quotable(trial_id):
                experiment_id, _ = self._resolve_sweep(ref.sweep_id, {})
                found = self._get_client().search_runs(
                    [experiment_id], f"tags.`hpt.trial_id` = '{trial_id}'", max_results=1
                )
                run_id = found[0].info.run_id if found else None
        if not run_id:
            raise _Unresolved(f"no MLflow run for trial {trial_id} yet")
        ctx["run_id"] = run_id
        return run_id

    def _curve_metrics(
        self, run_id: str, points: list[dict[str, Any]], ts: int
    ) -> tuple[list[Any], dict[str, int]]:
        """New (metric, step) values of a curve and the high-water marks they would set."""
        from mlflow.entities import Metric

        seen = self._logged.get(run_id, {})
        marks: dict[str, int] = {}
        metrics = []
        for point in points:
            if point.get("step") is None:
                continue
            step = int(point["step"])
            for key in CURVE_METRICS:
                value = to_float(point.get(key))
                if value is None or step <= seen.get(key, -1):
                    continue
                metrics.append(Metric(key, value, ts, step))
                marks[key] = max(marks.get(key, -1), step)
        return metrics, marks

    def _log_metric_batches(self, run_id: str, metrics: list[Any]) -> None:
        for i in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            chunk = metrics[i : i + MAX_METRICS_PER_BATCH]
            self._get_client().log_batch(run_id, metrics=chunk, synchronous=True)
            with self._state:  # only what MLflow accepted counts as logged
                seen = self._logged.setdefault(run_id, {})
                for m in chunk:
                    seen[m.key] = max(seen.get(m.key, -1), m.step)

    def _apply_log_metrics(self, record: dict[str, Any], ctx: dict[str, Any]) -> bool:
        run_id = self._resolve_run(record, ctx)
        metrics, _ = self._curve_metrics(run_id, record.get("points") or [], record["ts"])
        self._log_metric_batches(run_id, metrics)
        return True

    def _log_batch(
        self, run_id: str, params: Mapping[str, str] | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> None:
        from mlflow.entities import Param, RunTag

        p = [Param(k, v) for k, v in (params or {}).items()]
        t = [RunTag(k, v) for k, v in mlflow_tags(tags or {}).items()]
        if p or t:  # MLflow splits params/tags into its own 100-entity requests
            self._get_client().log_batch(run_id, params=p, tags=t, synchronous=True)

    def _tolerant(self, what: str, fn: Callable[[], Any]) -> bool:
        """Run one step of a multi-step record; a rejection spoils only that step (False)."""
        try:
            fn()
        except Exception as exc:
            if _is_transient(exc) or _run_gone(exc):
                raise
            self._note_failure(what, exc)
            return False
        return True

    def _apply_finish_trial(self, record: dict[str, Any], ctx: dict[str, Any]) -> bool:
        from mlflow.entities import Metric

        run_id = self._resolve_run(record, ctx)
        result, status, ts = record.get("result") or {}, record["status"], record["ts"]
        table = result.get("param_table") or {}
        tags = {"hpt.status": status}
        if result.get("error"):
            tags["hpt.error"] = str(result["error"])[-ERROR_TAIL:]
        if not self._tolerant("finish_trial params", lambda: self._log_batch(
                run_id, params=table_params(table), tags=tags)):
            # e.g. a second finish with other values: params are immutable, the status is not
            self._tolerant("finish_trial tags", lambda: self._log_batch(run_id, tags=tags))
        curve = list(result.get("curve") or [])
        metrics, marks = self._curve_metrics(run_id, curve, ts)
        last = max((int(p["step"]) for p in curve if p.get("step") is not None), default=0)
        final_step = int(result.get("steps") or last)
        for key in FINAL_METRICS:
            value = to_float(result.get(key))
            # "tokens" is also a curve metric: do not log a second value at the same step.
            if value is None or final_step <= max(marks.get(key, -1),
                                                  self._logged.get(run_id, {}).get(key, -1)):
                continue
            metrics.append(Metric(key, value, ts, final_step))
        self._tolerant("finish_trial metrics", lambda: self._log_metric_batches(run_id, metrics))
        if table:
            text = json.dumps(table, indent=2, sort_keys=True, default=str)
            self._tolerant("finish_trial artifact", lambda: self._get_client().log_text(
                run_id, text, "param_table.json"))
        run_status = _run_status(status)
        self._tolerant("finish_trial status", lambda: self._get_client().set_terminated(
            run_id, run_status, end_time=ts))
        with self._state:
            self._logged.pop(run_id, None)
        return True

    def _apply_finish_sweep(self, record: dict[str, Any], ctx: dict[str, Any]) -> bool:
        parent_run_id = record.get("parent_run_id") or ctx.get("parent_run_id")
        if not parent_run_id:
            _, parent_run_id = self._resolve_sweep(record.get("sweep_id"), ctx)
        client = self._get_client()
        artifacts = record.get("artifacts") or []
        if artifacts:
            with tempfile.TemporaryDirectory(prefix="hpt-mlflow-") as tmp:
                for item in artifacts:
                    dest = Path(tmp) / _check_artifact_name(item["name"])
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    if "b64" in item:
                        dest.write_bytes(base64.b64decode(item["b64"]))
                    else:
                        dest.write_text(item.get("text", ""), encoding="utf-8")
                client.log_artifacts(parent_run_id, tmp)  # one upload for all of them
        status = record["status"]
        self._tolerant("finish_sweep tags", lambda: self._log_batch(
            parent_run_id, tags={"hpt.status": status}))
        self._tolerant("finish_sweep status", lambda: client.set_terminated(
            parent_run_id, _run_status(status), end_time=record["ts"]))
        return True


def _check_artifact_name(name: str) -> Path:
    rel = Path(name)
    if not name or rel.is_absolute() or ".." in rel.parts:
        raise ValueError(f"artifact name {name!r} must be a relative path inside the run")
    return rel


def _run_status(status: str) -> str:
    run_status = RUN_STATUS.get(status.lower())
    if run_status is None:
        log.warning("unknown status %r: MLflow run marked FINISHED", status)
        return "FINISHED"
    return run_status
