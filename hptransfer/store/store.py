"""Persistence of sweeps and trials: the `Store`, composed of one mixin per kind of operation.

Every public method of `Store` runs its own short transaction and returns frozen records
(records.py: `SweepRecord`, `TrialRecord`, ...), plain values or a DataFrame, never live ORM
objects, so a Store can be shared by the API's threads and the dispatcher's. The same code
runs on SQLite (the embedded default) and PostgreSQL.

Concurrency: several coordinators may lease from one database. On PostgreSQL the lease query
locks its rows with `FOR UPDATE SKIP LOCKED`; on SQLite every write transaction starts with
`BEGIN IMMEDIATE`, which takes the database's single write lock before reading, so two
read-then-write transactions can never interleave (and never fail half-way with "database is
locked": the busy timeout makes the second one wait instead). Writers that touch a sweep and
its trials lock the sweep row first (`base.locked_sweep`), so they cannot deadlock.

The operations: sweeps (create, append, status; with submissions, idempotency keys, and
sweep_status, a sweep's status from its trials), sweep_reads (get, list, counts), studies
(plan a stage, counts per stage), trials (read trials and attempts), leasing (lease,
release, orphans), outcomes (finish, requeue, cancel a trial), mirror_queue (what MLflow
mirrors), with reuse (donors and twins) and attempts (attempt rows) beneath them. Beside them:
base (engine, sessions, errors), schema, engine (URLs, pragmas, migrations), rows (rows to
records), query (filters, chunking, bulk updates) and frame (the results DataFrame). The
names other code imports from here are re-exported below.
"""

from __future__ import annotations

import pandas as pd

from hptransfer.contracts.records import SweepRecord, TrialRecord

from .base import NotFoundError, StoreError
from .engine import (
    MIGRATIONS_DIR,
    SQLITE_BUSY_TIMEOUT_MS,
    alembic_config,
    current_revision,
    make_engine,
    normalize_url,
    packaged_head,
    upgrade_to_head,
)
from .frame import RESULT_FRAME_COLUMNS, results_query, results_to_frame
from .leasing import (
    DEFAULT_LEASE_SECONDS,
    MAX_ORPHANED_ATTEMPTS,
    NOT_STARTED,
    ORPHANED,
    Leasing,
)
from .mirror_queue import MirrorQueue
from .outcomes import Outcomes
from .rows import PlannedRow
from .schema import (
    ACTIVE_STATUSES,
    NAMING_CONVENTION,
    RESULT_COLUMNS,
    SWEEP_STATUSES,
    TRIAL_STATUSES,
    Base,
    Sweep,
    Trial,
    UTCDateTime,
)
from .studies import Studies
from .submissions import IDEMPOTENCY_WINDOW_S, IdempotencyConflict
from .sweep_reads import SweepReads
from .sweeps import SweepLifecycle
from .trials import TrialReads

__all__ = [
    "ACTIVE_STATUSES",
    "DEFAULT_LEASE_SECONDS",
    "IDEMPOTENCY_WINDOW_S",
    "MAX_ORPHANED_ATTEMPTS",
    "MIGRATIONS_DIR",
    "NAMING_CONVENTION",
    "NOT_STARTED",
    "ORPHANED",
    "RESULT_COLUMNS",
    "RESULT_FRAME_COLUMNS",
    "SQLITE_BUSY_TIMEOUT_MS",
    "SWEEP_STATUSES",
    "TRIAL_STATUSES",
    "Base",
    "IdempotencyConflict",
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


class Store(SweepLifecycle, SweepReads, Studies, TrialReads, Leasing, Outcomes, MirrorQueue):
    """The app database: sweeps and their trials."""

    def __repr__(self) -> str:
        return f"Store({self.url_safe!r})"

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

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

    # ---------------------------------------------------------------- analysis

    def results_frame(self, sweep_id: str) -> pd.DataFrame:
        """One row per trial, columns `RESULT_FRAME_COLUMNS` (what the analysis consumes)."""
        with self._read() as s:
            rows = s.execute(results_query(sweep_id)).all()
        return results_to_frame(rows)
