"""Service settings, read from the environment.

Everything defaults to one data directory (`HPT_HOME`, else `./.hpt`) holding three separate
SQLite databases: the app's, Optuna's and MLflow's. They must stay separate databases because
all three use an `alembic_version` table and MLflow and Optuna both have `trials`-like tables.
Any URL can point at a server (PostgreSQL, an `mlflow server`) instead.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hptransfer.redaction import remember_url_secrets


@dataclass(frozen=True)
class EnvVar:
    """One environment variable this package reads: its name, its default in words and what it
    sets. Documentation only (the docs' reference page is generated from `ENVIRONMENT`); the
    functions below read the variables."""

    name: str
    default: str
    meaning: str


# Every variable the package reads, in one place; tests/test_docs.py checks that each HPT_*
# name in the code is listed here.
ENVIRONMENT: tuple[EnvVar, ...] = (
    EnvVar("HPT_HOME", "`./.hpt`",
           "data directory: `hpt.db`, `optuna.db`, `mlflow.db`, `mlartifacts/`, `cache/`, `data/`"),
    EnvVar("HPT_DATABASE_URL", "SQLite in `HPT_HOME`",
           "the app database, e.g. `postgresql://user:pw@host/hpt`"),
    EnvVar("HPT_OPTUNA_URL", "SQLite in `HPT_HOME`", "Optuna's storage (a database of its own)"),
    EnvVar("MLFLOW_TRACKING_URI", "SQLite in `HPT_HOME`",
           "MLflow tracking: a database of its own or an `mlflow server` URL"),
    EnvVar("RAY_ADDRESS", "an in-process local cluster", "join an existing Ray cluster"),
    EnvVar("RAY_AUTH_TOKEN", "none",
           "the Ray cluster's token; with `RAY_ADDRESS` set, token auth is turned on"),
    EnvVar("RAY_AUTH_TOKEN_PATH", "`~/.ray/auth_token`", "a file holding the Ray cluster's token"),
    EnvVar("HPT_API_TOKEN", "none",
           "bearer token the server requires on every mutating call and every read (unless "
           "`HPT_PUBLIC_READS`), and the client sends"),
    EnvVar("HPT_HOST", "`127.0.0.1`", "where `hpt serve` listens"),
    EnvVar("HPT_PORT", "`8600`", "the port `hpt serve` listens on"),
    EnvVar("HPT_URL", "`http://127.0.0.1:8600`",
           "the server the Python client, the `hpt` commands and `hpt doctor` talk to"),
    EnvVar("HPT_MAX_TRIALS", "`5000`", "cap on the trials one sweep may expand to"),
    EnvVar("HPT_DATA_ROOTS", "none",
           "more directories (`:`-separated, absolute) that `data.source` may point into, "
           "besides `$HPT_HOME/data` and the embedded corpus (`stdlib`)"),
    EnvVar("HPT_MAX_REQUEST_BYTES", "`1048576`", "largest request body (413 past it)"),
    EnvVar("HPT_MAX_HEADER_BYTES", "`65536`",
           "largest request line plus headers (431 past it, the rest unread)"),
    EnvVar("HPT_MAX_HEADERS", "`100`", "most header lines a request may carry (431 past it)"),
    EnvVar("HPT_HEADER_TIMEOUT_S", "`10`",
           "seconds a client has to send a request's headers (408, connection closed)"),
    EnvVar("HPT_BODY_TIMEOUT_S", "`30`",
           "seconds a client has to send a request's body once its headers arrived"),
    EnvVar("HPT_AUTH_FAILURES", "`10`",
           "wrong or missing tokens one client address may send in a minute before it is "
           "answered 429 (Retry-After) for the rest of that minute"),
    EnvVar("HPT_CACHE_MAX_GB", "`4`",
           "what the data cache (`$HPT_HOME/cache`: tokenized corpora, BPE tokenizers) may "
           "hold; past it the least recently used entries go (rebuilt the same if asked for "
           "again; none used in the last 10 minutes)"),
    EnvVar("HPT_MAX_TRIAL_MEMORY_GB", "none",
           "refuse a sweep whose estimated per-trial memory exceeds this (the largest Ray "
           "node's memory, or this host's, always applies; on GPUs the largest GPU's)"),
    EnvVar("HPT_MAX_TRIAL_FLOPS", "`1e16` on CPUs, `1e21` on GPUs",
           "refuse a sweep whose per-trial training FLOPs exceed this"),
    EnvVar("HPT_MAX_TRIAL_HOURS", "`168`",
           "a trial attempt still training after this many hours stops, failed, saying so"),
    EnvVar("HPT_MAX_SWEEP_HOURS", "`720`",
           "a sweep still running this many hours after it started fails, saying so; its "
           "running trials are cancelled"),
    EnvVar("HPT_CHECKPOINT_URL", "`HPT_HOME/checkpoints`",
           "where trials checkpoint: a directory (shared by every node on a multi-node "
           "cluster, e.g. NFS) or an object store URI pyarrow opens (`s3://bucket/prefix`)"),
    EnvVar("HPT_MAX_TRIAL_STEPS", "`1000000`",
           "refuse a sweep whose trials would train more optimizer steps than this"),
    EnvVar("HPT_MAX_SWEEP_FLOPS", "`1e18` on CPUs, `1e22` on GPUs",
           "refuse a sweep whose trials together (every trial it can plan) would train more "
           "FLOPs than this"),
    EnvVar("HPT_MAX_SWEEP_DEVICE_HOURS", "`100`",
           "a sweep whose estimated device-hours (`hpt plan`: GPU-hours, on CPUs CPU-hours) "
           "exceed this is refused unless submitted with `--confirm-cost` "
           "(`confirm_cost=true`)"),
    EnvVar("HPT_PUBLIC_READS", "`0`",
           "`1`: with `HPT_API_TOKEN` set, reads (GETs: listings, trials, fits at the "
           "default bootstrap, dashboards) stay open to clients without the token"),
    EnvVar("HPT_RAY_REQUIRE", "none",
           "resource labels (comma or space separated) some alive Ray node must carry; "
           "`/health` fails while none does (`scripts/cluster_up.sh` sets `hpt_worker`)"),
    EnvVar("HPT_COMPILE", "`1`",
           "`torch.compile`: `1` on CUDA and for CPU runs long enough to repay it, `all` "
           "always, `0` never (read on the worker)"),
)


class SettingsError(ValueError):
    """An environment variable holds a value that cannot be used."""


def _env(name: str) -> str | None:
    # An empty variable counts as unset, so `HPT_X= hpt ...` falls back to the default.
    value = os.environ.get(name, "").strip()
    return value or None


def token_problem(token: str) -> str | None:
    """Why `token` cannot travel as a bearer token (HTTP headers carry printable ASCII), or
    None: one rule for the server that holds it and the client that sends it."""
    if not token.isprintable():
        return "has a control character in it (a line break?)"
    if not token.isascii():
        return "has a non-ASCII character in it; tokens are ASCII"
    return None


# What a token served beyond loopback must hold: 128 bits, as 22 base64url characters or
# 32 hex digits do (secrets.token_urlsafe(16), secrets.token_hex(16)).
MIN_TOKEN_BITS = 128
MAKE_TOKEN = 'python -c "import secrets; print(secrets.token_urlsafe(32))"'
_HEX = frozenset("0123456789abcdef")


def token_bits(token: str) -> float:
    """A generous estimate of a token's entropy: its length times log2 of the alphabet its
    character classes span (hex digits 16; digits 10, lower 26, upper 26, punctuation 32
    added up), and no more than 8 bits for a token of under 8 distinct characters (aaaa...,
    abab...)."""
    if len(set(token)) < 8:
        return min(8.0, float(len(token)))
    if token.isdigit():
        alphabet = 10
    elif set(token.lower()) <= _HEX and (token.islower() or token.isupper()):
        alphabet = 16
    else:
        alphabet = sum(size for test, size in ((str.isdigit, 10), (str.islower, 26),
                                               (str.isupper, 26)) if any(map(test, token)))
        alphabet += 32 if any(not c.isalnum() for c in token) else 0
    return len(token) * math.log2(alphabet)


def token_strength_problem(token: str) -> str | None:
    """Why `token` is too weak to guard a server others can reach, or None."""
    bits = token_bits(token)
    if bits >= MIN_TOKEN_BITS:
        return None
    return (f"HPT_API_TOKEN is too weak to serve beyond this machine: about {bits:.0f} bits, "
            f"{MIN_TOKEN_BITS} needed (e.g. 22 random base64url characters or 32 random hex "
            f"digits). Make one with: {MAKE_TOKEN}")


def _env_token(name: str) -> str | None:
    """A bearer token a client can send (a server holding another could never be called by
    `hpt`, which refuses to send one)."""
    value = _env(name)
    problem = token_problem(value) if value is not None else None
    if problem:
        raise SettingsError(f"{name} must be printable ASCII (letters, digits, punctuation): "
                            f"it {problem}")
    return value


def _env_float(name: str, default: float | None) -> float | None:
    raw = _env(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name} must be a number, got {raw!r}") from None
    if not (value > 0 and value != float("inf")):
        raise SettingsError(f"{name} must be a positive finite number, got {raw!r}")
    return value


def _env_int(name: str, default: int, minimum: int = 1, maximum: int | None = None) -> int:
    raw = _env(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise SettingsError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise SettingsError(f"{name} must be <= {maximum}, got {value}")
    return value


def _env_flag(name: str) -> bool:
    """A yes/no variable: 1/true/yes or 0/false/no (unset: no)."""
    raw = (_env(name) or "0").lower()
    if raw not in ("0", "1", "true", "false", "yes", "no"):
        raise SettingsError(f"{name} must be 1 or 0, got {raw!r}")
    return raw in ("1", "true", "yes")


DEFAULT_MAX_REQUEST_BYTES = 1 << 20


def max_request_bytes() -> int:
    """$HPT_MAX_REQUEST_BYTES: the largest request body the server reads (413 past it), and
    so the largest spec file the client reads (one of 200 MB took 89 s and 620 MB to be
    refused)."""
    return _env_int("HPT_MAX_REQUEST_BYTES", DEFAULT_MAX_REQUEST_BYTES, minimum=1024)


# Admission's ceilings when HPT_MAX_TRIAL_FLOPS / HPT_MAX_SWEEP_FLOPS are unset, by the device
# a sweep trains on: a CPU does ~1e11 FLOP/s on these models (1e16: about a day), a GPU
# ~1e14-1e15 (examples/gpu_study.yaml, the paper's scale, needs 3.3e20 a trial, 2.6e21 in all).
DEFAULT_MAX_TRIAL_FLOPS = {"cpu": 1e16, "gpu": 1e21}
DEFAULT_MAX_SWEEP_FLOPS = {"cpu": 1e18, "gpu": 1e22}


@dataclass(frozen=True)
class Settings:
    home: Path
    database_url: str
    optuna_url: str
    mlflow_uri: str
    mlflow_artifacts: Path
    ray_address: str | None
    api_token: str | None
    host: str
    port: int
    max_trials: int
    cache_dir: Path
    # Where `data.source` paths may point (resolved); see `data_roots_from`.
    data_roots: tuple[Path, ...] = ()
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    # The HTTP edge (api/edge.py): a request's head, and the time to send head and body.
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    # 401s one client address may earn a minute before its calls are answered 429
    auth_failures: int = 10
    # Admission caps per trial; None leaves only the memory of the largest worker.
    max_trial_flops: float | None = None  # None: DEFAULT_MAX_TRIAL_FLOPS for the device
    max_trial_memory_gb: float | None = None
    max_sweep_flops: float | None = None  # None: DEFAULT_MAX_SWEEP_FLOPS for the device
    max_trial_steps: int = 1_000_000
    # a sweep priced above this (hpt plan) needs confirm_cost to be queued
    max_sweep_device_hours: float = 100.0
    # with api_token set: GETs served without it too (a public dashboard)
    public_reads: bool = False
    # wall-time ceilings: a trial attempt's training, a sweep from its start
    max_trial_hours: float = 168.0
    max_sweep_hours: float = 720.0
    # where trials checkpoint (workers/checkpoints.py); "": `checkpoints` under home
    checkpoint_url: str = ""

    @property
    def checkpoint_root(self) -> str:
        return self.checkpoint_url or str(self.home / "checkpoints")

    @property
    def home_dirs(self) -> tuple[Path, ...]:
        """The data directory and the sub-folders it must hold."""
        return (self.home, self.cache_dir, self.mlflow_artifacts)

    def ensure_dirs(self) -> Settings:
        """Create the data directory and its sub-folders (call before using the defaults);
        a SettingsError naming HPT_HOME when it is no writable directory."""
        for path in self.home_dirs:
            ensure_writable_dir(path)
        return self

    def redacted(self) -> dict[str, Any]:
        """Settings as plain values, safe to print or log (the API token is masked)."""
        out = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}
        if self.api_token:
            out["api_token"] = "***"
        return out


def dir_problem(path: Path) -> str | None:
    """Why `path` cannot be (made) a directory this process writes in, or None. Nothing is
    created: it, or its nearest parent that exists, must be a writable directory. The one
    check of HPT_HOME and its folders, the data cache, a local checkpoint store and a local
    MLflow file store."""
    existing = next(p for p in (path, *path.parents) if os.path.lexists(p))
    if not existing.is_dir():
        return (f"{path} is a file, not a directory" if existing == path else
                f"{existing} is a file, so {path} cannot be created under it")
    if not os.access(existing, os.W_OK | os.X_OK):
        read_only = os.statvfs(existing).f_flag & os.ST_RDONLY
        why = "on a read-only file system" if read_only else "not writable by this user"
        return f"{existing} is {why}"
    return None


def ensure_writable_dir(path: Path, variable: str = "HPT_HOME") -> Path:
    """Create `path` (and its parents), or raise a SettingsError naming `variable`."""
    problem = dir_problem(path)
    if problem is None:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # raced, or a check os.access cannot see (ACLs, quotas)
            problem = f"{path} cannot be created: {exc}"
    if problem:
        raise SettingsError(f"{variable} cannot be used: {problem}; set {variable} to a "
                            "writable directory")
    return path


def home_dir() -> Path:
    """$HPT_HOME, else ./.hpt; absolute, so URLs and caches do not depend on a later working
    directory (Ray workers may run elsewhere)."""
    return Path(_env("HPT_HOME") or ".hpt").expanduser().resolve()


DEFAULT_CACHE_MAX_GB = 4.0


def cache_max_bytes() -> float:
    """What the data cache ($HPT_HOME/cache: tokenized corpora, BPE tokenizers) may hold
    before its least recently used entries go: $HPT_CACHE_MAX_GB, default 4."""
    return (_env_float("HPT_CACHE_MAX_GB", DEFAULT_CACHE_MAX_GB) or DEFAULT_CACHE_MAX_GB) * 1e9


def data_roots_from(home: Path) -> tuple[Path, ...]:
    """`$HPT_HOME/data` plus every directory in $HPT_DATA_ROOTS (os.pathsep-separated),
    resolved. The embedded corpus (source 'stdlib') is always allowed besides these."""
    roots = [home / "data"]
    for part in (_env("HPT_DATA_ROOTS") or "").split(os.pathsep):
        if part.strip():
            path = Path(part.strip())
            if not path.is_absolute():
                raise SettingsError(f"HPT_DATA_ROOTS entries must be absolute paths, got {part!r}")
            roots.append(path)
    return tuple(dict.fromkeys(r.resolve() for r in roots))


def client_url(default: str) -> str:
    """$HPT_URL (the API the Python client and the CLI talk to), else `default`."""
    return _env("HPT_URL") or default


def client_token() -> str | None:
    """$HPT_API_TOKEN as the client sends it."""
    return _env("HPT_API_TOKEN")


RAY_REQUIRE_ENV = "HPT_RAY_REQUIRE"


def ray_required_resources() -> list[str]:
    """$HPT_RAY_REQUIRE: resource labels some alive Ray node must carry (comma or space
    separated, e.g. `hpt_worker`); /health fails while none does."""
    return (_env(RAY_REQUIRE_ENV) or "").replace(",", " ").split()


COMPILE_MODES = ("0", "1", "all")  # never; CUDA and long CPU runs (the default); always


def compile_mode() -> str:
    """$HPT_COMPILE (read on the worker): 0 = never torch.compile; 1 (the default) = on CUDA,
    and on the CPU for trials and packs long enough to repay it
    (`workers/compiling.compile_wanted`); all = always, short CPU runs included."""
    mode = _env("HPT_COMPILE") or "1"
    if mode not in COMPILE_MODES:
        raise SettingsError(f"HPT_COMPILE={mode!r}: use one of {', '.join(COMPILE_MODES)}")
    return mode


def check_worker_settings() -> None:
    """Raise SettingsError for a bad value of a variable that trials read ($HPT_COMPILE,
    $HPT_CACHE_MAX_GB) before any work starts."""
    cache_max_bytes()
    compile_mode()


_DATABASE_URL = re.compile(r"^[A-Za-z][A-Za-z0-9_]*(\+[A-Za-z0-9_]+)?://")


def _env_database_url(name: str) -> str | None:
    """A database URL (dialect[+driver]://...) from `name`, or None when unset; anything
    else is a SettingsError naming the variable (it failed deep in the server's start-up,
    after Ray had started, as a traceback naming neither)."""
    value = _env(name)
    if value is not None and not _DATABASE_URL.match(value):
        raise SettingsError(
            f"{name} is not a database URL (it does not start dialect://; its value is not "
            "shown, it may hold a password); give one such as "
            "postgresql://user:password@host:5432/db or sqlite:////path/to/file.db")
    if value is not None and sqlite_in_memory(value):
        raise SettingsError(
            f"{name}={value} is an in-memory SQLite database: every sweep and result would "
            "be gone when the process ends; give a file, e.g. sqlite:////path/to/file.db")
    return value


def _env_mlflow_uri() -> str | None:
    value = _env("MLFLOW_TRACKING_URI")
    if value is not None and sqlite_in_memory(value):  # the mirror's runs would vanish
        raise SettingsError(
            f"MLFLOW_TRACKING_URI={value} is an in-memory SQLite store: every run logged "
            "would be gone when the process ends; give a file, e.g. sqlite:////path/mlflow.db")
    return value


def sqlite_in_memory(url: Any) -> bool:
    """Whether a database URL (text or SQLAlchemy's URL) names an in-memory SQLite database
    (sqlite://, sqlite:///, :memory:, or SQLite's URI form file::memory: / mode=memory)."""
    if not str(url).lower().startswith("sqlite"):
        return False
    from sqlalchemy.engine import make_url  # only for SQLite URLs: a ~0.1 s import

    try:
        parsed = make_url(url)
    except Exception:  # not parseable: connecting fails and says so
        return False
    database = parsed.database or ""
    return (database in ("", ":memory:") or database.startswith("file::memory:")
            or parsed.query.get("mode") == "memory")


def get_settings() -> Settings:
    """Read the settings from the environment now (no caching, so tests can monkeypatch it).
    Variables only workers read are checked here too: a bad value is one clear error when
    the server, the demo or `hpt doctor` starts, not a failure of some trials later."""
    home = home_dir()
    check_worker_settings()
    settings = Settings(
        home=home,
        database_url=_env_database_url("HPT_DATABASE_URL") or f"sqlite:///{home / 'hpt.db'}",
        optuna_url=_env_database_url("HPT_OPTUNA_URL") or f"sqlite:///{home / 'optuna.db'}",
        mlflow_uri=_env_mlflow_uri() or f"sqlite:///{home / 'mlflow.db'}",
        mlflow_artifacts=home / "mlartifacts",
        ray_address=_env("RAY_ADDRESS"),
        api_token=_env_token("HPT_API_TOKEN"),
        host=_env("HPT_HOST") or "127.0.0.1",
        port=_env_int("HPT_PORT", 8600, maximum=65535),
        max_trials=_env_int("HPT_MAX_TRIALS", 5000),
        cache_dir=home / "cache",
        data_roots=data_roots_from(home),
        max_request_bytes=max_request_bytes(),
        max_header_bytes=_env_int("HPT_MAX_HEADER_BYTES", 64 * 1024, minimum=1024),
        max_headers=_env_int("HPT_MAX_HEADERS", 100, minimum=10),
        header_timeout_s=_env_float("HPT_HEADER_TIMEOUT_S", 10.0) or 10.0,
        body_timeout_s=_env_float("HPT_BODY_TIMEOUT_S", 30.0) or 30.0,
        auth_failures=_env_int("HPT_AUTH_FAILURES", 10),
        max_trial_flops=_env_float("HPT_MAX_TRIAL_FLOPS", None),
        max_trial_memory_gb=_env_float("HPT_MAX_TRIAL_MEMORY_GB", None),
        max_sweep_flops=_env_float("HPT_MAX_SWEEP_FLOPS", None),
        max_trial_steps=_env_int("HPT_MAX_TRIAL_STEPS", 1_000_000),
        max_sweep_device_hours=_env_float("HPT_MAX_SWEEP_DEVICE_HOURS", 100.0) or 100.0,
        public_reads=_env_flag("HPT_PUBLIC_READS"),
        checkpoint_url=_env("HPT_CHECKPOINT_URL") or "",
        max_trial_hours=_env_float("HPT_MAX_TRIAL_HOURS", 168.0) or 168.0,
        max_sweep_hours=_env_float("HPT_MAX_SWEEP_HOURS", 720.0) or 720.0,
    )
    # a driver's error may quote a piece of a password as a host name: masked wherever shown
    remember_url_secrets(settings.database_url, settings.optuna_url, settings.mlflow_uri,
                         _env("HPT_URL"))
    return settings


def prepare_ray_environment() -> None:
    """Clusters started with `ray start` (Ray >= 2.5x) use token auth, but a connecting
    driver defaults to none, and Ray reads RAY_AUTH_MODE once, at import. So before Ray is
    imported: when joining a cluster (RAY_ADDRESS) and a token is available, turn it on."""
    if not _env("RAY_ADDRESS") or _env("RAY_AUTH_MODE"):
        return
    token_file = Path(_env("RAY_AUTH_TOKEN_PATH") or "~/.ray/auth_token").expanduser()
    if _env("RAY_AUTH_TOKEN") or token_file.exists():
        os.environ["RAY_AUTH_MODE"] = "token"
