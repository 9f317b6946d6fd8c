"""A leased trial's outcome: finished (completed, diverged, failed, ...), re-queued after a
retryable failure, or cancelled. Each ends the trial's running attempt with it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import select, update

from hptransfer.contracts.status import TrialStatus
from hptransfer.redaction import redact

from .attempts import charged_attempts, end_attempt
from .base import NotFoundError, StoreBase, locked_sweep
from .query import bulk_update
from .reuse import settle_twins
from .rows import dump_model, result_columns, utcnow
from .schema import ACTIVE_STATUSES, STOPPED_SWEEP_STATUSES, TRIAL_STATUSES, Trial


class Outcomes(StoreBase):
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
        waited for it complete with its result in the same transaction (`settle_twins`).
        """
        if status not in TRIAL_STATUSES or not TrialStatus(status).is_finished():
            raise ValueError(f"finish status must be a finished one, got {status!r}")
        values = _finished_values(status, result, error, worker_node)
        stmt = update(Trial).where(Trial.id == trial_id, Trial.status == TrialStatus.RUNNING)
        if owner is not None:
            stmt = stmt.where(Trial.lease_owner == owner)
        with self._write() as s:
            if bulk_update(s, stmt.values(**values)) != 1:
                return False
            end_attempt(s, trial_id, status, values["error"], result is not None)
            if status == TrialStatus.COMPLETED and result is not None:
                settle_twins(s, trial_id)
            return True

    def requeue(self, trial_id: str, error: str | None, owner: str | None = None) -> str:
        """After a retryable failure: back to pending while its charged attempts (this one
        included; see `attempts.charged_attempts`) are fewer than max_attempts, else
        failed; cancelled instead if its sweep has stopped (cancelled or failed meanwhile),
        which leases nothing again. Returns the trial's status afterwards (unchanged unless
        it was running, and with `owner`, leased by that coordinator)."""
        with self._write() as s:
            sweep_id = s.scalar(select(Trial.sweep_id).where(Trial.id == trial_id))
            if sweep_id is None:
                raise NotFoundError(f"no trial {trial_id!r:.80}")
            # the sweep before the trial, as cancel_sweep locks them: it cannot stop unseen
            sweep = locked_sweep(s, sweep_id)
            trial = s.get(Trial, trial_id, with_for_update=True)
            if trial.status != TrialStatus.RUNNING or (
                    owner is not None and trial.lease_owner != owner):
                return trial.status  # another lease's outcome, not this one's to end
            error = redact(error)
            end_attempt(s, trial_id, TrialStatus.FAILED, error)
            trial.error = error
            trial.lease_owner = trial.lease_expires_at = None
            if sweep.status in STOPPED_SWEEP_STATUSES:
                trial.status, trial.finished_at = TrialStatus.CANCELLED, utcnow()
            elif charged_attempts(s, trial_id) < trial.max_attempts:
                trial.status, trial.started_at, trial.worker_node = TrialStatus.PENDING, None, None
            else:
                trial.status, trial.finished_at = TrialStatus.FAILED, utcnow()
            return str(trial.status)  # the plain string, as read from the database

    def mark_cancelled(self, trial_id: str, owner: str | None = None) -> bool:
        """A pending or running trial becomes cancelled; False if it had already finished
        (or, with `owner`, is not running under that coordinator's lease)."""
        stmt = (
            update(Trial)
            .where(Trial.id == trial_id, Trial.status.in_(ACTIVE_STATUSES))
            .values(status=TrialStatus.CANCELLED, finished_at=utcnow(), lease_expires_at=None)
        )
        if owner is not None:
            stmt = stmt.where(Trial.status == TrialStatus.RUNNING, Trial.lease_owner == owner)
        with self._write() as s:
            if bulk_update(s, stmt) != 1:
                return False
            end_attempt(s, trial_id, TrialStatus.CANCELLED, None)
            return True


def _finished_values(status: str, result: Mapping[str, Any] | Any | None, error: str | None,
                     worker_node: str | None) -> dict[str, Any]:
    """The trial's column values for its outcome, secrets redacted from every error."""
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
    return values
