"""Attempts: one row per lease of a trial (or per reused result), what MLflow mirrors as a run.

Helpers the operations share: how an attempt starts, how it ends, and how it reads back as a
record together with what its run needs from its trial and sweep.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Select, func, insert, select, update
from sqlalchemy.orm import Session

from hptransfer.contracts.records import AttemptRecord
from hptransfer.contracts.status import TrialStatus

from .query import bulk_update
from .rows import utcnow
from .schema import Attempt, Sweep, Trial

# an attempt with what its MLflow run needs from its trial and sweep (see attempt_record)
ATTEMPTS = (select(Attempt, Trial.sweep_id, Trial.arm, Trial.spec, Trial.result,
                   Trial.reused_from, Sweep.mlflow_experiment_id, Sweep.mlflow_run_id)
            .join(Trial, Trial.id == Attempt.trial_id)
            .join(Sweep, Sweep.id == Trial.sweep_id))


def attempt_row(trial_id: str, seq: int, status: str, now: datetime) -> dict[str, Any]:
    """Insert values of an attempt starting now: running, or finished at once with its
    trial's (reused) result."""
    running = status == TrialStatus.RUNNING
    return {"trial_id": trial_id, "seq": seq, "status": status, "error": None,
            "has_result": not running, "started_at": now, "finished_at": None if running else now,
            "mlflow_run_id": None, "mlflow_synced_status": None}


def add_attempts(s: Session, trial_ids: list[str], status: str, now: datetime) -> None:
    """One new attempt per trial, its seq after the trial's earlier ones (see attempt_row).
    The trial's `attempts` counts its attempt rows: raised here, in the same transaction."""
    last_seq = dict(s.execute(
        select(Attempt.trial_id, func.max(Attempt.seq))
        .where(Attempt.trial_id.in_(trial_ids)).group_by(Attempt.trial_id)).all())
    s.execute(insert(Attempt), [attempt_row(tid, (last_seq.get(tid) or 0) + 1, status, now)
                                for tid in trial_ids])
    bulk_update(s, update(Trial).where(Trial.id.in_(trial_ids))
                .values(attempts=Trial.attempts + 1))


def charged_attempts(s: Session, trial_id: str) -> int:
    """The trial's attempts its retry budget (`max_attempts`) counts: every one but those
    cancelled unfinished (its coordinator died, or its task was never submitted)."""
    return int(s.scalar(select(func.count()).select_from(Attempt).where(
        Attempt.trial_id == trial_id, Attempt.status != TrialStatus.CANCELLED)) or 0)


def end_attempt(s: Session, trial_id: str, status: str, error: str | None,
                has_result: bool = False) -> None:
    """The trial's running attempt ends with the trial's (or the lost worker's) outcome."""
    bulk_update(s, update(Attempt)
                .where(Attempt.trial_id == trial_id, Attempt.status == TrialStatus.RUNNING)
                .values(status=status, error=error, has_result=has_result,
                        finished_at=utcnow()))


def attempt_record(a: Attempt, sweep_id: str, arm: str, spec: dict[str, Any],
                   result: dict[str, Any] | None, reused_from: str | None,
                   experiment_id: str | None, parent_run_id: str | None) -> AttemptRecord:
    """One row of `ATTEMPTS` as a record (the result only where this attempt produced it)."""
    return AttemptRecord(
        trial_id=a.trial_id, seq=a.seq, status=a.status, error=a.error,
        started_at=a.started_at, finished_at=a.finished_at, mlflow_run_id=a.mlflow_run_id,
        mlflow_synced_status=a.mlflow_synced_status, sweep_id=sweep_id,
        experiment_id=experiment_id, parent_run_id=parent_run_id, arm=arm, spec=spec,
        result=result if a.has_result else None, reused_from=reused_from)


def attempt_records(s: Session, stmt: Select[Any]) -> list[AttemptRecord]:
    """The records of an `ATTEMPTS` query."""
    return [attempt_record(*row) for row in s.execute(stmt)]
