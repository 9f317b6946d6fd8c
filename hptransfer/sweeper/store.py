"""Persistence of sweeps and trials: SQLAlchemy 2 models, schema managed by Alembic.

Every public method of `Store` runs its own short transaction and returns plain dicts (or a
DataFrame), never live ORM objects, so a Store can be shared by the API's threads and the
dispatcher's. The same code runs on SQLite (the embedded default) and PostgreSQL.

Concurrency: several coordinators may lease from one database. On PostgreSQL the lease query
locks its rows with `FOR UPDATE SKIP LOCKED`; on SQLite every write transaction starts with
`BEGIN IMMEDIATE`, which takes the database's single write lock before reading, so two
read-then-write transactions can never interleave (and never fail half-way with "database is
locked": the busy timeout makes the second one wait instead).
"""

from __future__ import annotations

import json
import math
import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import numpy as np
import pandas as pd
from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    Select,
    String,
    Text,
    UniqueConstraint,
    case,
    create_engine,
    event,
    func,
    insert,
    inspect,
    or_,
    select,
    update,
)
from sqlalchemy.engine import URL, Connection, CursorResult, Engine, make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker
from sqlalchemy.pool import StaticPool
from sqlalchemy.types import TypeDecorator

SWEEP_STATUSES: tuple[str, ...] = ("pending", "running", "completed", "cancelled", "failed")
TRIAL_STATUSES: tuple[str, ...] = (
    "pending", "running", "completed", "diverged", "failed", "cancelled", "pruned",
)
ACTIVE_STATUSES: tuple[str, ...] = ("pending", "running")
FINISHED_STATUSES: frozenset[str] = frozenset(TRIAL_STATUSES) - set(ACTIVE_STATUSES)
# Sweeps whose pending trials may be leased; a failed/cancelled sweep runs nothing more.
LEASABLE_SWEEP_STATUSES: tuple[str, ...] = ("pending", "running")

DEFAULT_LEASE_SECONDS = 6 * 3600  # a lease is renewed by its coordinator; this is a backstop
SQLITE_BUSY_TIMEOUT_MS = 30_000
_CHUNK = 500  # rows / IN-list items per statement, well inside every driver's limits
_IMMEDIATE = "hpt_sqlite_immediate"  # execution option marking a write transaction

# Columns of results_frame(), in order; the analysis package consumes exactly this frame.
RESULT_FRAME_COLUMNS: tuple[str, ...] = (
    "trial_id", "arm", "arch", "parameterization", "width", "depth", "lr", "sigma_base",
    "seed", "status", "final_val_loss", "flops", "tokens", "params_non_embedding",
    "params_embedding", "wall_time_s", "reused",
)
_FRAME_DTYPES: dict[str, Any] = {
    **dict.fromkeys(("trial_id", "arm", "arch", "parameterization", "status"), object),
    **dict.fromkeys(("width", "depth", "seed"), "int64"),
    # tokens/params are counts, but float so rows without a result can hold NaN
    **dict.fromkeys(
        ("lr", "sigma_base", "final_val_loss", "flops", "tokens", "params_non_embedding",
         "params_embedding", "wall_time_s"),
        "float64",
    ),
    "reused": bool,
}

# Result fields copied into their own columns (typed, filterable, cheap to read).
_RESULT_FLOATS = ("final_val_loss", "flops", "wall_time_s")
_RESULT_INTS = ("tokens", "params_non_embedding", "params_embedding")
RESULT_COLUMNS: tuple[str, ...] = (*_RESULT_FLOATS, *_RESULT_INTS)

MIGRATIONS_DIR = Path(__file__).resolve().with_name("migrations")
# Alembic keeps the running migration's context in module globals: one command per process.
_MIGRATE_LOCK = threading.Lock()


class StoreError(Exception):
    """A request the store cannot satisfy (bad status, adding to a finished sweep, ...)."""


class NotFoundError(StoreError, LookupError):
    """No sweep or trial with that id."""


class PlannedTrial(Protocol):
    """One planned grid point, as produced by the planner (read-only attributes)."""

    @property
    def arm(self) -> str: ...
    @property
    def trial(self) -> Any: ...  # a TrialSpec (or a plain dict of its JSON dump)
    @property
    def width(self) -> int: ...
    @property
    def depth(self) -> int: ...
    @property
    def lr(self) -> float: ...
    @property
    def sigma_base(self) -> float: ...
    @property
    def seed(self) -> int: ...
    @property
    def content_hash(self) -> str: ...


