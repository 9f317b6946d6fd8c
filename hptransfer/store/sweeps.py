"""A sweep's lifecycle: creating it with its planned trials, appending trials, and its status
from pending to running to completed (or cancelled, failed, stopped)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any, cast

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from hptransfer.contracts.status import SweepStatus, TrialStatus
from hptransfer.redaction import redact

from .base import NotFoundError, StoreError, locked_sweep
from .query import bulk_update
from .reuse import insert_trials, sweep_donors
from .rows import PlannedRow, new_id, trial_row, utcnow
from .schema import ACTIVE_STATUSES, STOPPED_SWEEP_STATUSES, SWEEP_STATUSES, Sweep, Trial
from .submissions import Submissions, claim, earlier_sweep
from .sweep_status import settle_status


class SweepLifecycle(Submissions):
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
        idempotency: tuple[str, str] | None = None,
    ) -> str:
        """Insert a sweep and all its planned trials in one transaction; return the sweep id.

        `idempotency`: (key, body hash) of the request: if that key already created a sweep
        for that body within the window, nothing is inserted and that sweep's id returned
        (IdempotencyConflict for another body); else the key is recorded for this sweep.

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
        sweep = Sweep(
            id=sweep_id, name=name, spec=dict(spec), spec_hash=spec_hash,
            status=SweepStatus.PENDING, search=search, data_hash=data_hash, reuse=reuse,
            max_attempts=max_attempts, n_trials=len(items), created_at=now,
            max_concurrent=max_concurrent,
            planned_total=len(items) if planned_total is None else planned_total,
            study=dict(study) if study is not None else None,
        )
        try:
            with self._write() as s:
                if idempotency is not None:
                    earlier = earlier_sweep(s, *idempotency, now)
                    if earlier is not None:
                        return earlier
                self._insert_sweep(s, sweep, items, study is None, now)
                if idempotency is not None:
                    claim(s, *idempotency, sweep_id, now)
        except IntegrityError:
            # PostgreSQL: an identical submit claimed the key first; its sweep is the answer
            earlier = self.submitted_sweep(*idempotency) if idempotency is not None else None
            if earlier is None:
                raise
            return earlier
        return sweep_id

    def _insert_sweep(self, s: Session, sweep: Sweep, items: list[Any], plain: bool,
                      now: datetime) -> None:
        """The sweep row, then its trials (reused ones completed); a plain sweep (no study)
        whose every trial was reused is completed at once."""
        sweep_id = sweep.id
        donors = sweep_donors(s, sweep, [p.content_hash for p in items])
        s.add(sweep)
        s.flush()  # the sweep row first: every trial references it
        rows = [trial_row(sweep_id, idx, p, sweep.data_hash, sweep.max_attempts, now, donors)
                for idx, p in enumerate(items)]
        insert_trials(s, rows, now)
        if plain and rows and all(r["status"] == TrialStatus.COMPLETED for r in rows):
            # Everything was reused: nothing will ever be dispatched to finish it.
            sweep.status, sweep.started_at, sweep.finished_at = SweepStatus.COMPLETED, now, now

    def add_trial(
        self, sweep_id: str, planned: PlannedRow, optuna_trial_number: int | None = None
    ) -> str:
        """Append one trial to a sweep (Optuna mode asks trials one at a time)."""
        now = utcnow()
        with self._write() as s:
            # Row lock (PostgreSQL) so concurrent adds get distinct idx values.
            sweep = locked_sweep(s, sweep_id)
            if sweep.status in STOPPED_SWEEP_STATUSES:
                raise StoreError(f"sweep {sweep_id} is {sweep.status}; cannot add trials")
            row = trial_row(
                sweep_id, next_idx(s, sweep_id), planned, sweep.data_hash, sweep.max_attempts,
                now, sweep_donors(s, sweep, [planned.content_hash]), optuna_trial_number,
            )
            insert_trials(s, [row], now)
            sweep.n_trials += 1
            if row["status"] == TrialStatus.PENDING and sweep.status == SweepStatus.COMPLETED:
                sweep.status, sweep.finished_at = SweepStatus.RUNNING, None  # more work arrived
        return cast(str, row["id"])

    def cancel_sweep(self, sweep_id: str) -> list[str]:
        """Cancel a sweep: pending trials become cancelled; returns the ids of its running
        trials, which the dispatcher must cancel (then `mark_cancelled`)."""
        now = utcnow()
        with self._write() as s:
            # Sweep row first: a concurrent add_trial either committed before (its trial is
            # cancelled below) or sees the cancelled sweep and refuses.
            sweep = locked_sweep(s, sweep_id)
            cancel_pending(s, sweep_id, now)
            if sweep.status in ACTIVE_STATUSES:
                sweep.status, sweep.finished_at = SweepStatus.CANCELLED, now
            running = select(Trial.id).where(
                Trial.sweep_id == sweep_id, Trial.status == TrialStatus.RUNNING
            )
            return list(s.scalars(running.order_by(Trial.idx)))

    def fail_sweep(self, sweep_id: str, error: str) -> None:
        """A sweep that cannot run (e.g. its stored spec no longer validates): failed with
        the reason, its pending trials cancelled; running ones are the dispatcher's."""
        now = utcnow()
        with self._write() as s:
            sweep = locked_sweep(s, sweep_id)
            cancel_pending(s, sweep_id, now)
            sweep.status, sweep.error, sweep.finished_at = SweepStatus.FAILED, redact(error), now

    def set_sweep_status(self, sweep_id: str, status: str, error: str | None = None) -> None:
        if status not in SWEEP_STATUSES:
            raise ValueError(f"sweep status must be one of {SWEEP_STATUSES}, got {status!r}")
        now = utcnow()
        values: dict[str, Any] = {"status": status, "error": redact(error)}
        if status == SweepStatus.RUNNING:
            values["started_at"] = func.coalesce(Sweep.started_at, now)
            values["finished_at"] = None
        elif status != SweepStatus.PENDING:
            values["finished_at"] = now
        stmt = update(Sweep).where(Sweep.id == sweep_id).values(**values)
        with self._write() as s:
            if bulk_update(s, stmt) == 0:
                raise NotFoundError(f"no sweep {sweep_id!r:.80}")

    def refresh_sweep_status(self, sweep_id: str) -> str:
        """Running while any trial is pending or running, else completed, or failed when
        every trial failed (see sweep_status.py; a cancelled, failed or stopped sweep keeps
        its status). Returns the status."""
        with self._write() as s:
            # Locked before counting, so a trial added concurrently is counted.
            return settle_status(s, locked_sweep(s, sweep_id), utcnow())


def next_idx(s: Session, sweep_id: str) -> int:
    """The plan position after the sweep's last trial (0 for the first)."""
    last = s.scalar(select(func.max(Trial.idx)).where(Trial.sweep_id == sweep_id))
    return 0 if last is None else last + 1


def cancel_pending(s: Session, sweep_id: str, now: datetime) -> None:
    """The sweep's pending trials become cancelled (they will never be leased)."""
    bulk_update(s, update(Trial)
                .where(Trial.sweep_id == sweep_id, Trial.status == TrialStatus.PENDING)
                .values(status=TrialStatus.CANCELLED, finished_at=now))
