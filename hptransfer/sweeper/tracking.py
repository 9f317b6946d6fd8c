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
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import re
import sqlite3
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

try:  # cross-process locking of the outbox; absent on Windows (threads are still locked)
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

# MLflow's limits (mlflow.utils.validation); checked here so one long value cannot sink a batch.
MAX_PARAM_VALUE = 6000
MAX_KEY = 250
MAX_TAG_VALUE = 8000
MAX_METRICS_PER_BATCH = 1000
ERROR_TAIL = 4000

CURVE_METRICS = ("train_loss", "val_loss", "lr", "tokens")
FINAL_METRICS = (
    "final_val_loss", "final_train_loss", "flops", "flops_per_token", "tokens", "tokens_per_s",
    "wall_time_s", "mfu", "params_non_embedding", "params_embedding",
)
RUN_STATUS = {
    "completed": "FINISHED", "pruned": "FINISHED", "diverged": "FINISHED",
    "finished": "FINISHED", "done": "FINISHED",
    "failed": "FAILED", "error": "FAILED",
    "cancelled": "KILLED", "canceled": "KILLED", "killed": "KILLED",
}
# MLflow error codes that mean "this record is wrong", not "MLflow is away": never retried.
# Every other MlflowException, OSError (connection, timeout) or database error is transient.
REJECTED_CODES = frozenset({
    "INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS", "RESOURCE_DOES_NOT_EXIST",
    "INVALID_STATE", "BAD_REQUEST",
})
_KEY_BAD_CHARS = re.compile(r"[^\w.\- :]")  # MLflow allows these plus "/", which we avoid
_FILE_BAD_CHARS = re.compile(r"[^\w.\-]")


# ------------------------------------------------------------------------------------------
# helpers


def normalize_tracking_uri(uri: str) -> str:
    """A bare `*.db` path becomes an absolute sqlite URI; anything else is returned as is."""
    if "://" not in uri and uri.endswith((".db", ".sqlite", ".sqlite3")):
        return f"sqlite:///{Path(uri).expanduser().resolve()}"
    return uri


def sqlite_path(uri: str) -> Path | None:
    """The database file of a file-backed `sqlite:///` URI (None for other stores)."""
    if not uri.startswith("sqlite:///"):
        return None
    raw = unquote(uri[len("sqlite:///"):].split("?", 1)[0])
    if not raw or raw == ":memory:":
        return None
    return Path(raw).expanduser().resolve()


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


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested mapping -> {"a.b.c": "value"}; lists of mappings are indexed, other lists JSON."""
    out: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            if value:
                out.update(flatten(value, name + "."))
            else:
                out[name] = "{}"
        elif isinstance(value, list | tuple) and value and all(
            isinstance(v, Mapping) for v in value
        ):
            for i, item in enumerate(value):
                out.update(flatten(item, f"{name}.{i}."))
        elif isinstance(value, list | tuple):
            out[name] = json.dumps(list(value), default=str)
        else:
            out[name] = str(value)
    return out


def mlflow_key(key: str) -> str:
    """A key MLflow accepts: allowed characters only, at most 250 characters (hash-suffixed)."""
    key = _KEY_BAD_CHARS.sub("_", key) or "_"
    if key in (".", "..") or key.startswith(".."):
        key = "_" + key
    if len(key) > MAX_KEY:
        # Keep keys unique after truncation: two long keys may share their first 240 chars.
        key = key[: MAX_KEY - 9] + "-" + hashlib.sha1(key.encode()).hexdigest()[:8]
    return key


def _truncate(value: str, limit: int) -> str:
    marker = "...[truncated]"
    return value if len(value) <= limit else value[: limit - len(marker)] + marker


def mlflow_params(flat: Mapping[str, Any]) -> dict[str, str]:
    """Keys and values cut to MLflow's limits (key 250, value 6000 characters)."""
    return {mlflow_key(k): _truncate(str(v), MAX_PARAM_VALUE) for k, v in flat.items()}


