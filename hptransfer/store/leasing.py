"""Leases: pending trials move to running under a coordinator's lease, and go back to pending
when that coordinator died (orphans) or could not submit them to Ray."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, func, or_, select, update
from sqlalchemy.orm import Session

from hptransfer.contracts.records import TrialRecord
from hptransfer.contracts.status import SweepStatus, TrialStatus

from .attempts import add_attempts
from .base import StoreBase
from .query import bulk_update
from .reuse import first_of_twins, may_wait_for_twin, waits_for_twin
from .rows import trial_record, utcnow
from .schema import ACTIVE_STATUSES, STOPPED_SWEEP_STATUSES, Attempt, Sweep, Trial

DEFAULT_LEASE_SECONDS = 6 * 3600  # a backstop for several coordinators (requeue expired_only)
ORPHANED = "coordinator died during this attempt; re-queued"
# A trial whose attempts were cut short this often by its coordinator's death is failed, not
# re-queued again: it may be what takes the coordinator down (a host out of memory), and
# re-queueing it without end would repeat that for good.
MAX_ORPHANED_ATTEMPTS = 5
NOT_STARTED = "its task could not be submitted to Ray; re-queued"
_RELEASED = {"lease_owner": None, "lease_expires_at": None}


class Leasing(StoreBase):
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
        identical one is not leased (see `reuse.waits_for_twin`), nor one identical to a
        trial of another sweep leased in the same call (`reuse.first_of_twins`).
        """
        if limit <= 0:
            return []
        now = utcnow()
        with self._write() as s:
            stmt = (
                select(Trial.id, Trial.content_hash, Trial.data_hash, may_wait_for_twin())
                .join(Sweep, Sweep.id == Trial.sweep_id)
                .where(Trial.status == TrialStatus.PENDING, Sweep.status.in_(ACTIVE_STATUSES),
                       ~waits_for_twin())
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
            ids = first_of_twins(s.execute(stmt).all())
            if not ids:
                return []
            bulk_update(
                s,
                update(Trial)
                .where(Trial.id.in_(ids), Trial.status == TrialStatus.PENDING)  # belt and braces
                .values(
                    status=TrialStatus.RUNNING,
                    lease_owner=owner,
                    lease_expires_at=now + timedelta(seconds=lease_seconds),
                    started_at=now,
                    finished_at=None,
                ),
            )
            self._start_sweeps(s, ids, now)
            add_attempts(s, ids, TrialStatus.RUNNING, now)  # every lease is an attempt, counted
            leased = s.scalars(
                select(Trial)
                .join(Sweep, Sweep.id == Trial.sweep_id)
                .where(Trial.id.in_(ids), Trial.status == TrialStatus.RUNNING,
                       Trial.lease_owner == owner)
                .order_by(Sweep.created_at, Sweep.id, Trial.idx)
            )
            return [trial_record(t) for t in leased]

    def _start_sweeps(self, s: Session, trial_ids: list[str], now: datetime) -> None:
        """The pending sweeps of the leased trials become running."""
        to_start = select(Sweep.id).where(
            Sweep.id.in_(select(Trial.sweep_id).where(Trial.id.in_(trial_ids))),
            Sweep.status == SweepStatus.PENDING,
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
            .values(status=SweepStatus.RUNNING, started_at=now),
        )

    def requeue_orphans(self, live_owner: str, expired_only: bool = False) -> int:
        """Running trials leased by another (dead) coordinator go back to pending.

        Called at coordinator start-up. The interrupted attempt stays in `attempts` (it was
        one) but is not charged to the retry budget (the trial did not fail), unless it is
        the trial's MAX_ORPHANED_ATTEMPTS-th so interrupted: then the trial fails, saying so.
        Orphans of a cancelled/failed sweep become cancelled. With `expired_only`, only leases
        past their expiry are taken: use that when several coordinators share the database
        and renew their leases. Returns the number requeued.
        """
        orphan = [
            Trial.status == TrialStatus.RUNNING,
            or_(Trial.lease_owner.is_(None), Trial.lease_owner != live_owner),
        ]
        if expired_only:
            orphan.append(
                or_(Trial.lease_expires_at.is_(None), Trial.lease_expires_at < utcnow())
            )
        return self._release(orphan, ORPHANED)

    def leased_ids(self, owner: str) -> list[str]:
        """The trials running under `owner`'s lease."""
        with self._read() as s:
            return list(s.scalars(select(Trial.id).where(Trial.status == TrialStatus.RUNNING,
                                                         Trial.lease_owner == owner)))

    def release(self, trial_ids: Sequence[str], owner: str) -> int:
        """Trials `owner` leased whose task could not be submitted go back to pending, the
        attempt not charged (it never started); returns how many."""
        return self._release([Trial.status == TrialStatus.RUNNING, Trial.lease_owner == owner,
                              Trial.id.in_(list(trial_ids))], NOT_STARTED)

    def _release(self, where: list[ColumnElement[bool]], why: str) -> int:
        """Running trials matching `where` back to pending (cancelled if their sweep has
        stopped), their running attempt cancelled with `why`: counted in `attempts`, not
        charged to the retry budget (`attempts.charged_attempts`)."""
        now = utcnow()
        stopped = select(Sweep.id).where(Sweep.status.in_(STOPPED_SWEEP_STATUSES))
        with self._write() as s:
            # their sweeps locked first, as cancel_sweep locks them: no sweep can stop
            # between the statements below and leave a trial pending in a stopped sweep
            s.execute(select(Sweep.id)
                      .where(Sweep.id.in_(select(Trial.sweep_id).where(*where)))
                      .order_by(Sweep.id).with_for_update(key_share=True))
            bulk_update(
                s,
                update(Attempt)
                .where(Attempt.status == TrialStatus.RUNNING,
                       Attempt.trial_id.in_(select(Trial.id).where(*where)))
                .values(status=TrialStatus.CANCELLED, error=why, finished_at=now),
            )
            bulk_update(
                s,
                update(Trial)
                .where(*where, Trial.sweep_id.in_(stopped))
                .values(status=TrialStatus.CANCELLED, finished_at=now, **_RELEASED),
            )
            if why == ORPHANED:
                _fail_often_orphaned(s, where, now)
            return bulk_update(
                s,
                update(Trial)
                .where(*where)
                .values(
                    status=TrialStatus.PENDING,
                    started_at=None,
                    worker_node=None,
                    **_RELEASED,
                ),
            )


def _fail_often_orphaned(s: Session, where: list[ColumnElement[bool]], now: datetime) -> None:
    """Orphans interrupted MAX_ORPHANED_ATTEMPTS times (this one counted) fail, saying why."""
    interrupted = (select(func.count()).select_from(Attempt)
                   .where(Attempt.trial_id == Trial.id, Attempt.error == ORPHANED)
                   .scalar_subquery())
    values: dict[str, Any] = {
        "status": TrialStatus.FAILED, "finished_at": now, **_RELEASED,
        "error": (f"its coordinator died during {MAX_ORPHANED_ATTEMPTS} of its attempts; "
                  "not re-queued again (is it what takes the coordinator down? look "
                  "for the host running out of memory)"),
    }
    bulk_update(s, update(Trial).where(*where, interrupted >= MAX_ORPHANED_ATTEMPTS)
                .values(**values))
