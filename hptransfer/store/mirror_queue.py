"""What the MLflow mirror (tracking/mirror.py) reads and marks: sweeps and attempts whose
status MLflow does not show yet, the MLflow ids they were given, and how far behind it is."""

from __future__ import annotations

from sqlalchemy import ColumnElement, func, or_, select, update

from hptransfer.contracts.records import AttemptRecord, SweepRecord

from .attempts import ATTEMPTS, attempt_records
from .base import NotFoundError, StoreBase
from .query import bulk_update
from .rows import sweep_record
from .schema import Attempt, Sweep, Trial


def _sweep_unmirrored() -> ColumnElement[bool]:
    """A sweep without an MLflow parent run yet, or whose status changed since mirrored."""
    return or_(Sweep.mlflow_run_id.is_(None),
               Sweep.mlflow_synced_status.is_distinct_from(Sweep.status))


def _attempt_unmirrored() -> ColumnElement[bool]:
    """An attempt whose status differs from the one last copied to MLflow."""
    return Attempt.mlflow_synced_status.is_distinct_from(Attempt.status)


class MirrorQueue(StoreBase):
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
                raise NotFoundError(f"no sweep {sweep_id!r:.80}")

    def sweeps_to_mirror(self) -> list[SweepRecord]:
        """Sweeps without an MLflow parent run yet, or whose status changed since mirrored."""
        stmt = select(Sweep).where(_sweep_unmirrored()).order_by(Sweep.created_at, Sweep.id)
        with self._read() as s:
            return [sweep_record(x) for x in s.scalars(stmt)]

    def mark_sweep_mirrored(self, sweep_id: str, status: str) -> None:
        with self._write() as s:
            bulk_update(s, update(Sweep).where(Sweep.id == sweep_id)
                        .values(mlflow_synced_status=status))

    def attempts_to_mirror(self, limit: int = 200) -> list[AttemptRecord]:
        """Attempts whose status differs from the one last copied to MLflow, oldest first
        (only of sweeps whose parent run exists: a run is created under it)."""
        stmt = (ATTEMPTS.where(_attempt_unmirrored(), Sweep.mlflow_run_id.is_not(None))
                .order_by(Attempt.started_at, Attempt.trial_id, Attempt.seq).limit(limit))
        with self._read() as s:
            return attempt_records(s, stmt)

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
        sweeps = select(func.count()).select_from(Sweep).where(_sweep_unmirrored())
        attempts = (select(func.count()).select_from(Attempt)
                    .join(Trial, Trial.id == Attempt.trial_id)
                    .where(_attempt_unmirrored()))
        if sweep_id is not None:
            sweeps = sweeps.where(Sweep.id == sweep_id)
            attempts = attempts.where(Trial.sweep_id == sweep_id)
        with self._read() as s:
            return int(s.scalar(sweeps) or 0) + int(s.scalar(attempts) or 0)
