"""Result reuse: a trial whose exact work (content hash, data hash) was already done takes
that result instead of training again.

Two cases: a finished donor (any sweep's completed trial) is copied when the trial is
inserted; a twin (an earlier trial of the same sweep, still pending or running) is waited
for, and its result copied when it completes. Either way the trial gets its one finished
attempt, so MLflow (which mirrors attempts) shows it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, and_, exists, insert, select, update
from sqlalchemy.orm import Session, aliased

from hptransfer.contracts.records import TrialRecord
from hptransfer.contracts.status import TrialStatus

from .attempts import add_attempts, attempt_row
from .query import bulk_update, chunks
from .rows import reused_values, trial_record, utcnow
from .schema import ACTIVE_STATUSES, Attempt, Sweep, Trial


def donors(s: Session, hashes: Sequence[str], data_hash: str | None) -> dict[str, TrialRecord]:
    """Newest completed trial (with a result) per content hash on the same data."""
    found: dict[str, TrialRecord] = {}
    wanted = sorted({h for h in hashes if h})
    for chunk in chunks(wanted):
        stmt = (
            select(Trial)
            .where(
                Trial.content_hash.in_(list(chunk)),
                Trial.data_hash == data_hash,
                Trial.status == TrialStatus.COMPLETED,
                Trial.result.is_not(None),
            )
            .order_by(Trial.finished_at.desc(), Trial.id)
        )
        for trial in s.scalars(stmt):
            if trial.content_hash not in found:
                found[trial.content_hash] = trial_record(trial)
    return found


def sweep_donors(s: Session, sweep: Sweep, hashes: Sequence[str]) -> dict[str, TrialRecord]:
    """`donors` for trials of `sweep`: none unless it reuses results and knows its data."""
    return donors(s, hashes, sweep.data_hash) if sweep.reuse and sweep.data_hash else {}


def insert_trials(s: Session, rows: list[dict[str, Any]], now: datetime) -> None:
    """Insert trial rows; a trial reused from a donor gets its one attempt, finished with the
    donor's result."""
    for chunk in chunks(rows):
        s.execute(insert(Trial), list(chunk))
    reused = [r["id"] for r in rows if r.get("reused_from") is not None]
    for chunk in chunks(reused):
        s.execute(insert(Attempt),
                  [attempt_row(tid, 1, TrialStatus.COMPLETED, now) for tid in chunk])


def waits_for_twin() -> ColumnElement[bool]:
    """A pending trial that an earlier trial of its sweep (plan order) with the same content
    hash is still pending or running for: it is not leased, and takes that trial's result when
    it completes (`settle_twins`), rather than training the same thing twice (a study's
    ladder and aspect-ratio stages may plan one shape at one budget). Only where the sweep
    reuses results (reuse on, a data hash: the rule that reuses a finished donor), and not for
    Optuna's asks, each of which is told its own outcome. Needs Sweep joined."""
    twin = aliased(Trial)
    return and_(
        may_wait_for_twin(),
        exists().where(twin.sweep_id == Trial.sweep_id,
                       twin.content_hash == Trial.content_hash,
                       twin.status.in_(ACTIVE_STATUSES), twin.idx < Trial.idx),
    )


def may_wait_for_twin() -> ColumnElement[bool]:
    """A trial of a sweep that reuses results, not asked by Optuna (see waits_for_twin).
    Needs Sweep joined."""
    return and_(Sweep.reuse.is_(True), Sweep.data_hash.is_not(None),
                Trial.optuna_trial_number.is_(None))


def settle_twins(s: Session, trial_id: str) -> None:
    """The pending trials that waited for completed `trial_id` (`waits_for_twin`) take its
    result, as a finished donor's is reused (each with its one finished attempt)."""
    done = s.get(Trial, trial_id)
    if done is None:
        return
    twins = list(s.scalars(
        select(Trial.id).join(Sweep, Sweep.id == Trial.sweep_id).where(
            may_wait_for_twin(), Trial.sweep_id == done.sweep_id,
            Trial.content_hash == done.content_hash, Trial.status == TrialStatus.PENDING,
            Trial.data_hash == done.data_hash, Trial.id != done.id)))
    if not twins:
        return
    now = utcnow()
    values = {**reused_values(trial_record(done), now), "lease_owner": None,
              "lease_expires_at": None, "error": None}
    bulk_update(s, update(Trial).where(Trial.id.in_(twins), Trial.status == TrialStatus.PENDING)
                .values(**values))
    add_attempts(s, twins, TrialStatus.COMPLETED, now)