# --------------------------------------------------------------------------- schema


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC datetimes on every backend (SQLite stores them naive)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        value = value.astimezone(timezone.utc)
        # SQLite's DateTime drops the offset silently; make the UTC convention explicit.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)


def _json() -> JSON:
    # none_as_null: Python None is SQL NULL (not the JSON text 'null'), so IS NULL works.
    return JSON(none_as_null=True)


# Deterministic constraint/index names, so the migration and the models agree on them.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_N_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Sweep(Base):
    __tablename__ = "sweeps"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    spec: Mapped[dict[str, Any]] = mapped_column(_json())
    spec_hash: Mapped[str] = mapped_column(String(64), index=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    search: Mapped[str] = mapped_column(String(32))  # search method: grid, optuna, ...
    data_hash: Mapped[str | None] = mapped_column(String(64))
    reuse: Mapped[bool] = mapped_column(Boolean)
    max_attempts: Mapped[int] = mapped_column(Integer)
    n_trials: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    mlflow_experiment_id: Mapped[str | None] = mapped_column(String(64))
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64))  # the parent run
    error: Mapped[str | None] = mapped_column(Text)


class Trial(Base):
    __tablename__ = "trials"
    __table_args__ = (
        UniqueConstraint("sweep_id", "idx"),
        Index("ix_trials_sweep_id_status", "sweep_id", "status"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    sweep_id: Mapped[str] = mapped_column(ForeignKey("sweeps.id", ondelete="CASCADE"))
    idx: Mapped[int] = mapped_column(Integer)  # order within the sweep
    arm: Mapped[str] = mapped_column(String(100))
    width: Mapped[int] = mapped_column(Integer)
    depth: Mapped[int] = mapped_column(Integer)
    lr: Mapped[float] = mapped_column(Double)
    sigma_base: Mapped[float] = mapped_column(Double)
    seed: Mapped[int] = mapped_column(Integer)
    spec: Mapped[dict[str, Any]] = mapped_column(_json())  # TrialSpec.model_dump(mode="json")
    content_hash: Mapped[str] = mapped_column(String(64), index=True)
    data_hash: Mapped[str | None] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), index=True)
    attempts: Mapped[int] = mapped_column(Integer)
    max_attempts: Mapped[int] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    result: Mapped[dict[str, Any] | None] = mapped_column(_json())  # TrialResult dump
    final_val_loss: Mapped[float | None] = mapped_column(Double)
    flops: Mapped[float | None] = mapped_column(Double)
    tokens: Mapped[int | None] = mapped_column(BigInteger)
    params_non_embedding: Mapped[int | None] = mapped_column(BigInteger)
    params_embedding: Mapped[int | None] = mapped_column(BigInteger)
    wall_time_s: Mapped[float | None] = mapped_column(Double)
    worker_node: Mapped[str | None] = mapped_column(String(200))
    lease_owner: Mapped[str | None] = mapped_column(String(200))  # coordinator id
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64))
    reused_from: Mapped[str | None] = mapped_column(String(32))  # id of the trial that ran
    optuna_trial_number: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime())
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime())


# --------------------------------------------------------------------------- helpers

T = TypeVar("T")


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _new_id(n: int) -> str:
    return uuid.uuid4().hex[:n]


def _chunks(items: Sequence[T], size: int = _CHUNK) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _finite(obj: Any) -> Any:
    """Replace NaN/inf (anywhere in a JSON-able value) by None: PostgreSQL's json rejects them."""
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def _json_dumps(obj: Any) -> str:
    return json.dumps(_finite(obj), allow_nan=False)


def _number(value: Any, kind: type[int] | type[float]) -> int | float | None:
    """A finite number of the given kind, or None (missing, NaN and inf all read as None)."""
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(number):
        return None
    return int(number) if kind is int else number


def _as_dict(obj: Base) -> dict[str, Any]:
    return {attr.key: getattr(obj, attr.key) for attr in inspect(obj).mapper.column_attrs}


def _trial_dict(obj: Trial) -> dict[str, Any]:
    out = _as_dict(obj)
    out["reused"] = obj.reused_from is not None
    return out


def _dump_model(value: Any) -> dict[str, Any]:
    # TrialSpec / TrialResult are pydantic models; plain mappings pass through.
    if hasattr(value, "model_dump"):
        return cast(dict[str, Any], value.model_dump(mode="json"))
    return dict(value)


def _rowcount(result: Any) -> int:
    return cast(CursorResult[Any], result).rowcount


