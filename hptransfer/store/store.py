"""Persistence of sweeps and trials: the `Store` and its operations.

Every public method of `Store` runs its own short transaction and returns frozen records
(records.py: `SweepRecord`, `TrialRecord`, ...), plain values or a DataFrame, never live ORM
objects, so a Store can be shared by the API's threads and the dispatcher's. The same code
runs on SQLite (the embedded default) and PostgreSQL.

Concurrency: several coordinators may lease from one database. On PostgreSQL the lease query
locks its rows with `FOR UPDATE SKIP LOCKED`; on SQLite every write transaction starts with
`BEGIN IMMEDIATE`, which takes the database's single write lock before reading, so two
read-then-write transactions can never interleave (and never fail half-way with "database is
locked": the busy timeout makes the second one wait instead).

The rest of the database layer lives beside it: schema (tables, column types, statuses),
engine (engines, URLs, SQLite pragmas, migrations), records (the frozen records), rows (rows
to records and insert values), query (filters, chunking, bulk updates) and frame (the results
DataFrame). The names other code imports from here are re-exported below.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import datetime, timedelta
from typing import Any, cast

import pandas as pd
from sqlalchemy import (
    JSON,
    ColumnElement,
    Select,
    and_,
    case,
    exists,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy import cast as sql_cast
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session, aliased, defer, sessionmaker

from hptransfer.contracts.filters import TrialFilters
from hptransfer.contracts.records import AttemptRecord, SweepRecord, TrialRecord
from hptransfer.contracts.status import TrialStatus
from hptransfer.redaction import mask_url, redact

from .engine import (
    MIGRATIONS_DIR,
    SQLITE_BUSY_TIMEOUT_MS,
    alembic_config,
    current_revision,
    for_writing,
    make_engine,
    normalize_url,
    packaged_head,
    upgrade_to_head,
)
from .frame import RESULT_FRAME_COLUMNS, results_query, results_to_frame
from .query import bulk_update, chunks, filtered
from .rows import (
    PlannedRow,
    dump_model,
    new_id,
    result_columns,
    reused_values,
    sweep_record,
    trial_record,
    trial_row,
    utcnow,
)
from .schema import (
    ACTIVE_STATUSES,
    NAMING_CONVENTION,
    RESULT_COLUMNS,
    STOPPED_SWEEP_STATUSES,
    SWEEP_STATUSES,
    TRIAL_STATUSES,
    Attempt,
    Base,
    Sweep,
    Trial,
    UTCDateTime,
)

__all__ = [
    "ACTIVE_STATUSES",
    "DEFAULT_LEASE_SECONDS",
    "MIGRATIONS_DIR",
    "NAMING_CONVENTION",
    "NOT_STARTED",
    "RESULT_COLUMNS",
    "RESULT_FRAME_COLUMNS",
    "SQLITE_BUSY_TIMEOUT_MS",
    "SWEEP_STATUSES",
    "TRIAL_STATUSES",
    "Base",
    "NotFoundError",
    "PlannedRow",
    "Store",
    "StoreError",
    "Sweep",
    "SweepRecord",
    "Trial",
    "TrialRecord",
    "UTCDateTime",
    "alembic_config",
    "make_engine",
    "normalize_url",
]

DEFAULT_LEASE_SECONDS = 6 * 3600  # a backstop for several coordinators (requeue expired_only)
ORPHANED = "coordinator died during this attempt; re-queued"
# A trial whose attempts were cut short this often by its coordinator's death is failed, not
# re-queued again: it may be what takes the coordinator down (a host out of memory), and
# re-queueing it without end would repeat that for good.
MAX_ORPHANED_ATTEMPTS = 5
NOT_STARTED = "its task could not be submitted to Ray; re-queued"


class StoreError(Exception):
    """A request the store cannot satisfy (bad status, adding to a finished sweep, ...)."""


class NotFoundError(StoreError, LookupError):
    """No sweep or trial with that id."""


def _end_attempt(s: Session, trial_id: str, status: str, error: str | None,
                 has_result: bool = False) -> None:
    """The trial's running attempt ends with the trial's (or the lost worker's) outcome."""
    bulk_update(s, update(Attempt)
                .where(Attempt.trial_id == trial_id, Attempt.status == "running")
                .values(status=status, error=error, has_result=has_result,
                        finished_at=utcnow()))


def _insert_trials(s: Session, rows: list[dict[str, Any]], now: datetime) -> None:
    """Insert trial rows; a trial reused from a donor gets its one attempt, finished with the
    donor's result, so that MLflow (which mirrors attempts) shows it too."""
    for chunk in chunks(rows):
        s.execute(insert(Trial), list(chunk))
    reused = [r["id"] for r in rows if r.get("reused_from") is not None]
    for chunk in chunks(reused):
        s.execute(insert(Attempt), [_attempt_row(tid, 1, "completed", now) for tid in chunk])


def _attempt_row(trial_id: str, seq: int, status: str, now: datetime) -> dict[str, Any]:
    """Insert values of an attempt starting now: running, or finished at once with its
    trial's (reused) result."""
    running = status == "running"
    return {"trial_id": trial_id, "seq": seq, "status": status, "error": None,
            "has_result": not running, "started_at": now, "finished_at": None if running else now,
            "mlflow_run_id": None, "mlflow_synced_status": None}


def _add_attempts(s: Session, trial_ids: list[str], status: str, now: datetime) -> None:
    """One new attempt per trial, its seq after the trial's earlier ones (see _attempt_row)."""
    last_seq = dict(s.execute(
        select(Attempt.trial_id, func.max(Attempt.seq))
        .where(Attempt.trial_id.in_(trial_ids)).group_by(Attempt.trial_id)).all())
    s.execute(insert(Attempt), [_attempt_row(tid, (last_seq.get(tid) or 0) + 1, status, now)
                                for tid in trial_ids])


def _waits_for_twin() -> ColumnElement[bool]:
    """A pending trial that an earlier trial of its sweep (plan order) with the same content
    hash is still pending or running for: it is not leased, and takes that trial's result when
    it completes (`Store._settle_twins`), rather than training the same thing twice (a study's
    ladder and aspect-ratio stages may plan one shape at one budget). Only where the sweep
    reuses results (reuse on, a data hash: the rule that reuses a finished donor), and not for
    Optuna's asks, each of which is told its own outcome. Needs Sweep joined."""
    twin = aliased(Trial)
    return and_(
        _may_wait_for_twin(),
        exists().where(twin.sweep_id == Trial.sweep_id,
                       twin.content_hash == Trial.content_hash,
                       twin.status.in_(ACTIVE_STATUSES), twin.idx < Trial.idx),
    )


def _may_wait_for_twin() -> ColumnElement[bool]:
    """A trial of a sweep that reuses results, not asked by Optuna (see _waits_for_twin).
    Needs Sweep joined."""
    return and_(Sweep.reuse.is_(True), Sweep.data_hash.is_not(None),
                Trial.optuna_trial_number.is_(None))


def _attempt_record(a: Attempt, sweep_id: str, arm: str, spec: dict[str, Any],
                    result: dict[str, Any] | None, reused_from: str | None,
                    experiment_id: str | None, parent_run_id: str | None) -> AttemptRecord:
    return AttemptRecord(
        trial_id=a.trial_id, seq=a.seq, status=a.status, error=a.error,
        started_at=a.started_at, finished_at=a.finished_at, mlflow_run_id=a.mlflow_run_id,
        mlflow_synced_status=a.mlflow_synced_status, sweep_id=sweep_id,
        experiment_id=experiment_id, parent_run_id=parent_run_id, arm=arm, spec=spec,
        result=result if a.has_result else None, reused_from=reused_from)


# an attempt with what its MLflow run needs from its trial and sweep (see _attempt_record)
_ATTEMPTS = (select(Attempt, Trial.sweep_id, Trial.arm, Trial.spec, Trial.result,
                    Trial.reused_from, Sweep.mlflow_experiment_id, Sweep.mlflow_run_id)
             .join(Trial, Trial.id == Attempt.trial_id)
             .join(Sweep, Sweep.id == Trial.sweep_id))


def _locked_sweep(s: Session, sweep_id: str) -> Sweep:
    """The sweep row, locked for this transaction (FOR NO KEY UPDATE on PostgreSQL; SQLite's
    IMMEDIATE transaction already holds the write lock); NotFoundError if there is none."""
    sweep = s.get(Sweep, sweep_id, with_for_update={"key_share": True})
    if sweep is None:
        raise NotFoundError(f"no sweep {sweep_id!r}")
    return sweep


class Store:
    """The app database: sweeps and their trials."""

    def __init__(self, url: str | URL, *, echo: bool = False) -> None:
        self.url = normalize_url(url)
        self.engine = make_engine(self.url, echo=echo)
        self._reader = sessionmaker(self.engine, expire_on_commit=False)
        # Same pool; on SQLite its transactions begin IMMEDIATE (see the module docstring).
        self._writer = sessionmaker(for_writing(self.engine), expire_on_commit=False)

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
        """The database URL with the password masked (for logs and /health), in user:pw@
        and in the query string (libpq takes ?password=)."""
        return mask_url(self.url.render_as_string(hide_password=False)) or ""

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def _read(self) -> Session:
        return self._reader()

    def _write(self) -> AbstractContextManager[Session]:
        return self._writer.begin()

    # ---------------------------------------------------------------- schema

    def migrate(self) -> None:
        """Bring the schema to the newest revision (alembic upgrade head); safe to repeat."""
        upgrade_to_head(self.engine)

    def schema_revision(self) -> str | None:
        """The Alembic revision the database is at (None before the first migrate)."""
        return current_revision(self.engine)

    @staticmethod
    def head_revision() -> str | None:
        """The newest revision among the packaged migrations."""
        return packaged_head()

    # ---------------------------------------------------------------- creating

    def create_sweep(
        self,
        name: str,
        spec: Mapping[str, Any],
        spec_hash: str,
        search: str,
        planned: Iterable[PlannedRow],
        data_hash: str | None = None,
        reuse: bool = True,
        max_attempts: int = 3,
        study: Mapping[str, Any] | None = None,
        max_concurrent: int | None = None,
        planned_total: int | None = None,
    ) -> str:
        """Insert a sweep and all its planned trials in one transaction; return the sweep id.

        `study`: the initial state of a staged study (see coordinator/study.py); such a sweep is
        never completed here, since its later stages are still to be planned.
        `max_concurrent` and `planned_total` (the trials the sweep will have; default: the
        planned ones) are kept so summaries never need the spec.

        With `reuse` and a `data_hash`, a trial whose content hash already completed on the
        same data is inserted completed, with the earlier result copied and `reused_from` set.
        """
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        items = list(planned)
        sweep_id = new_id(12)
        now = utcnow()
        with self._write() as s:
            donors = (
                self._donors(s, [p.content_hash for p in items], data_hash)
                if reuse and data_hash
                else {}
            )
            sweep = Sweep(
                id=sweep_id, name=name, spec=dict(spec), spec_hash=spec_hash, status="pending",
                search=search, data_hash=data_hash, reuse=reuse, max_attempts=max_attempts,
                n_trials=len(items), created_at=now, max_concurrent=max_concurrent,
                planned_total=len(items) if planned_total is None else planned_total,
                study=dict(study) if study is not None else None,
            )
            s.add(sweep)
            s.flush()  # the sweep row first: every trial references it
            rows = [
                trial_row(sweep_id, idx, p, data_hash, max_attempts, now, donors)
                for idx, p in enumerate(items)
            ]
            _insert_trials(s, rows, now)
            if study is None and rows and all(r["status"] == "completed" for r in rows):
                # Everything was reused: nothing will ever be dispatched to finish it.
                sweep.status, sweep.started_at, sweep.finished_at = "completed", now, now
        return sweep_id

    def add_trial(
        self, sweep_id: str, planned: PlannedRow, optuna_trial_number: int | None = None
    ) -> str:
        """Append one trial to a sweep (Optuna mode asks trials one at a time)."""
        now = utcnow()
        with self._write() as s:
            # Row lock (PostgreSQL) so concurrent adds get distinct idx values.
            sweep = _locked_sweep(s, sweep_id)
            if sweep.status in STOPPED_SWEEP_STATUSES:
                raise StoreError(f"sweep {sweep_id} is {sweep.status}; cannot add trials")
            last = s.scalar(select(func.max(Trial.idx)).where(Trial.sweep_id == sweep_id))
            donors = (
                self._donors(s, [planned.content_hash], sweep.data_hash)
                if sweep.reuse and sweep.data_hash
                else {}
            )
            row = trial_row(
                sweep_id, 0 if last is None else last + 1, planned, sweep.data_hash,
                sweep.max_attempts, now, donors, optuna_trial_number,
            )
            _insert_trials(s, [row], now)
            sweep.n_trials += 1
            if row["status"] == "pending" and sweep.status == "completed":
                sweep.status, sweep.finished_at = "running", None  # more work arrived
        return cast(str, row["id"])

    def plan_stage(
        self,
        sweep_id: str,
        expected_round: int,
        study: Mapping[str, Any],
        planned: Iterable[PlannedRow],
        stop: tuple[str, str | None] | None = None,
    ) -> bool:
        """Record a study's next stage and insert its trials in ONE transaction.

        Restart safety: `expected_round` is the planning round the caller planned from
        (`study["round"]` before); if another call (or an earlier coordinator) already
        recorded a newer round, nothing is written and False is returned, so a stage is never
        planned twice. A kill before commit leaves no trace; the next tick plans again.
        `stop`: (status, error) to end the sweep with instead (e.g. "stopped", reason).
        """
        items = list(planned)
        now = utcnow()
        with self._write() as s:
            sweep = _locked_sweep(s, sweep_id)
            if sweep.status in STOPPED_SWEEP_STATUSES:
                return False
            if int((sweep.study or {}).get("round", 0)) != expected_round:
                return False
            last = s.scalar(select(func.max(Trial.idx)).where(Trial.sweep_id == sweep_id))
            start = 0 if last is None else last + 1
            donors = (
                self._donors(s, [p.content_hash for p in items], sweep.data_hash)
                if sweep.reuse and sweep.data_hash
                else {}
            )
            rows = [
                trial_row(sweep_id, start + i, p, sweep.data_hash, sweep.max_attempts, now,
                          donors)
                for i, p in enumerate(items)
            ]
            _insert_trials(s, rows, now)
            sweep.n_trials += len(rows)
            sweep.study = dict(study)
            if stop is not None:
                status, reason = stop
                if status not in SWEEP_STATUSES:
                    raise ValueError(f"sweep status must be one of {SWEEP_STATUSES}")
                sweep.status, sweep.error, sweep.finished_at = status, redact(reason), now
                sweep.started_at = sweep.started_at or now
            elif any(r["status"] == "pending" for r in rows):
                sweep.status, sweep.finished_at = "running", None
                sweep.started_at = sweep.started_at or now
            return True

    @staticmethod
    def _donors(
        s: Session, hashes: Sequence[str], data_hash: str | None
    ) -> dict[str, TrialRecord]:
        """Newest completed trial (with a result) per content hash on the same data."""
        found: dict[str, TrialRecord] = {}
        wanted = sorted({h for h in hashes if h})
        for chunk in chunks(wanted):
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
                if trial.content_hash not in found:
                    found[trial.content_hash] = trial_record(trial)
        return found

    # ---------------------------------------------------------------- reading

    def get_sweep(self, sweep_id: str) -> SweepRecord | None:
        """The sweep with its `counts` (trials per status)."""
        with self._read() as s:
            sweep = s.get(Sweep, sweep_id)
            if sweep is None:
                return None
            return sweep_record(sweep, self._counts(s, [sweep_id])[sweep_id])

    def list_sweeps(
        self, limit: int = 50, offset: int = 0, status: str | None = None,
        specs: bool = True,
    ) -> list[SweepRecord]:
        """Sweeps, newest first, each with `counts`. `specs=False`: only a study's spec is
        read (a listing drops them; the largest spec a submit takes is ~86 kB, and a page
        of 1000 such was ~190 MB in memory)."""
        with self._read() as s:
            stmt = select(Sweep).order_by(Sweep.created_at.desc(), Sweep.id.desc())
            if status is not None:
                stmt = stmt.where(Sweep.status == status)
            if not specs:
                stmt = stmt.options(defer(Sweep.spec))
            sweeps = list(s.scalars(stmt.limit(limit).offset(offset)))
            counts = self._counts(s, [x.id for x in sweeps])
            if specs:
                return [sweep_record(x, counts[x.id]) for x in sweeps]
            studies = [x.id for x in sweeps if x.study is not None]
            spec_of = {sweep_id: spec for chunk in chunks(studies)
                       for sweep_id, spec in s.execute(select(Sweep.id, Sweep.spec)
                                                       .where(Sweep.id.in_(list(chunk))))}
            return [sweep_record(x, counts[x.id], spec=spec_of.get(x.id, {}))
                    for x in sweeps]

    def active_sweeps(self) -> list[SweepRecord]:
        """Pending or running sweeps, oldest first, without counts (the dispatcher's tick)."""
        with self._read() as s:
            stmt = (select(Sweep).where(Sweep.status.in_(ACTIVE_STATUSES))
                    .order_by(Sweep.created_at, Sweep.id))
            return [sweep_record(x) for x in s.scalars(stmt)]

    def stopped_sweep_ids(self, search: str, since: datetime) -> list[str]:
        """Sweeps of that search method that stopped (cancelled, failed, stopped) since."""
        with self._read() as s:
            stmt = (select(Sweep.id)
                    .where(Sweep.status.in_(STOPPED_SWEEP_STATUSES), Sweep.search == search,
                           Sweep.finished_at >= since)
                    .order_by(Sweep.created_at, Sweep.id))
            return list(s.scalars(stmt))

    def status_counts(self, sweep_id: str) -> dict[str, int]:
        """Number of trials in every status (zeros included)."""
        with self._read() as s:
            return self._counts(s, [sweep_id])[sweep_id]

    def stage_counts(self, sweep_id: str) -> dict[str | None, dict[str, int]]:
        """Trials per study stage and status (stage None: trials outside a study)."""
        return self.stage_counts_of([sweep_id])[sweep_id]

    def stage_counts_of(
        self, sweep_ids: Sequence[str]
    ) -> dict[str, dict[str | None, dict[str, int]]]:
        """`stage_counts` of several sweeps in one query (per chunk of ids)."""
        out: dict[str, dict[str | None, dict[str, int]]] = {sid: {} for sid in sweep_ids}
        with self._read() as s:
            for chunk in chunks(list(sweep_ids)):
                stmt = (select(Trial.sweep_id, Trial.stage, Trial.status, func.count())
                        .where(Trial.sweep_id.in_(list(chunk)))
                        .group_by(Trial.sweep_id, Trial.stage, Trial.status))
                for sid, stage, status, n in s.execute(stmt):
                    out[sid].setdefault(stage, dict.fromkeys(TRIAL_STATUSES, 0))[status] = int(n)
        return out

    @staticmethod
    def _counts(s: Session, sweep_ids: Sequence[str]) -> dict[str, dict[str, int]]:
        out = {sid: dict.fromkeys(TRIAL_STATUSES, 0) for sid in sweep_ids}
        for chunk in chunks(list(sweep_ids)):
            stmt = (
                select(Trial.sweep_id, Trial.status, func.count())
                .where(Trial.sweep_id.in_(list(chunk)))
                .group_by(Trial.sweep_id, Trial.status)
            )
            for sid, status, n in s.execute(stmt):
                out[sid][status] = int(n)
        return out

    def mean_wall_times(self, sweep_ids: Sequence[str]) -> dict[str, float]:
        """Mean wall time of the completed trials that ran (not reused), per sweep."""
        out: dict[str, float] = {}
        with self._read() as s:
            for chunk in chunks(list(sweep_ids)):
                stmt = (select(Trial.sweep_id, func.avg(Trial.wall_time_s))
                        .where(Trial.sweep_id.in_(list(chunk)), Trial.status == "completed",
                               Trial.reused_from.is_(None), Trial.wall_time_s > 0)
                        .group_by(Trial.sweep_id))
                out.update({sid: float(v) for sid, v in s.execute(stmt) if v is not None})
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
        stage: str | None = None,
        curves: bool = True,
    ) -> list[TrialRecord]:
        """A page of a sweep's trials in plan order (idx), optionally filtered. With
        `curves=False` each result comes without its curve, left in the database (a curve
        has a point per evaluation: a page of them can be hundreds of MB)."""
        stmt = filtered(select(Trial).where(Trial.sweep_id == sweep_id),
                        TrialFilters(status, arm, width, depth, sigma_base, seed, stage))
        stmt = stmt.order_by(Trial.idx).offset(offset)
        if limit is not None:
            stmt = stmt.limit(limit)
        with self._read() as s:
            if curves:
                return [trial_record(t) for t in s.scalars(stmt)]
            slim = stmt.add_columns(self._result_without_curve()).options(defer(Trial.result))
            return [trial_record(t, result=result) for t, result in s.execute(slim)]

    def leasable(self, sweep_id: str, limit: int) -> list[TrialRecord]:
        """The first `limit` pending trials of a sweep that `lease_pending` would lease, in
        plan order (what the dispatcher plans its packs over)."""
        stmt = (select(Trial).join(Sweep, Sweep.id == Trial.sweep_id)
                .where(Trial.sweep_id == sweep_id, Trial.status == "pending",
                       ~_waits_for_twin())
                .order_by(Trial.idx).limit(limit))
        with self._read() as s:
            return [trial_record(t) for t in s.scalars(stmt)]

    def _result_without_curve(self) -> Any:
        """The result column less its `curve`, computed by the database."""
        if self.dialect == "postgresql":
            return sql_cast(sql_cast(Trial.result, JSONB).op("-")("curve"), JSON)
        return func.json_remove(Trial.result, "$.curve", type_=JSON)

    def count_trials(
        self,
        sweep_id: str,
        status: str | Sequence[str] | None = None,
        arm: str | None = None,
        width: int | None = None,
        depth: int | None = None,
        sigma_base: float | None = None,
        seed: int | None = None,
        stage: str | None = None,
    ) -> int:
        stmt = filtered(
            select(func.count()).select_from(Trial).where(Trial.sweep_id == sweep_id),
            TrialFilters(status, arm, width, depth, sigma_base, seed, stage))
        with self._read() as s:
            return int(s.scalar(stmt) or 0)

    def get_trial(self, trial_id: str) -> TrialRecord | None:
        with self._read() as s:
            trial = s.get(Trial, trial_id)
            return None if trial is None else trial_record(trial)

    # ---------------------------------------------------------------- leasing

    def lease_pending(
        self,
        owner: str,
        limit: int,
        sweep_id: str | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        ids: Sequence[str] | None = None,
    ) -> list[TrialRecord]:
        """Atomically move up to `limit` pending trials to running under `owner`'s lease.

        Oldest sweep first, then plan order; with `ids`, only those trials (the dispatcher
        leases a pack's members together). Safe with several coordinators: a trial is
        never leased twice. The leased trials' sweeps become running. A trial waiting for an
        identical one planned before it is not leased (see `_waits_for_twin`).
        """
        if limit <= 0:
            return []
        now = utcnow()
        with self._write() as s:
            stmt = (
                select(Trial.id)
                .join(Sweep, Sweep.id == Trial.sweep_id)
                .where(Trial.status == "pending", Sweep.status.in_(ACTIVE_STATUSES),
                       ~_waits_for_twin())
                .order_by(Sweep.created_at, Sweep.id, Trial.idx)
                .limit(limit)
            )
            if sweep_id is not None:
                stmt = stmt.where(Trial.sweep_id == sweep_id)
            if ids is not None:
                stmt = stmt.where(Trial.id.in_(list(ids)))
            if self.dialect == "postgresql":
                # Rows another coordinator is leasing right now are skipped, not waited on.
                stmt = stmt.with_for_update(skip_locked=True, of=Trial)
            ids = list(s.scalars(stmt))
            if not ids:
                return []
            bulk_update(
                s,
                update(Trial)
                .where(Trial.id.in_(ids), Trial.status == "pending")  # belt and braces
                .values(
                    status="running",
                    attempts=Trial.attempts + 1,
                    lease_owner=owner,
                    lease_expires_at=now + timedelta(seconds=lease_seconds),
                    started_at=now,
                    finished_at=None,
                ),
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
            bulk_update(
                s,
                update(Sweep)
                .where(Sweep.id.in_(to_start))
                .values(status="running", started_at=now),
            )
            _add_attempts(s, ids, "running", now)  # every lease is an attempt
            leased = s.scalars(
                select(Trial)
                .join(Sweep, Sweep.id == Trial.sweep_id)
                .where(Trial.id.in_(ids), Trial.status == "running", Trial.lease_owner == owner)
                .order_by(Sweep.created_at, Sweep.id, Trial.idx)
            )
            return [trial_record(t) for t in leased]

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
        requires that coordinator to still hold the lease. A completed trial's twins that
        waited for it complete with its result in the same transaction (`_settle_twins`).
        """
        if status not in TRIAL_STATUSES or not TrialStatus(status).is_finished():
            raise ValueError(f"finish status must be a finished one, got {status!r}")
        values: dict[str, Any] = {
            "status": status, "finished_at": utcnow(), "lease_expires_at": None,
            "error": redact(error),
        }
        if worker_node is not None:
            values["worker_node"] = worker_node
        if result is not None:
            dumped = dump_model(result)
            if dumped.get("error"):  # a traceback may quote a URL with its password
                dumped["error"] = redact(dumped["error"])
            values["result"] = dumped
            values.update(result_columns(dumped))
            if dumped.get("data_hash"):
                # The worker's hash is what the data really was; reuse keys on it.
                values["data_hash"] = dumped["data_hash"]
            if error is None and dumped.get("error"):
                values["error"] = dumped["error"]
        stmt = update(Trial).where(Trial.id == trial_id, Trial.status == "running")
        if owner is not None:
            stmt = stmt.where(Trial.lease_owner == owner)
        with self._write() as s:
            if bulk_update(s, stmt.values(**values)) != 1:
                return False
            _end_attempt(s, trial_id, status, values["error"], result is not None)
            if status == "completed" and result is not None:
                self._settle_twins(s, trial_id)
            return True

    @staticmethod
    def _settle_twins(s: Session, trial_id: str) -> None:
        """The pending trials that waited for completed `trial_id` (`_waits_for_twin`) take
        its result, as a finished donor's is reused (each with its one finished attempt)."""
        done = s.get(Trial, trial_id)
        if done is None:
            return
        twins = list(s.scalars(
            select(Trial.id).join(Sweep, Sweep.id == Trial.sweep_id).where(
                _may_wait_for_twin(), Trial.sweep_id == done.sweep_id,
                Trial.content_hash == done.content_hash, Trial.status == "pending",
                Trial.data_hash == done.data_hash, Trial.id != done.id)))
        if not twins:
            return
        now = utcnow()
        values = {**reused_values(trial_record(done), now), "lease_owner": None,
                  "lease_expires_at": None, "error": None}
        bulk_update(s, update(Trial).where(Trial.id.in_(twins), Trial.status == "pending")
                    .values(**values))
        _add_attempts(s, twins, "completed", now)

    def requeue(self, trial_id: str, error: str | None, owner: str | None = None) -> str:
        """After a retryable failure: back to pending while attempts < max_attempts, else
        failed; cancelled instead if its sweep has stopped (cancelled or failed meanwhile),
        which leases nothing again. Returns the trial's status afterwards (unchanged unless
        it was running, and with `owner`, leased by that coordinator)."""
        with self._write() as s:
            sweep_id = s.scalar(select(Trial.sweep_id).where(Trial.id == trial_id))
            if sweep_id is None:
                raise NotFoundError(f"no trial {trial_id!r}")
            # the sweep before the trial, as cancel_sweep locks them: it cannot stop unseen
            sweep = _locked_sweep(s, sweep_id)
            trial = s.get(Trial, trial_id, with_for_update=True)
            if trial.status != "running" or owner is not None and trial.lease_owner != owner:
                return trial.status  # another lease's outcome, not this one's to end
            error = redact(error)
            _end_attempt(s, trial_id, "failed", error)
            trial.error = error
            trial.lease_owner = trial.lease_expires_at = None
            if sweep.status in STOPPED_SWEEP_STATUSES:
                trial.status, trial.finished_at = "cancelled", utcnow()
            elif trial.attempts < trial.max_attempts:
                trial.status, trial.started_at, trial.worker_node = "pending", None, None
            else:
                trial.status, trial.finished_at = "failed", utcnow()
            return trial.status

    def requeue_orphans(self, live_owner: str, expired_only: bool = False) -> int:
        """Running trials leased by another (dead) coordinator go back to pending.

        Called at coordinator start-up. The interrupted attempt is not counted (the trial did
        not fail), unless it is the trial's MAX_ORPHANED_ATTEMPTS-th so interrupted: then the
        trial fails, saying so. Orphans of a cancelled/failed sweep become cancelled. With
        `expired_only`, only leases past their expiry are taken: use that when several
        coordinators share the database and renew their leases. Returns the number requeued.
        """
        orphan = [
            Trial.status == "running",
            or_(Trial.lease_owner.is_(None), Trial.lease_owner != live_owner),
        ]
        if expired_only:
            orphan.append(
                or_(Trial.lease_expires_at.is_(None), Trial.lease_expires_at < utcnow())
            )
        return self._release(orphan, ORPHANED)

    def release(self, trial_ids: Sequence[str], owner: str) -> int:
        """Trials `owner` leased whose task could not be submitted go back to pending, the
        attempt not counted (it never started); returns how many."""
        return self._release([Trial.status == "running", Trial.lease_owner == owner,
                              Trial.id.in_(list(trial_ids))], NOT_STARTED)

    def _release(self, where: list, why: str) -> int:
        """Running trials matching `where` back to pending (cancelled if their sweep has
        stopped), their running attempt cancelled with `why` and not counted."""
        now = utcnow()
        stopped = select(Sweep.id).where(Sweep.status.in_(STOPPED_SWEEP_STATUSES))
        released = {"lease_owner": None, "lease_expires_at": None}
        with self._write() as s:
            # their sweeps locked first, as cancel_sweep locks them: no sweep can stop
            # between the statements below and leave a trial pending in a stopped sweep
            s.execute(select(Sweep.id)
                      .where(Sweep.id.in_(select(Trial.sweep_id).where(*where)))
                      .order_by(Sweep.id).with_for_update(key_share=True))
            bulk_update(
                s,
                update(Attempt)
                .where(Attempt.status == "running",
                       Attempt.trial_id.in_(select(Trial.id).where(*where)))
                .values(status="cancelled", error=why, finished_at=now),
            )
            bulk_update(
                s,
                update(Trial)
                .where(*where, Trial.sweep_id.in_(stopped))
                .values(status="cancelled", finished_at=now, **released),
            )
            if why == ORPHANED:
                interrupted = (select(func.count()).select_from(Attempt)
                               .where(Attempt.trial_id == Trial.id, Attempt.error == ORPHANED)
                               .scalar_subquery())
                bulk_update(
                    s,
                    update(Trial)
                    .where(*where, interrupted >= MAX_ORPHANED_ATTEMPTS)
                    .values(status="failed", finished_at=now, error=(
                        f"its coordinator died during {MAX_ORPHANED_ATTEMPTS} of its attempts; "
                        "not re-queued again (is it what takes the coordinator down? look "
                        "for the host running out of memory)"), **released),
                )
            return bulk_update(
                s,
                update(Trial)
                .where(*where)
                .values(
                    status="pending",
                    attempts=case((Trial.attempts > 0, Trial.attempts - 1), else_=0),
                    started_at=None,
                    worker_node=None,
                    **released,
                ),
            )

    # ---------------------------------------------------------------- cancelling

    def cancel_sweep(self, sweep_id: str) -> list[str]:
        """Cancel a sweep: pending trials become cancelled; returns the ids of its running
        trials, which the dispatcher must cancel (then `mark_cancelled`)."""
        now = utcnow()
        with self._write() as s:
            # Sweep row first: a concurrent add_trial either committed before (its trial is
            # cancelled below) or sees the cancelled sweep and refuses.
            sweep = _locked_sweep(s, sweep_id)
            bulk_update(
                s,
                update(Trial)
                .where(Trial.sweep_id == sweep_id, Trial.status == "pending")
                .values(status="cancelled", finished_at=now),
            )
            if sweep.status in ACTIVE_STATUSES:
                sweep.status, sweep.finished_at = "cancelled", now
            running = select(Trial.id).where(
                Trial.sweep_id == sweep_id, Trial.status == "running"
            )
            return list(s.scalars(running.order_by(Trial.idx)))

    def fail_sweep(self, sweep_id: str, error: str) -> None:
        """A sweep that cannot run (e.g. its stored spec no longer validates): failed with
        the reason, its pending trials cancelled; running ones are the dispatcher's."""
        now = utcnow()
        with self._write() as s:
            sweep = _locked_sweep(s, sweep_id)
            bulk_update(s, update(Trial)
                        .where(Trial.sweep_id == sweep_id, Trial.status == "pending")
                        .values(status="cancelled", finished_at=now))
            sweep.status, sweep.error, sweep.finished_at = "failed", redact(error), now

    def mark_cancelled(self, trial_id: str, owner: str | None = None) -> bool:
        """A pending or running trial becomes cancelled; False if it had already finished
        (or, with `owner`, is not running under that coordinator's lease)."""
        stmt = (
            update(Trial)
            .where(Trial.id == trial_id, Trial.status.in_(ACTIVE_STATUSES))
            .values(status="cancelled", finished_at=utcnow(), lease_expires_at=None)
        )
        if owner is not None:
            stmt = stmt.where(Trial.status == "running", Trial.lease_owner == owner)
        with self._write() as s:
            if bulk_update(s, stmt) != 1:
                return False
            _end_attempt(s, trial_id, "cancelled", None)
            return True

    # ---------------------------------------------------------------- sweep status

    def set_sweep_status(self, sweep_id: str, status: str, error: str | None = None) -> None:
        if status not in SWEEP_STATUSES:
            raise ValueError(f"sweep status must be one of {SWEEP_STATUSES}, got {status!r}")
        now = utcnow()
        values: dict[str, Any] = {"status": status, "error": redact(error)}
        if status == "running":
            values["started_at"] = func.coalesce(Sweep.started_at, now)
            values["finished_at"] = None
        elif status != "pending":
            values["finished_at"] = now
        stmt = update(Sweep).where(Sweep.id == sweep_id).values(**values)
        with self._write() as s:
            if bulk_update(s, stmt) == 0:
                raise NotFoundError(f"no sweep {sweep_id!r}")

    def refresh_sweep_status(self, sweep_id: str) -> str:
        """Running while any trial is pending or running, else completed (a cancelled or
        failed sweep keeps its status). Returns the status."""
        now = utcnow()
        with self._write() as s:
            # Locked before counting, so a trial added concurrently is counted.
            sweep = _locked_sweep(s, sweep_id)
            if sweep.status in STOPPED_SWEEP_STATUSES:
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
            if bulk_update(s, stmt) == 0:
                raise NotFoundError(f"no sweep {sweep_id!r}")

    # ---------------------------------------------------------------- MLflow mirror

    def sweeps_to_mirror(self) -> list[SweepRecord]:
        """Sweeps without an MLflow parent run yet, or whose status changed since mirrored."""
        stmt = (select(Sweep)
                .where(or_(Sweep.mlflow_run_id.is_(None),
                           Sweep.mlflow_synced_status.is_distinct_from(Sweep.status)))
                .order_by(Sweep.created_at, Sweep.id))
        with self._read() as s:
            return [sweep_record(x) for x in s.scalars(stmt)]

    def mark_sweep_mirrored(self, sweep_id: str, status: str) -> None:
        with self._write() as s:
            bulk_update(s, update(Sweep).where(Sweep.id == sweep_id)
                        .values(mlflow_synced_status=status))

    def attempts_to_mirror(self, limit: int = 200) -> list[AttemptRecord]:
        """Attempts whose status differs from the one last copied to MLflow, oldest first
        (only of sweeps whose parent run exists: a run is created under it)."""
        return self._attempt_records(
            _ATTEMPTS.where(Attempt.mlflow_synced_status.is_distinct_from(Attempt.status),
                            Sweep.mlflow_run_id.is_not(None))
            .order_by(Attempt.started_at, Attempt.trial_id, Attempt.seq).limit(limit))

    def attempts(self, trial_id: str) -> list[AttemptRecord]:
        """Every lease of a trial, in order."""
        return self._attempt_records(
            _ATTEMPTS.where(Attempt.trial_id == trial_id).order_by(Attempt.seq))

    def _attempt_records(self, stmt: Select[Any]) -> list[AttemptRecord]:
        with self._read() as s:
            return [_attempt_record(*row) for row in s.execute(stmt)]

    def set_attempt_run(self, trial_id: str, seq: int, run_id: str) -> None:
        """The attempt's MLflow run; also the trial's while this is its latest attempt."""
        with self._write() as s:
            bulk_update(s, update(Attempt)
                        .where(Attempt.trial_id == trial_id, Attempt.seq == seq)
                        .values(mlflow_run_id=run_id))
            latest = select(func.max(Attempt.seq)).where(Attempt.trial_id == trial_id)
            bulk_update(s, update(Trial)
                        .where(Trial.id == trial_id, latest.scalar_subquery() == seq)
                        .values(mlflow_run_id=run_id))

    def mark_attempt_mirrored(self, trial_id: str, seq: int, status: str) -> None:
        with self._write() as s:
            bulk_update(s, update(Attempt)
                        .where(Attempt.trial_id == trial_id, Attempt.seq == seq)
                        .values(mlflow_synced_status=status))

    def mirror_backlog(self, sweep_id: str | None = None) -> int:
        """Sweeps and attempts MLflow does not show as they are in this database (0: caught
        up)."""
        sweeps = select(func.count()).select_from(Sweep).where(or_(
            Sweep.mlflow_run_id.is_(None),
            Sweep.mlflow_synced_status.is_distinct_from(Sweep.status)))
        attempts = (select(func.count()).select_from(Attempt)
                    .join(Trial, Trial.id == Attempt.trial_id)
                    .where(Attempt.mlflow_synced_status.is_distinct_from(Attempt.status)))
        if sweep_id is not None:
            sweeps = sweeps.where(Sweep.id == sweep_id)
            attempts = attempts.where(Trial.sweep_id == sweep_id)
        with self._read() as s:
            return int(s.scalar(sweeps) or 0) + int(s.scalar(attempts) or 0)

    # ---------------------------------------------------------------- analysis

    def results_frame(self, sweep_id: str) -> pd.DataFrame:
        """One row per trial, columns `RESULT_FRAME_COLUMNS` (what the analysis consumes)."""
        with self._read() as s:
            rows = s.execute(results_query(sweep_id)).all()
        return results_to_frame(rows)
