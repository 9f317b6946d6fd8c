"""A sweep's status from its trials, once nothing of it is pending or running: completed,
or failed when every trial that ended did so with an error.

Diverged and pruned trials are results (an LR sweep is meant to find where training
diverges), so a single one of them, or a completed trial, makes the sweep completed; only a
sweep whose trials all failed (errors: a bad data path, a crash on every node) is failed,
with the count and the first error, so `hpt submit --wait` and the listing say why.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from hptransfer.contracts.status import RESULT_STATUSES, SweepStatus, TrialStatus

from .schema import ACTIVE_STATUSES, STOPPED_SWEEP_STATUSES, Sweep, Trial

# trial statuses that are an outcome of the sweep's work (failed is not)
_RESULTS = tuple(sorted(s for s in RESULT_STATUSES if s != TrialStatus.FAILED))


def settle_status(s: Session, sweep: Sweep, now: datetime) -> str:
    """Set the (locked) sweep's status from its trials: running while any is pending or
    running, else failed when all that ended failed, else completed. A stopped sweep
    (cancelled, failed, stopped) keeps its status. Returns the status."""
    if sweep.status in STOPPED_SWEEP_STATUSES:
        return str(sweep.status)
    counts = dict(s.execute(select(Trial.status, func.count()).where(Trial.sweep_id == sweep.id)
                            .group_by(Trial.status)).all())
    if any(counts.get(st) for st in ACTIVE_STATUSES):
        sweep.status, sweep.finished_at = SweepStatus.RUNNING, None
        sweep.started_at = sweep.started_at or now
    elif counts.get(TrialStatus.FAILED) and not any(counts.get(st) for st in _RESULTS):
        sweep.status, sweep.finished_at = SweepStatus.FAILED, now
        sweep.started_at = sweep.started_at or now
        sweep.error = _all_failed(s, sweep.id, counts[TrialStatus.FAILED])
    elif sweep.status != SweepStatus.COMPLETED:
        sweep.status, sweep.finished_at = SweepStatus.COMPLETED, now
        sweep.started_at = sweep.started_at or now
    return str(sweep.status)  # the plain string, as read from the database


def _all_failed(s: Session, sweep_id: str, failed: int) -> str:
    """The failed sweep's `error`: how many trials failed, and the first one's error."""
    first = s.scalar(select(Trial.error).where(Trial.sweep_id == sweep_id,
                                               Trial.status == TrialStatus.FAILED,
                                               Trial.error.is_not(None))
                     .order_by(Trial.idx).limit(1))
    lines = (first or "").strip().splitlines()
    why = f"; the first error: {lines[0][:300]}" if lines else ""
    return (f"every trial failed ({failed}), none completed{why} "
            f"(`hpt trials {sweep_id} --status failed` lists them)")
