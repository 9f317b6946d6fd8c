"""Health of every component the coordinator depends on: one `Check` per component.

`hpt doctor` runs them from the coordinator's settings (a process of its own); `GET /health`
runs the same ones inside the server, against the connections it holds, plus a comparison
with the MLflow store it started with (a deleted or replaced `mlflow.db` shows up). Every
URL in a check's text has its credentials masked.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import hptransfer
from hptransfer.config import (
    RAY_REQUIRE_ENV,
    Settings,
    SettingsError,
    client_token,
    dir_problem,
    ray_required_resources,
)
from hptransfer.contracts.status import HealthState
from hptransfer.redaction import first_line, mask_url, remember_url_secrets
from hptransfer.store.engine import current_revision, make_engine, packaged_head, probe_write
from hptransfer.tracking.params import (
    file_store_path,
    normalize_tracking_uri,
    sqlite_path,
    sqlite_store_file,
)
from hptransfer.workers.checkpoints import (
    ACCEPTED,
    LOCAL_SCHEMES,
    checkpoint_url_problem,
    root_problem,
)

HTTP_TIMEOUT_S = 5.0
PROBE_TTL_S = 2.0  # how long GET /health reuses a probe of an external component
PROBE_TIMEOUT_S = 60.0  # a busy node needs a few seconds to start a worker process


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str | None = None  # what to do when it failed

    def line(self) -> str:
        text = f"{'ok  ' if self.ok else 'FAIL'}  {self.name:<10} {self.detail}"
        return text if self.ok or not self.fix else f"{text}\n      -> {self.fix}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _short(exc: BaseException) -> str:
    """The exception's first line, credentials masked (httpx quotes the URL it called)."""
    return f"{type(exc).__name__}: {first_line(str(exc))}"[:300]


# ------------------------------------------------------------------------------ databases


def check_database(url: str, engine: Any | None = None) -> Check:
    """The app database answers, its schema is at the packaged Alembic head, and it takes a
    write (rolled back): a read-only one reads fine but can store no sweep or result."""
    shown = mask_url(url)
    head = packaged_head()
    own = engine is None
    try:
        try:
            engine = engine or make_engine(url)
            rev = current_revision(engine)
        except Exception as exc:
            return Check("database", False, f"{shown} unreachable ({_short(exc)})",
                         "start the database server or fix HPT_DATABASE_URL")
        if rev != head:
            return Check("database", False,
                         f"{shown} at revision {rev}, this package needs {head}",
                         "start `hpt serve` once with this package version (it migrates on "
                         "start) or install the version that wrote the database")
        try:
            probe_write(engine)
        except Exception as exc:
            return Check("database", False, f"{shown} cannot be written ({_short(exc)})",
                         "make the database writable (file and directory permissions, a "
                         "read-only mount or a full disk; PostgreSQL: a primary, not a "
                         "read-only standby or default_transaction_read_only)")
    finally:
        if own and engine is not None:
            engine.dispose()
    return Check("database", True, f"{shown} (migrations at head {head}, writable)")


# seconds a database may take to accept a health check's connection
PING_TIMEOUT_S = 5


def _ping(url: str) -> None:
    """One round trip to a database URL; raises when it cannot be reached."""
    engine = make_engine(url, connect_timeout_s=PING_TIMEOUT_S)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    finally:
        engine.dispose()


def unreachable(url: str) -> str | None:
    """Why the database at `url` does not answer (one line, credentials masked), or None:
    `hpt serve` asks before it starts Ray, `hpt doctor` and /health of Optuna's."""
    try:
        _ping(url)
    except Exception as exc:
        return _short(exc)
    return None


def check_optuna(url: str) -> Check:
    shown = mask_url(url)
    problem = unreachable(url)
    if problem:
        return Check("optuna", False, f"{shown} unreachable ({problem})",
                     "start the database server or fix HPT_OPTUNA_URL")
    return Check("optuna", True, f"{shown} reachable")


# ------------------------------------------------------------------------------ folders


def check_home(settings: Settings) -> Check:
    """HPT_HOME and its folders are (or can be made) writable directories."""
    problems = [p for p in map(dir_problem, settings.home_dirs) if p]
    if problems:
        return Check("home", False, problems[0], "set HPT_HOME to a writable directory")
    return Check("home", True, f"{settings.home} writable")


