"""Result reuse: a trial whose exact work (content hash, data hash) was already done takes
that result instead of training again.

Two cases: a finished donor (any sweep's completed trial) is copied when the trial is
inserted; a twin (an earlier trial of the same sweep still pending or running, or one of any
sweep running) is waited for, and its result copied when it completes. Either way the trial
gets its one finished attempt, so MLflow (which mirrors attempts) shows it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, and_, exists, insert, or_, select, update
from sqlalchemy.orm import Session, aliased

from hptransfer.contracts.records import TrialRecord
from hptransfer.contracts.status import TrialStatus

from .attempts import add_attempts, attempt_row
from .base import locked_sweep
from .query import bulk_update, chunks
from .rows import reused_values, trial_record, utcnow
from .schema import ACTIVE_STATUSES, Attempt, Sweep, Trial
from .sweep_status import settle_status


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
    reused = [r["id"] for r in rows if r.get("reused_from") is not None]
    for chunk in chunks(rows):
        # `attempts` counts the attempt rows: a reused trial's one (add_attempts' rule)
        s.execute(insert(Trial), [{**r, "attempts": 1} if r.get("reused_from") is not None
                                  else r for r in chunk])
    for chunk in chunks(reused):
        s.execute(insert(Attempt),
                  [attempt_row(tid, 1, TrialStatus.COMPLETED, now) for tid in chunk])


def waits_for_twin() -> ColumnElement[bool]:
    """A pending trial with an identical twin (same content hash) it waits for: an earlier
    trial of its sweep (plan order) still pending or running, or one of any sweep running on
    the same data. It is not leased, and takes the twin's result when it completes
    (`settle_twins`), rather than training the same thing twice (a study's ladder and
    aspect-ratio stages may plan one shape at one budget; identical sweeps submitted at
    once). Only where the sweep reuses results (reuse on, a data hash: the rule that reuses
    a finished donor), and not for Optuna's asks, each of which is told its own outcome. A
    pending twin in another sweep is not waited for (that sweep may be held back by its
    own limits); the first of them leased runs, the others then wait. Needs Sweep joined."""
    twin = aliased(Trial)
    same = and_(twin.content_hash == Trial.content_hash, twin.id != Trial.id)
    return and_(
        may_wait_for_twin(),
        or_(exists().where(same, twin.sweep_id == Trial.sweep_id,
                           twin.status.in_(ACTIVE_STATUSES), twin.idx < Trial.idx),
            exists().where(same, twin.data_hash == Trial.data_hash,
                           twin.status == TrialStatus.RUNNING)),
    )


def first_of_twins(rows: Sequence[Any]) -> list[str]:
    """The ids of pending (id, content hash, data hash, may wait) rows to lease at once,
    in order, without a trial that may wait (`may_wait_for_twin`) identical to one before
    it: the first runs, the others wait for it (`waits_for_twin` once it is running)."""
    seen: set[tuple[str, str | None]] = set()
    ids = []
    for trial_id, content_hash, data_hash, may_wait in rows:
        if may_wait and (content_hash, data_hash) in seen:
            continue
        seen.add((content_hash, data_hash))
        ids.append(trial_id)
    return ids


def may_wait_for_twin() -> ColumnElement[bool]:
    """A trial of a sweep that reuses results, not asked by Optuna (see waits_for_twin).
    Needs Sweep joined."""
    return and_(Sweep.reuse.is_(True), Sweep.data_hash.is_not(None),
                Trial.optuna_trial_number.is_(None))


def settle_twins(s: Session, trial_id: str) -> None:
    """The pending trials that waited for completed `trial_id` (`waits_for_twin`), in its
    sweep or another, take its result, as a finished donor's is reused (each with its one
    finished attempt). Another plain sweep (no study, not Optuna) left with nothing pending
    or running is completed here, since no dispatcher follow-up refreshes it."""
    done = s.get(Trial, trial_id)
    if done is None:
        return
    waiting = (select(Trial.id, Trial.sweep_id).join(Sweep, Sweep.id == Trial.sweep_id).where(
        may_wait_for_twin(), Trial.content_hash == done.content_hash,
        Trial.status == TrialStatus.PENDING, Trial.data_hash == done.data_hash,
        Trial.id != done.id))
    others = sorted({sid for _, sid in s.execute(waiting)} - {done.sweep_id})
    # other sweeps' rows locked first, as cancel_sweep locks them: none stops half-way
    locked = [locked_sweep(s, sid) for sid in others]
    twins = [tid for tid, _ in s.execute(waiting)]
    if not twins:
        return
    now = utcnow()
    values = {**reused_values(trial_record(done), now), "lease_owner": None,
              "lease_expires_at": None, "error": None}
    bulk_update(s, update(Trial).where(Trial.id.in_(twins), Trial.status == TrialStatus.PENDING)
                .values(**values))
    add_attempts(s, twins, TrialStatus.COMPLETED, now)
    for sweep in locked:
        if sweep.study is None and sweep.search != "optuna":
            settle_status(s, sweep, now)