def _float(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _now_ms() -> int:
    return int(time.time() * 1000)


def _safe_name(text: str) -> str:
    """File-name-safe and injective: a short hash is added whenever characters were replaced."""
    safe = _FILE_BAD_CHARS.sub("_", text)[:80] or "_"
    if safe != text:
        safe += "-" + hashlib.sha1(text.encode()).hexdigest()[:8]
    return safe


def run_name(arm: str, spec: Mapping[str, Any]) -> str:
    lr = _float(spec.get("lr"))
    lr_text = f"{lr:.3g}" if lr is not None else "?"
    return (
        f"{arm} N={spec.get('width', '?')} L={spec.get('depth', '?')} "
        f"lr={lr_text} seed={spec.get('seed', '?')}"
    )


def table_params(table: Mapping[str, Any]) -> dict[str, str]:
    """The param table as params: group.<name>.{lr,weight_decay,eps,init,init_std,n_params},
    mult.{residual,logits,attn_scale}, table.{parameterization,alpha,m_width,m_depth}."""
    out: dict[str, Any] = {}
    for key in ("parameterization", "alpha", "m_width", "m_depth"):
        if key in table:
            out[f"table.{key}"] = table[key]
    for group in table.get("groups") or []:
        name = group.get("name", "?")
        for key in ("lr", "weight_decay", "eps", "init", "init_std"):
            if key in group:
                out[f"group.{name}.{key}"] = group[key]
        out[f"group.{name}.n_params"] = len(group.get("params") or [])  # tensors in the group
    for key, value in (table.get("multipliers") or {}).items():
        out[f"mult.{key}"] = value
    return mlflow_params(out)


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
# outbox


class Outbox:
    """JSON-lines files under one directory, safe across threads and (POSIX) processes.

    Appends take a short exclusive lock on `.append.lock`; a replay holds `.replay.lock`
    (non-blocking: one replayer at a time) and rewrites a file only under the append lock,
    keeping whatever was appended meanwhile.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().resolve()
        self._thread_locks = {".append.lock": threading.Lock(), ".replay.lock": threading.Lock()}

    @contextlib.contextmanager
    def _locked(self, name: str, blocking: bool = True) -> Iterator[bool]:
        tlock = self._thread_locks[name]
        if not tlock.acquire(blocking):
            yield False
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root / name, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if fcntl is not None:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
                    except BlockingIOError:
                        yield False
                        return
                yield True
            finally:
                os.close(fd)  # closing releases the flock
        finally:
            tlock.release()

    def replaying(self) -> contextlib.AbstractContextManager[bool]:
        return self._locked(".replay.lock", blocking=False)

    def sweep_path(self, sweep_id: str | None) -> Path:
        return self.root / _safe_name(sweep_id or "_nosweep") / "sweep.jsonl"

    def trial_path(self, sweep_id: str | None, trial_id: str) -> Path:
        folder = self.root / _safe_name(sweep_id or "_nosweep")
        return folder / f"trial-{_safe_name(trial_id)}.jsonl"

    def run_path(self, run_id: str) -> Path:
        return self.root / "_runs" / f"run-{_safe_name(run_id)}.jsonl"

    def append(self, path: Path, record: Mapping[str, Any]) -> None:
        line = json.dumps(record, default=str, allow_nan=True) + "\n"
        with self._locked(".append.lock"):
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(line)

    def read(self, path: Path) -> list[str]:
        with self._locked(".append.lock"):
            try:
                return path.read_text(encoding="utf-8").splitlines()
            except FileNotFoundError:
                return []

    def rewrite(self, path: Path, consumed: int, head: list[dict[str, Any]]) -> bool:
        """Drop the first `consumed` lines, prepend `head` if anything is left; True if gone."""
        with self._locked(".append.lock"):
            try:
                lines = path.read_text(encoding="utf-8").splitlines()
            except FileNotFoundError:
                return True
            rest = lines[consumed:]
            if not rest:
                path.unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    path.parent.rmdir()  # only when empty
                return True
            text = "".join(json.dumps(h, default=str) + "\n" for h in head)
            text += "".join(line + "\n" for line in rest)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)
            return False

    def files(self) -> list[Path]:
        """Pending files, each sweep's own file before its trials' (trials need the sweep)."""
        if not self.root.is_dir():
            return []
        out: list[Path] = []
        for folder in sorted(p for p in self.root.iterdir() if p.is_dir()):
            files = sorted(folder.glob("*.jsonl"), key=lambda p: (p.name != "sweep.jsonl", p.name))
            out.extend(files)
        return out

    def pending(self) -> int:
        return sum(len(self.read(p)) for p in self.files())

    def reject(self, record: Any, error: str) -> None:
        entry = {"ts": _now_ms(), "error": error, "record": record}
        self.append(self.root / "rejected.jsonl", entry)


# ------------------------------------------------------------------------------------------
# tracker


@dataclass
class _SweepRef:
    sweep_id: str
    name: str | None = None
    experiment_id: str | None = None
    parent_run_id: str | None = None


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
            if ref.experiment_id and ref.parent_run_id:
                return ref.experiment_id, ref.parent_run_id
            path = self.outbox.sweep_path(sweep_id)
            if path.exists():
                self._auto_replay(path)
                if ref.experiment_id and ref.parent_run_id:
                    return ref.experiment_id, ref.parent_run_id
                if self._has_start(path):
                    return None  # already queued: a coordinator retrying must not pile up copies
            record = {
                "op": "start_sweep", "ts": _now_ms(), "sweep_id": sweep_id, "name": name,
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
                "op": "start_trial", "ts": _now_ms(), "sweep_id": sweep_id, "trial_id": trial_id,
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
                "op": "log_metrics", "ts": _now_ms(), "run_id": run_id, "trial_id": trial_id,
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
                "op": "finish_trial", "ts": _now_ms(), "run_id": run_id, "trial_id": trial_id,
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
                "op": "finish_sweep", "ts": _now_ms(), "sweep_id": sweep_id,
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

    def sweep_ids_for(self, sweep_id: str) -> tuple[str, str] | None:
        ref = self._sweeps.get(str(sweep_id))
        if ref and ref.experiment_id and ref.parent_run_id:
            return ref.experiment_id, ref.parent_run_id
        return None

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

    def _note_failure(self, what: str, exc: BaseException) -> None:
        with self._state:
            self.failures += 1
            self.last_error = f"{what}: {type(exc).__name__}: {str(exc)[:500]}"
        log.warning("MLflow %s failed: %s", what, self.last_error)

    def _trip(self, what: str, exc: BaseException) -> None:
        was_up = self.available
        self._down_until = time.monotonic() + self.retry_after_s
        with self._state:
            self.failures += 1
            self.last_error = f"{what}: {type(exc).__name__}: {str(exc)[:500]}"
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
                self._note_failure(what, exc)
                self.outbox.reject(record, str(exc)[:2000])
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
                self._note_failure("replay", exc)
                self.outbox.reject(record, str(exc)[:2000])
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
            return f"{root.rstrip('/')}/{_safe_name(name)}/{_safe_name(sweep_id)}"
        return str(Path(root).expanduser().resolve() / _safe_name(name) / _safe_name(sweep_id))

    def _apply_start_sweep(self, record: dict[str, Any], ctx: dict[str, Any]) -> tuple[str, str]:
        from mlflow.exceptions import MlflowException

        client = self._get_client()
        sweep_id, name, ts = record["sweep_id"], record["name"], record["ts"]
        tags = {**record.get("tags", {}), "hpt.sweep_id": sweep_id, "hpt.name": name}
        tags = {mlflow_key(k): _truncate(str(v), MAX_TAG_VALUE) for k, v in tags.items()}
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
            found = client.search_runs(
                [experiment_id], "tags.`hpt.role` = 'sweep'", max_results=1
            )
            parent = found[0] if found else None
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
        with self._state:
            ref = self._sweeps.setdefault(sweep_id, _SweepRef(sweep_id))
            ref.name, ref.experiment_id, ref.parent_run_id = name, experiment_id, parent_run_id
            self._parent_to_sweep[parent_run_id] = sweep_id
        ctx.update(sweep_id=sweep_id, experiment_id=experiment_id, parent_run_id=parent_run_id)
        return experiment_id, parent_run_id

    def _resolve_sweep(self, sweep_id: str | None, ctx: dict[str, Any]) -> tuple[str, str]:
        if ctx.get("experiment_id") and ctx.get("parent_run_id"):
            return ctx["experiment_id"], ctx["parent_run_id"]
        if sweep_id is None:
            raise _Unresolved("record names neither a sweep nor its runs")
        ref = self._sweeps.get(sweep_id)
        if ref and ref.experiment_id and ref.parent_run_id:
            return ref.experiment_id, ref.parent_run_id
        client = self._get_client()
        if not _quotable(sweep_id):
            raise _Unresolved(f"cannot search for sweep id {sweep_id!r}")
        exps = client.search_experiments(filter_string=f"tags.`hpt.sweep_id` = '{sweep_id}'")
        for exp in exps:
            runs = client.search_runs(
                [exp.experiment_id], "tags.`hpt.role` = 'sweep'", max_results=1
            )
            if runs:
                with self._state:
                    ref = self._sweeps.setdefault(sweep_id, _SweepRef(sweep_id))
                    ref.experiment_id, ref.parent_run_id = exp.experiment_id, runs[0].info.run_id
                    self._parent_to_sweep[ref.parent_run_id] = sweep_id
                return exp.experiment_id, runs[0].info.run_id
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
                value = _float(point.get(key))
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
        t = [
            RunTag(mlflow_key(k), _truncate(str(v), MAX_TAG_VALUE))
            for k, v in (tags or {}).items()
        ]
        if p or t:  # MLflow splits params/tags into its own 100-entity requests
            self._get_client().log_batch(run_id, params=p, tags=t, synchronous=True)

    def _tolerant(self, what: str, fn: Callable[[], Any]) -> None:
        """Run one step of a multi-step record; a rejection spoils only that step."""
        try:
            fn()
        except Exception as exc:
            if _is_transient(exc) or _run_gone(exc):
                raise
            self._note_failure(what, exc)

    def _apply_finish_trial(self, record: dict[str, Any], ctx: dict[str, Any]) -> bool:
        from mlflow.entities import Metric

        run_id = self._resolve_run(record, ctx)
        result, status, ts = record.get("result") or {}, record["status"], record["ts"]
        table = result.get("param_table") or {}
        tags = {"hpt.status": status}
        if result.get("error"):
            tags["hpt.error"] = str(result["error"])[-ERROR_TAIL:]
        try:
            self._log_batch(run_id, params=table_params(table), tags=tags)
        except Exception as exc:
            if _is_transient(exc) or _run_gone(exc):
                raise
            # e.g. a second finish with other values: params are immutable, the status is not
            self._note_failure("finish_trial params", exc)
            self._tolerant("finish_trial tags", lambda: self._log_batch(run_id, tags=tags))
        curve = list(result.get("curve") or [])
        metrics, marks = self._curve_metrics(run_id, curve, ts)
        last = max((int(p["step"]) for p in curve if p.get("step") is not None), default=0)
        final_step = int(result.get("steps") or last)
        for key in FINAL_METRICS:
            value = _float(result.get(key))
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