def check_service(settings: Settings) -> Settings:
    """What a coordinator needs before Ray or MLflow start, else one SettingsError: a
    writable data directory and a checkpoint store its trials can open."""
    settings.ensure_dirs()
    problem = checkpoint_url_problem(settings.checkpoint_url)
    if problem:
        raise SettingsError(problem)
    return settings


def check_checkpoints(settings: Settings) -> Check:
    """The checkpoint store the trials will open (a remote one by its scheme only: opening
    it needs its credentials, which the workers hold)."""
    url = settings.checkpoint_url
    problem = root_problem(url) if url else None
    if problem:
        return Check("checkpoint", False, f"HPT_CHECKPOINT_URL={mask_url(url)} {problem}",
                     f"set HPT_CHECKPOINT_URL to {ACCEPTED} (unset: HPT_HOME/checkpoints)")
    root = settings.checkpoint_root
    remote = "://" in root and root.split("://", 1)[0].lower() not in LOCAL_SCHEMES
    return Check("checkpoint", True, mask_url(root) + (" (remote: opened by the trials)"
                                                         if remote else ""))


# ------------------------------------------------------------------------------ MLflow


def _server_identity(uri: str) -> str | None:
    """A server's default experiment: created once per backend store."""
    import httpx

    try:
        r = httpx.get(f"{uri.rstrip('/')}/api/2.0/mlflow/experiments/get",
                      params={"experiment_id": "0"}, timeout=HTTP_TIMEOUT_S)
        r.raise_for_status()
        exp = r.json()["experiment"]
    except Exception:
        return None
    return f"{exp.get('creation_time')}:{exp.get('artifact_location')}"


class MlflowStoreWatch:
    """Remembers which MLflow store the coordinator started with. A SQLite file is held
    open, so a deleted one is seen (link count 0) and its inode number cannot be reused by a
    file re-created at the same path; a server is known by its default experiment."""

    def __init__(self, uri: str) -> None:
        self.uri = normalize_tracking_uri(uri)
        self._db = sqlite_path(self.uri)
        self._fd: int | None = None
        self._server: str | None = None
        self.remember()

    def remember(self) -> None:
        """Take the baseline if there is none yet (MLflow may have been away at start)."""
        if self._db is not None and self._fd is None:
            try:
                self._fd = os.open(self._db, os.O_RDONLY)
            except OSError:
                pass
        elif self.uri.startswith(("http://", "https://")) and self._server is None:
            self._server = _server_identity(self.uri)

    def same(self) -> bool:
        if self._fd is not None:
            held = os.fstat(self._fd)
            try:
                now = os.stat(self._db)
            except OSError:
                return False
            return held.st_nlink > 0 and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)
        if self._server is not None:
            return _server_identity(self.uri) in (None, self._server)  # None: unreachable
        return True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def check_mlflow(uri: str, artifacts: Path | None = None,
                 started_with: MlflowStoreWatch | None = None) -> Check:
    """The tracking store answers, its version matches ours (major), artifacts are reachable,
    and (inside the server) it is still the store the coordinator started with."""
    import mlflow

    uri = normalize_tracking_uri(uri)
    shown = mask_url(uri)
    db = sqlite_path(uri)
    if db is not None:
        if not db.exists():
            return Check("mlflow", False, f"{shown}: the database file is gone",
                         "restore the file from a backup or restart `hpt serve` to start a "
                         "new store (the app DB keeps every result; the mirror copies them again)")
        detail = f"{shown} (SQLite, mlflow {mlflow.__version__})"
        root = artifacts or db.parent / "mlartifacts"
        if not os.access(root if root.exists() else root.parent, os.W_OK):
            return Check("mlflow", False, f"{detail}: artifacts folder {root} not writable",
                         "fix the permissions of the artifacts folder")
    elif uri.startswith(("http://", "https://")):
        import httpx

        base = uri.rstrip("/")
        try:
            version = httpx.get(f"{base}/version", timeout=HTTP_TIMEOUT_S)
            version.raise_for_status()
            server = version.text.strip()
        except Exception as exc:
            return Check("mlflow", False, f"{shown} unreachable ({_short(exc)})",
                         "start the MLflow server or fix MLFLOW_TRACKING_URI")
        ours = mlflow.__version__
        if server.split(".")[0] != ours.split(".")[0]:
            return Check("mlflow", False, f"{shown} runs mlflow {server}, this client {ours}",
                         f"run an MLflow {ours.split('.')[0]}.x server")
        try:  # proxied artifact access (`mlflow server --artifacts-destination`)
            r = httpx.get(f"{base}/api/2.0/mlflow-artifacts/artifacts", timeout=HTTP_TIMEOUT_S)
            r.raise_for_status()
        except Exception as exc:
            return Check("mlflow", False, f"{shown} (mlflow {server}): artifact proxy not "
                         f"available ({_short(exc)})",
                         "start the server with --artifacts-destination (artifact serving on)")
        detail = f"{shown} (server mlflow {server}, artifacts proxied)"
    elif (store := file_store_path(uri)) is not None:  # MLflow's file store: a directory
        problem = dir_problem(store)
        if problem:
            return Check("mlflow", False, f"{shown} (a file store): {problem}",
                         "make that directory writable or point MLFLOW_TRACKING_URI at "
                         "another store (the default: a SQLite file in HPT_HOME)")
        state = "" if store.is_dir() else ", created on first use"
        detail = f"{shown} (file store{state}, mlflow {mlflow.__version__})"
    else:  # a database URL: MLflow opens it itself
        try:
            _ping(uri)
        except Exception as exc:
            return Check("mlflow", False, f"{shown} unreachable ({_short(exc)})",
                         "start the database server or fix MLFLOW_TRACKING_URI")
        detail = f"{shown} (mlflow {mlflow.__version__})"
    if started_with is not None:
        started_with.remember()
        if not started_with.same():
            return Check("mlflow", False, f"{detail}: not the store the coordinator started "
                         "with (deleted, replaced or re-created)",
                         "restart `hpt serve` so it writes to the store that exists now")
    return Check("mlflow", True, detail)