def normalize_url(url: str | URL) -> URL:
    """Parse a database URL; bare `postgresql://` / `postgres://` get the psycopg (v3) driver."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def _is_memory(url: URL) -> bool:
    return url.database in (None, "", ":memory:")


def make_engine(url: str | URL, echo: bool = False) -> Engine:
    """An engine configured for concurrent use (SQLite: WAL, busy timeout, explicit BEGIN)."""
    url = normalize_url(url)
    if url.get_backend_name() != "sqlite":
        return create_engine(url, echo=echo, pool_pre_ping=True, json_serializer=_json_dumps)

    memory = _is_memory(url)
    database = url.database or ""
    if not memory and not database.startswith("file:"):
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        url,
        echo=echo,
        json_serializer=_json_dumps,
        # the pool hands connections to whichever thread asks; each is used by one at a time
        connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
        # an in-memory database lives in one connection (tests/toys; single-threaded only)
        **({"poolclass": StaticPool} if memory else {}),
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Driver autocommit: pysqlite's own implicit BEGIN cannot do IMMEDIATE, so the
        # "begin" hook below emits BEGIN itself.
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            if not memory:
                # WAL: readers never block the writer and vice versa.
                cursor.execute("PRAGMA journal_mode = WAL")
                cursor.execute("PRAGMA synchronous = NORMAL")  # durable enough with WAL
            cursor.execute("PRAGMA foreign_keys = ON")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        immediate = conn.get_execution_options().get(_IMMEDIATE, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine


def alembic_config() -> Any:
    """A programmatic Alembic config for the packaged migrations (no alembic.ini needed)."""
    from alembic.config import Config

    cfg = Config()
    # configparser interpolation: a literal '%' in the path must be doubled
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    return cfg


@dataclass(frozen=True)
class _Filters:
    status: str | Sequence[str] | None = None
    arm: str | None = None
    width: int | None = None
    depth: int | None = None
    sigma_base: float | None = None
    seed: int | None = None

    def apply(self, stmt: Select[Any]) -> Select[Any]:
        if isinstance(self.status, str):
            stmt = stmt.where(Trial.status == self.status)
        elif self.status is not None:
            stmt = stmt.where(Trial.status.in_(list(self.status)))
        if self.arm is not None:
            stmt = stmt.where(Trial.arm == self.arm)
        if self.width is not None:
            stmt = stmt.where(Trial.width == int(self.width))
        if self.depth is not None:
            stmt = stmt.where(Trial.depth == int(self.depth))
        if self.sigma_base is not None:
            # exact: the value is the planner's float, stored as a double and read back as is
            stmt = stmt.where(Trial.sigma_base == float(self.sigma_base))
        if self.seed is not None:
            stmt = stmt.where(Trial.seed == int(self.seed))
        return stmt


# --------------------------------------------------------------------------- the store


class Store:
    """The app database: sweeps and their trials."""

    def __init__(self, url: str | URL, *, echo: bool = False) -> None:
        self.url = normalize_url(url)
        self.engine = make_engine(self.url, echo=echo)
        # Same pool; on SQLite its transactions begin IMMEDIATE (see the module docstring).
        self._write_engine = self.engine.execution_options(**{_IMMEDIATE: True})
        self._reader = sessionmaker(self.engine, expire_on_commit=False)
        self._writer = sessionmaker(self._write_engine, expire_on_commit=False)

    def __repr__(self) -> str:
        return f"Store({self.url_safe!r})"

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.engine.dispose()

    @property
    def url_safe(self) -> str:
        """The database URL with the password masked (for logs and /health)."""
        return self.url.render_as_string(hide_password=True)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    @contextmanager
    def _read(self) -> Iterator[Session]:
        with self._reader() as session:
            yield session

    @contextmanager
    def _write(self) -> Iterator[Session]:
        with self._writer.begin() as session:
            yield session

    # ---------------------------------------------------------------- schema

    def migrate(self) -> None:
        """Bring the schema to the newest revision (alembic upgrade head); safe to repeat."""
        from alembic import command

        cfg = alembic_config()
        # One transaction (IMMEDIATE on SQLite; env.py takes an advisory lock on PostgreSQL),
        # so two processes migrating at once run the revisions exactly once.
        with _MIGRATE_LOCK, self._write_engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")

    def schema_revision(self) -> str | None:
        """The Alembic revision the database is at (None before the first migrate)."""
        from alembic.runtime.migration import MigrationContext

        with self.engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()

    @staticmethod
    def head_revision() -> str | None:
        from alembic.script import ScriptDirectory

        return ScriptDirectory.from_config(alembic_config()).get_current_head()

    # ---------------------------------------------------------------- creating

    def create_sweep(
        self,
        name: str,
        spec: Mapping[str, Any],
        spec_hash: str,
        search: str,
        planned: Iterable[PlannedTrial],
        data_hash: str | None = None,
        reuse: bool = True,
        max_attempts: int = 3,
    ) -> str:
        """Insert a sweep and all its planned trials in one transaction; return the sweep id.

        With `reuse` and a `data_hash`, a trial whose content hash already completed on the
        same data is inserted completed, with the earlier result copied and `reused_from` set.
        """
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        items = list(planned)
        sweep_id = _new_id(12)
        now = _now()
        with self._write() as s:
            donors = (
                self._donors(s, [p.content_hash for p in items], data_hash)
                if reuse and data_hash
                else {}
            )
            sweep = Sweep(
                id=sweep_id, name=name, spec=dict(spec), spec_hash=spec_hash, status="pending",
                search=search, data_hash=data_hash, reuse=reuse, max_attempts=max_attempts,
                n_trials=len(items), created_at=now,
            )
            s.add(sweep)
            s.flush()  # the sweep row first: every trial references it
            rows = [
                _trial_row(sweep_id, idx, p, data_hash, max_attempts, now, donors)
                for idx, p in enumerate(items)
            ]
            for chunk in _chunks(rows):
                s.execute(insert(Trial), list(chunk))
            if rows and all(r["status"] == "completed" for r in rows):
                # Everything was reused: nothing will ever be dispatched to finish it.
                sweep.status, sweep.started_at, sweep.finished_at = "completed", now, now
        return sweep_id

    def add_trial(
        self, sweep_id: str, planned: PlannedTrial, optuna_trial_number: int | None = None
    ) -> str:
        """Append one trial to a sweep (Optuna mode asks trials one at a time)."""
        now = _now()
        with self._write() as s:
            # Row lock (PostgreSQL) so concurrent adds get distinct idx values.
            sweep = s.get(Sweep, sweep_id, with_for_update={"key_share": True})
            if sweep is None:
                raise NotFoundError(f"no sweep {sweep_id!r}")
            if sweep.status in ("cancelled", "failed"):
                raise StoreError(f"sweep {sweep_id} is {sweep.status}; cannot add trials")
            last = s.scalar(select(func.max(Trial.idx)).where(Trial.sweep_id == sweep_id))
            donors = (
                self._donors(s, [planned.content_hash], sweep.data_hash)
                if sweep.reuse and sweep.data_hash
                else {}
            )
            row = _trial_row(
                sweep_id, 0 if last is None else last + 1, planned, sweep.data_hash,
                sweep.max_attempts, now, donors, optuna_trial_number,
            )
            s.execute(insert(Trial), [row])
            sweep.n_trials += 1
            if row["status"] == "pending" and sweep.status == "completed":
                sweep.status, sweep.finished_at = "running", None  # more work arrived
        return cast(str, row["id"])

    @staticmethod
    def _donors(
        s: Session, hashes: Sequence[str], data_hash: str | None
    ) -> dict[str, dict[str, Any]]:
        """Newest completed trial (with a result) per content hash on the same data."""
        found: dict[str, dict[str, Any]] = {}
        wanted = sorted({h for h in hashes if h})
        for chunk in _chunks(wanted):
            stmt = (
                select(Trial)
                .where(
                    Trial.content_hash.in_(list(chunk)),
                    Trial.data_hash == data_hash,
                    Trial.status == "completed",
                    Trial.result.is_not(None),
                )
                .order_by(Trial.finished_at.desc(), Trial.id)
            )
            for trial in s.scalars(stmt):
                found.setdefault(trial.content_hash, _as_dict(trial))
        return found

    # ---------------------------------------------------------------- reading

    def get_sweep(self, sweep_id: str) -> dict[str, Any] | None:
        """The sweep row plus `counts` (trials per status)."""
        with self._read() as s:
            sweep = s.get(Sweep, sweep_id)
            if sweep is None:
                return None
            out = _as_dict(sweep)
            out["counts"] = self._counts(s, [sweep_id])[sweep_id]
            return out

    def list_sweeps(
        self, limit: int = 50, offset: int = 0, status: str | None = None
    ) -> list[dict[str, Any]]:
        """Sweeps, newest first, each with `counts`."""
        with self._read() as s:
            stmt = select(Sweep).order_by(Sweep.created_at.desc(), Sweep.id.desc())
            if status is not None:
                stmt = stmt.where(Sweep.status == status)
            sweeps = [_as_dict(x) for x in s.scalars(stmt.limit(limit).offset(offset))]
            counts = self._counts(s, [x["id"] for x in sweeps])
            for sweep in sweeps:
                sweep["counts"] = counts[sweep["id"]]
            return sweeps

    def active_sweeps(self) -> list[dict[str, Any]]:
        """Pending or running sweeps, oldest first, without counts (the dispatcher's tick)."""
        with self._read() as s:
            stmt = (select(Sweep).where(Sweep.status.in_(("pending", "running")))
                    .order_by(Sweep.created_at, Sweep.id))
            return [_as_dict(x) for x in s.scalars(stmt)]

    def status_counts(self, sweep_id: str) -> dict[str, int]:
        """Number of trials in every status (zeros included)."""
        with self._read() as s:
            return self._counts(s, [sweep_id])[sweep_id]

    @staticmethod
    def _counts(s: Session, sweep_ids: Sequence[str]) -> dict[str, dict[str, int]]:
        out = {sid: dict.fromkeys(TRIAL_STATUSES, 0) for sid in sweep_ids}
        for chunk in _chunks(list(sweep_ids)):
            stmt = (
                select(Trial.sweep_id, Trial.status, func.count())
                .where(Trial.sweep_id.in_(list(chunk)))
                .group_by(Trial.sweep_id, Trial.status)
            )
            for sid, status, n in s.execute(stmt):
                out[sid][status] = int(n)
        return out

    def trials(
        self,
        sweep_id: str,
        status: str | Sequence[str] | None = None,
        arm: str | None = None,
        width: int | None = None,
        depth: int | None = None,
        limit: int | None = 100,
        offset: int = 0,
        sigma_base: float | None = None,
        seed: int | None = None,
    ) -> list[dict[str, Any]]:
        """A page of a sweep's trials in plan order (idx), optionally filtered."""
        stmt = _Filters(status, arm, width, depth, sigma_base, seed).apply(
            select(Trial).where(Trial.sweep_id == sweep_id)
        )
        stmt = stmt.order_by(Trial.idx).offset(offset)
        if limit is not None:
            stmt = stmt.limit(limit)
        with self._read() as s:
            return [_trial_dict(t) for t in s.scalars(stmt)]

    def count_trials(
        self,
        sweep_id: str,
        status: str | Sequence[str] | None = None,
        arm: str | None = None,
        width: int | None = None,
        depth: int | None = None,
        sigma_base: float | None = None,
        seed: int | None = None,
    ) -> int:
        stmt = _Filters(status, arm, width, depth, sigma_base, seed).apply(
            select(func.count()).select_from(Trial).where(Trial.sweep_id == sweep_id)
        )
        with self._read() as s:
            return int(s.scalar(stmt) or 0)

    def get_trial(self, trial_id: str) -> dict[str, Any] | None:
        with self._read() as s:
            trial = s.get(Trial, trial_id)
            return None if trial is None else _trial_dict(trial)

    # ---------------------------------------------------------------- leasing

    def lease_pending(
        self,
        owner: str,
        limit: int,
        sweep_id: str | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
    ) -> list[dict[str, Any]]:
        """Atomically move up to `limit` pending trials to running under `owner`'s lease.

        Oldest sweep first, then plan order. Safe with several coordinators: a trial is
        never leased twice. The leased trials' sweeps become running.
        """
        if limit <= 0:
            return []
        now = _now()
        with self._write() as s:
            stmt = (
                select(Trial.id)
                .join(Sweep, Sweep.id == Trial.sweep_id)
                .where(Trial.status == "pending", Sweep.status.in_(LEASABLE_SWEEP_STATUSES))
                .order_by(Sweep.created_at, Sweep.id, Trial.idx)
                .limit(limit)
            )
            if sweep_id is not None:
                stmt = stmt.where(Trial.sweep_id == sweep_id)
            if self.dialect == "postgresql":
                # Rows another coordinator is leasing right now are skipped, not waited on.
                stmt = stmt.with_for_update(skip_locked=True, of=Trial)
            ids = list(s.scalars(stmt))
            if not ids:
                return []
            s.execute(
                update(Trial)
                .where(Trial.id.in_(ids), Trial.status == "pending")  # belt and braces
                .values(
                    status="running",
                    attempts=Trial.attempts + 1,
                    lease_owner=owner,
                    lease_expires_at=now + timedelta(seconds=lease_seconds),
                    started_at=now,
                    finished_at=None,
                )
                .execution_options(synchronize_session=False)
            )
            to_start = select(Sweep.id).where(
                Sweep.id.in_(select(Trial.sweep_id).where(Trial.id.in_(ids))),
                Sweep.status == "pending",
            )
            if self.dialect == "postgresql":
                # Never wait on a sweep row (cancel/add_trial lock it first, then trials): a
                # lease that never waits cannot be part of a deadlock. A skipped sweep is
                # marked running by the next lease or refresh.
                to_start = to_start.with_for_update(skip_locked=True)
            s.execute(
                update(Sweep)
                .where(Sweep.id.in_(to_start))
                .values(status="running", started_at=now)
                .execution_options(synchronize_session=False)
            )
            leased = s.scalars(
                select(Trial)
                .join(Sweep, Sweep.id == Trial.sweep_id)
                .where(Trial.id.in_(ids), Trial.status == "running", Trial.lease_owner == owner)
                .order_by(Sweep.created_at, Sweep.id, Trial.idx)
            )
            return [_trial_dict(t) for t in leased]

    def renew_leases(
        self,
        owner: str,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        trial_ids: Sequence[str] | None = None,
    ) -> int:
        """Extend the leases `owner` holds (its heartbeat); returns how many were extended."""
        stmt = update(Trial).where(Trial.status == "running", Trial.lease_owner == owner)
        if trial_ids is not None:
            stmt = stmt.where(Trial.id.in_(list(trial_ids)))
        stmt = stmt.values(lease_expires_at=_now() + timedelta(seconds=lease_seconds))
        with self._write() as s:
            return _rowcount(s.execute(stmt.execution_options(synchronize_session=False)))

    def finish_trial(
        self,
        trial_id: str,
        status: str,
        result: Mapping[str, Any] | Any | None = None,
        error: str | None = None,
        worker_node: str | None = None,
        owner: str | None = None,
    ) -> bool:
        """Record a running trial's outcome; False (and no change) unless it is running.

        A completed or cancelled trial is never overwritten. With `owner`, the write also
        requires that coordinator to still hold the lease.
        """
        if status not in FINISHED_STATUSES:
            raise ValueError(f"finish status must be one of {sorted(FINISHED_STATUSES)}")
        values: dict[str, Any] = {
            "status": status, "finished_at": _now(), "lease_expires_at": None, "error": error,
        }
        if worker_node is not None:
            values["worker_node"] = worker_node
        if result is not None:
            dumped = _dump_model(result)
            values["result"] = dumped
            values.update(_result_columns(dumped))
            if dumped.get("data_hash"):
                # The worker's hash is what the data really was; reuse keys on it.
                values["data_hash"] = dumped["data_hash"]
            if error is None and dumped.get("error"):
                values["error"] = dumped["error"]
        stmt = update(Trial).where(Trial.id == trial_id, Trial.status == "running")
        if owner is not None:
            stmt = stmt.where(Trial.lease_owner == owner)
        with self._write() as s:
            done = s.execute(stmt.values(**values).execution_options(synchronize_session=False))
            return _rowcount(done) == 1

    def requeue(self, trial_id: str, error: str | None) -> str:
        """After a retryable failure: back to pending while attempts < max_attempts, else
        failed. Returns the trial's status afterwards (unchanged unless it was running)."""
        with self._write() as s:
            trial = s.get(Trial, trial_id, with_for_update=True)
            if trial is None:
                raise NotFoundError(f"no trial {trial_id!r}")
            if trial.status != "running":
                return trial.status
            trial.error = error
            trial.lease_owner = trial.lease_expires_at = None
            if trial.attempts < trial.max_attempts:
                trial.status, trial.started_at, trial.worker_node = "pending", None, None
            else:
                trial.status, trial.finished_at = "failed", _now()
            return trial.status

    def requeue_orphans(self, live_owner: str, expired_only: bool = False) -> int:
        """Running trials leased by another (dead) coordinator go back to pending.

        Called at coordinator start-up. The interrupted attempt is not counted (the trial did
        not fail). Orphans of a cancelled/failed sweep become cancelled instead. With
        `expired_only`, only leases past their expiry are taken: use that when several
        coordinators share the database and renew their leases. Returns the number requeued.
        """
        now = _now()
        orphan = [
            Trial.status == "running",
            or_(Trial.lease_owner.is_(None), Trial.lease_owner != live_owner),
        ]
        if expired_only:
            orphan.append(
                or_(Trial.lease_expires_at.is_(None), Trial.lease_expires_at < now)
            )
        stopped = select(Sweep.id).where(Sweep.status.in_(("cancelled", "failed")))
        released = {"lease_owner": None, "lease_expires_at": None}
        with self._write() as s:
            s.execute(
                update(Trial)
                .where(*orphan, Trial.sweep_id.in_(stopped))
                .values(status="cancelled", finished_at=now, **released)
                .execution_options(synchronize_session=False)
            )
            requeued = s.execute(
                update(Trial)
                .where(*orphan)
                .values(
                    status="pending",
                    attempts=case((Trial.attempts > 0, Trial.attempts - 1), else_=0),
                    started_at=None,
                    worker_node=None,
                    **released,
                )
                .execution_options(synchronize_session=False)
            )
            return _rowcount(requeued)

    # ---------------------------------------------------------------- cancelling

    def cancel_sweep(self, sweep_id: str) -> list[str]:
        """Cancel a sweep: pending trials become cancelled; returns the ids of its running
        trials, which the dispatcher must cancel (then `mark_cancelled`)."""
        now = _now()
        with self._write() as s:
            # Sweep row first: a concurrent add_trial either committed before (its trial is
            # cancelled below) or sees the cancelled sweep and refuses.
            sweep = s.get(Sweep, sweep_id, with_for_update={"key_share": True})
            if sweep is None:
                raise NotFoundError(f"no sweep {sweep_id!r}")
            s.execute(
                update(Trial)
                .where(Trial.sweep_id == sweep_id, Trial.status == "pending")
                .values(status="cancelled", finished_at=now)
                .execution_options(synchronize_session=False)
            )
            if sweep.status in LEASABLE_SWEEP_STATUSES:
                sweep.status, sweep.finished_at = "cancelled", now
            running = select(Trial.id).where(
                Trial.sweep_id == sweep_id, Trial.status == "running"
            )
            return list(s.scalars(running.order_by(Trial.idx)))

    def mark_cancelled(self, trial_id: str) -> bool:
        """A pending or running trial becomes cancelled; False if it had already finished."""
        stmt = (
            update(Trial)
            .where(Trial.id == trial_id, Trial.status.in_(ACTIVE_STATUSES))
            .values(status="cancelled", finished_at=_now(), lease_expires_at=None)
            .execution_options(synchronize_session=False)
        )
        with self._write() as s:
            return _rowcount(s.execute(stmt)) == 1

    # ---------------------------------------------------------------- sweep status

    def set_sweep_status(self, sweep_id: str, status: str, error: str | None = None) -> None:
        if status not in SWEEP_STATUSES:
            raise ValueError(f"sweep status must be one of {SWEEP_STATUSES}, got {status!r}")
        now = _now()
        values: dict[str, Any] = {"status": status, "error": error}
        if status == "running":
            values["started_at"] = func.coalesce(Sweep.started_at, now)
            values["finished_at"] = None
        elif status != "pending":
            values["finished_at"] = now
        stmt = update(Sweep).where(Sweep.id == sweep_id).values(**values)
        with self._write() as s:
            if _rowcount(s.execute(stmt.execution_options(synchronize_session=False))) == 0:
                raise NotFoundError(f"no sweep {sweep_id!r}")

    def refresh_sweep_status(self, sweep_id: str) -> str:
        """Running while any trial is pending or running, else completed (a cancelled or
        failed sweep keeps its status). Returns the status."""
        now = _now()
        with self._write() as s:
            # Locked before counting, so a trial added concurrently is counted.
            sweep = s.get(Sweep, sweep_id, with_for_update={"key_share": True})
            if sweep is None:
                raise NotFoundError(f"no sweep {sweep_id!r}")
            if sweep.status in ("cancelled", "failed"):
                return sweep.status
            active = s.scalar(
                select(func.count())
                .select_from(Trial)
                .where(Trial.sweep_id == sweep_id, Trial.status.in_(ACTIVE_STATUSES))
            )
            if active:
                sweep.status, sweep.finished_at = "running", None
                sweep.started_at = sweep.started_at or now
            elif sweep.status != "completed":
                sweep.status, sweep.finished_at = "completed", now
                sweep.started_at = sweep.started_at or now
            return sweep.status

    def set_sweep_mlflow(
        self, sweep_id: str, experiment_id: str | None = None, run_id: str | None = None
    ) -> None:
        """The sweep's MLflow experiment and parent run (None leaves a value unchanged)."""
        values = {
            k: v
            for k, v in (("mlflow_experiment_id", experiment_id), ("mlflow_run_id", run_id))
            if v is not None
        }
        if not values:
            return
        with self._write() as s:
            stmt = update(Sweep).where(Sweep.id == sweep_id).values(**values)
            if _rowcount(s.execute(stmt.execution_options(synchronize_session=False))) == 0:
                raise NotFoundError(f"no sweep {sweep_id!r}")

    set_mlflow_ids = set_sweep_mlflow  # the name in the design brief

    def set_trial_mlflow(self, trial_id: str, run_id: str) -> None:
        """The trial's MLflow run (a child of the sweep's parent run)."""
        with self._write() as s:
            stmt = update(Trial).where(Trial.id == trial_id).values(mlflow_run_id=run_id)
            if _rowcount(s.execute(stmt.execution_options(synchronize_session=False))) == 0:
                raise NotFoundError(f"no trial {trial_id!r}")

    # ---------------------------------------------------------------- analysis

    def results_frame(self, sweep_id: str) -> pd.DataFrame:
        """One row per trial, columns `RESULT_FRAME_COLUMNS` (what the analysis consumes)."""
        stmt = (
            select(
                Trial.id, Trial.arm, Trial.spec, Trial.width, Trial.depth, Trial.lr,
                Trial.sigma_base, Trial.seed, Trial.status, Trial.final_val_loss, Trial.flops,
                Trial.tokens, Trial.params_non_embedding, Trial.params_embedding,
                Trial.wall_time_s, Trial.reused_from,
            )
            .where(Trial.sweep_id == sweep_id)
            .order_by(Trial.idx)
        )
        with self._read() as s:
            rows = s.execute(stmt).all()
        columns: dict[str, list[Any]] = {c: [] for c in RESULT_FRAME_COLUMNS}
        for r in rows:
            spec = r.spec or {}
            values = {
                "trial_id": r.id, "arm": r.arm, "arch": spec.get("arch"),
                "parameterization": spec.get("parameterization"), "width": r.width,
                "depth": r.depth, "lr": r.lr, "sigma_base": r.sigma_base, "seed": r.seed,
                "status": r.status, "final_val_loss": r.final_val_loss, "flops": r.flops,
                "tokens": r.tokens, "params_non_embedding": r.params_non_embedding,
                "params_embedding": r.params_embedding, "wall_time_s": r.wall_time_s,
                "reused": r.reused_from is not None,
            }
            for name, value in values.items():
                columns[name].append(value)
        return pd.DataFrame(
            {c: pd.Series(columns[c], dtype=_FRAME_DTYPES[c]) for c in RESULT_FRAME_COLUMNS}
        )


def _result_columns(result: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {k: _number(result.get(k), float) for k in _RESULT_FLOATS}
    out.update({k: _number(result.get(k), int) for k in _RESULT_INTS})
    return out


def _trial_row(
    sweep_id: str,
    idx: int,
    p: PlannedTrial,
    data_hash: str | None,
    max_attempts: int,
    now: datetime,
    donors: Mapping[str, Mapping[str, Any]],
    optuna_trial_number: int | None = None,
) -> dict[str, Any]:
    """The insert values for one planned trial (completed from a donor when reused)."""
    row: dict[str, Any] = {
        "id": _new_id(16),
        "sweep_id": sweep_id,
        "idx": idx,
        "arm": str(p.arm),
        "width": int(p.width),
        "depth": int(p.depth),
        "lr": float(p.lr),
        "sigma_base": float(p.sigma_base),
        "seed": int(p.seed),
        "spec": _dump_model(p.trial),
        "content_hash": p.content_hash,
        "data_hash": data_hash,
        "status": "pending",
        "attempts": 0,
        "max_attempts": max_attempts,
        "optuna_trial_number": optuna_trial_number,
        "created_at": now,
        # every row carries the same keys, so the inserts batch into one executemany
        **dict.fromkeys(RESULT_COLUMNS),
        **dict.fromkeys(("result", "worker_node", "reused_from", "started_at", "finished_at")),
    }
    donor = donors.get(p.content_hash) if p.content_hash else None
    if donor is not None:
        row.update({k: donor[k] for k in RESULT_COLUMNS})
        row.update(
            status="completed",
            result=donor["result"],
            worker_node=donor["worker_node"],
            # point at the trial that actually ran, not at another copy of it
            reused_from=donor["reused_from"] or donor["id"],
            started_at=now,
            finished_at=now,
        )
    return row