# ------------------------------------------------------------------------------ Ray


def _node_key(node: dict[str, Any]) -> tuple:
    res = node.get("Resources") or {}
    labels = tuple(sorted(k for k in res if not k.startswith(("node:", "accelerator_type"))
                          and k not in ("CPU", "GPU", "memory", "object_store_memory")))
    return (node.get("NodeManagerAddress"), labels, res.get("CPU", 0), res.get("GPU", 0))


def _describe(node: dict[str, Any]) -> str:
    res = node.get("Resources") or {}
    labels = [k for k in _node_key(node)[1]]
    head = " head" if "node:__internal_head__" in res else ""
    text = (f"{node.get('NodeManagerAddress')} {str(node.get('NodeID'))[:8]}{head}: "
            f"{res.get('CPU', 0):g} CPU, "
            f"{res.get('GPU', 0):g} GPU")
    return text + (f" [{', '.join(labels)}]" if labels else "")


def check_ray_nodes(nodes: list[dict[str, Any]], address: str | None) -> Check:
    """Alive nodes and their resources; a dead node not replaced by a node with the same
    address and labels fails the check (a worker host went away)."""
    where = address or "in-process local cluster"
    alive = [n for n in nodes if n.get("Alive")]
    alive_keys = {_node_key(n) for n in alive}
    lost = [n for n in nodes if not n.get("Alive") and _node_key(n) not in alive_keys]
    summary = "; ".join(_describe(n) for n in alive)
    if lost:
        return Check("ray", False, f"{where}: node lost: {', '.join(_describe(n) for n in lost)}"
                     f" (alive: {summary})",
                     "restart the lost node (`ray start --address=HEAD:PORT ...`) on its host")
    # Ray forgets a node that left; the resource labels the deployment expects say it is gone
    want = ray_required_resources()
    missing = [x for x in want if not any(x in (n.get("Resources") or {}) for n in alive)]
    if missing:
        return Check("ray", False, f"{where}: no alive node with {', '.join(missing)} "
                     f"({RAY_REQUIRE_ENV}); alive: {summary}",
                     "start (or restart) that worker: `ray start --address=HEAD:PORT "
                     "--resources=...`")
    if not any((n.get("Resources") or {}).get("CPU") for n in alive):
        return Check("ray", False, f"{where}: no node with CPUs ({summary})",
                     "start a worker: `ray start --address=HEAD:PORT`")
    return Check("ray", True, f"{where}: {len(alive)} nodes ({summary})")


def _probe_node(roots: list[str], cache_dir: str) -> dict[str, Any]:
    """Runs on one Ray node: what the trials there will see."""
    import socket

    import hptransfer as pkg

    seen = {r: os.path.isdir(r) and os.access(r, os.R_OK) for r in roots}
    cache = Path(cache_dir)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        cache_ok = os.access(cache, os.W_OK)
    except OSError:
        cache_ok = False
    return {"host": socket.gethostname(), "version": pkg.__version__,
            "python": "{}.{}".format(*sys.version_info[:2]), "roots": seen, "cache": cache_ok}


def data_roots(settings: Settings) -> list[Path]:
    """Where sweeps may read data from: the settings' roots where configured, else
    $HPT_HOME/data (the embedded corpus ships inside the package)."""
    roots = getattr(settings, "data_roots", None) or (settings.home / "data",)
    return [Path(r) for r in roots]


def probe_nodes(settings: Settings, nodes: list[dict[str, Any]],
                timeout: float = PROBE_TIMEOUT_S) -> list[Check]:
    """Package version and data visibility on every alive node (a zero-CPU task pinned to
    each node). Returns the `workers` and `data` checks."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # a root the coordinator does not have either holds nothing to read: not checked
    roots = [str(r) for r in data_roots(settings) if r.is_dir()]
    probe = ray.remote(num_cpus=0, max_retries=0)(_probe_node)
    alive = [n for n in nodes if n.get("Alive")]
    refs = {probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        n["NodeID"], soft=False)).remote(roots, str(settings.cache_dir)): n for n in alive}
    ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
    ours, py = hptransfer.__version__, "{}.{}".format(*sys.version_info[:2])
    bad_pkg, bad_data, seen = [], [], []
    for ref, node in refs.items():
        name = _describe(node).split(":")[0]
        if ref not in ready:
            bad_pkg.append(f"{name}: no answer in {timeout:.0f}s")
            continue
        try:
            out = ray.get(ref)
        except Exception as exc:
            bad_pkg.append(f"{name}: {_short(exc)}")
            continue
        seen.append(f"{name} {out['version']}")
        if out["version"] != ours or out["python"] != py:
            bad_pkg.append(f"{name}: hptransfer {out['version']} python {out['python']}")
        missing = [r for r, ok in out["roots"].items() if not ok]
        if missing:
            bad_data.append(f"{name} cannot read {', '.join(missing)}")
        if not out["cache"]:
            bad_data.append(f"{name} cannot write the cache {settings.cache_dir}")
    for ref in refs:
        if ref not in ready:
            ray.cancel(ref, force=True)
    workers = (Check("workers", False, f"coordinator has hptransfer {ours}, python {py}; "
                     + "; ".join(bad_pkg),
                     "install the coordinator's hptransfer version (and Python) on every node")
               if bad_pkg else
               Check("workers", True, f"hptransfer {ours}, python {py} on all {len(seen)} nodes"))
    data = (Check("data", False, "; ".join(bad_data),
                  "mount the data roots and HPT_HOME/cache at the same paths on every node "
                  "(or set HPT_DATA_ROOTS to what the workers see)")
            if bad_data else
            Check("data", True, f"{', '.join(roots) or 'no data roots'} and the cache "
                  "visible on every node"))
    return [workers, data]


# ------------------------------------------------------------------------------ doctor


def _health_status(reply: Any) -> str | None:
    """The overall status of an hptransfer /health reply, or None for any other body."""
    try:
        body = reply.json()
    except ValueError:
        return None
    status = body.get("status") if isinstance(body, dict) else None
    known = isinstance(status, str) and status in {state.value for state in HealthState}
    return status if known and isinstance(body.get("components"), list) else None


def check_api(url: str) -> Check:
    """The coordinator's API answers /health (its own report is in `components` there),
    asked with $HPT_API_TOKEN when set: a wrong token shows up here as a 401."""
    import httpx

    shown = mask_url(url)
    remember_url_secrets(url)  # httpx's error may quote a piece of its password
    token = client_token()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        r = httpx.get(f"{url.rstrip('/')}/health", headers=headers, timeout=HTTP_TIMEOUT_S)
    except Exception as exc:
        return Check("api", False, f"{shown} unreachable ({_short(exc)})",
                     "start `hpt serve` (see its log) or fix HPT_URL")
    if r.status_code == 401:
        return Check("api", False, f"{shown} refuses this HPT_API_TOKEN (401)",
                     "set HPT_API_TOKEN to the server's token")
    status = _health_status(r)
    if status is None:  # another server, a proxy's page: not "ok" because it answered 200
        kind = r.headers.get("content-type", "no content type").split(";")[0]
        return Check("api", False, f"{shown} answers {r.status_code} ({kind}) with no "
                     "hptransfer health report", "is HPT_URL the hptransfer API? fix HPT_URL")
    if r.status_code != 200:
        return Check("api", False, f"{shown} answers {r.status_code} ({status})",
                     "see GET /health and the server log")
    return Check("api", True, f"{shown} answers ({status})")


def _ray_checks(settings: Settings, deep: bool, connect: bool) -> list[Check]:
    import ray

    if not ray.is_initialized():
        if not connect:
            return [Check("ray", False, "not initialised", "restart `hpt serve`")]
        if not settings.ray_address:
            return [Check("ray", True, "no RAY_ADDRESS: `hpt serve` starts an in-process "
                          "cluster on this machine"), *_local_checks(settings)]
        from .ray_join import join_ray

        try:  # (importing hptransfer.coordinator prepared Ray's token auth)
            join_ray(settings.ray_address, log_to_driver=False, configure_logging=False,
                     logging_level="error")
        except Exception as exc:
            return [Check("ray", False, f"{settings.ray_address} unreachable ({_short(exc)})",
                          "start the Ray head, join this host with `ray start --address=HEAD:"
                          "PORT --num-cpus=0`, or fix RAY_ADDRESS (and RAY_AUTH_TOKEN)")]
    try:
        nodes = ray.nodes()
    except Exception as exc:
        return [Check("ray", False, f"cluster state unavailable ({_short(exc)})",
                      "check the Ray head is running")]
    checks = [check_ray_nodes(nodes, settings.ray_address)]
    if deep:
        checks += probe_nodes(settings, nodes)
    return checks


def _local_checks(settings: Settings) -> list[Check]:
    out = _probe_node([str(r) for r in data_roots(settings) if r.is_dir()],
                      str(settings.cache_dir))
    missing = [r for r, ok in out["roots"].items() if not ok]
    ok = not missing and out["cache"]
    return [Check("data", ok, "data roots and cache visible" if ok else
                  f"cannot read {', '.join(missing) or '-'}; cache writable: {out['cache']}",
                  None if ok else "create the data roots / fix their permissions")]


class ProbeCache:
    """The results of probes of external components (Optuna storage, an MLflow server or
    database, the Ray cluster) reused for `ttl_s` seconds: a /health polled by many clients
    costs one round trip per component per interval, not one per request. Concurrent
    misses of one probe wait for a single run of it."""

    def __init__(self, ttl_s: float = PROBE_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._results: dict[str, tuple[float, list[Check]]] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def __call__(self, name: str, probe: Callable[[], list[Check]]) -> list[Check]:
        with self._guard:
            lock = self._locks.setdefault(name, threading.Lock())
        with lock:
            hit = self._results.get(name)
            if hit is not None and time.monotonic() - hit[0] <= self.ttl_s:
                return hit[1]
            checks = probe()
            self._results[name] = (time.monotonic(), checks)
            return checks


def _uncached(_name: str, probe: Callable[[], list[Check]]) -> list[Check]:
    return probe()


def run_checks(settings: Settings, *, deep: bool = True, connect_ray: bool = True,
               use_ray: bool = True, engine: Any | None = None,
               mlflow_started_with: MlflowStoreWatch | None = None,
               extra: Iterable[Callable[[], Check]] = (),
               probes: ProbeCache | None = None) -> list[Check]:
    """Every component's check, in dependency order (`use_ray=False`: an API-only server).

    With `probes`, the checks that go over the network (Optuna, MLflow unless it is a local
    SQLite file, Ray without `deep`) may come from its cache; the app database, a local
    MLflow file and the `extra` checks always run now."""
    cached = probes or _uncached
    local_mlflow = sqlite_store_file(settings.mlflow_uri) is not None

    def mlflow() -> list[Check]:
        return [check_mlflow(settings.mlflow_uri, settings.mlflow_artifacts,
                             mlflow_started_with)]

    def ray_checks() -> list[Check]:
        return _ray_checks(settings, deep, connect_ray)

    checks = [
        check_database(settings.database_url, engine),
        check_home(settings),
        check_checkpoints(settings),
        *cached("optuna", lambda: [check_optuna(settings.optuna_url)]),
        *(mlflow() if local_mlflow else cached("mlflow", mlflow)),
        *((ray_checks() if deep else cached("ray", ray_checks)) if use_ray
          else [Check("ray", True, "not used (no dispatcher)")]),
    ]
    checks += [fn() for fn in extra]
    return checks
