"""What must still happen after a stored outcome or a failed database write, kept until it
has happened: a failed write leaves the loop backing off, and a later tick finishes the job.

- pending_follow_ups: a stored outcome's Optuna tell and its sweep's status refresh.
- asks_to_retract: Optuna trials asked whose row could not be added: retracted (failed, so
  their LR is asked again) once Optuna's storage takes it, so no phantom stays RUNNING.
- leases_to_release: trials leased for a task Ray did not take: back to pending once the
  database takes it, not left 'running' until a restart.
- leases_unsure: a lease raised, yet its transaction may have committed (the database went
  down with the answer on its way): every trial running under this coordinator's lease
  without a task goes back to pending once the database answers.
- optuna_sweeps_to_resync: Optuna sweeps whose studies may still hold RUNNING trials that
  the app database has finished (or never added): each is told, or retracted, by a pass.

A restarted coordinator finishes what its dead predecessor held in memory
(`recover_after_restart`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import optuna

from hptransfer.contracts.status import ACTIVE
from hptransfer.store.rows import utcnow
from hptransfer.store.store import TrialRecord

from .dispatch_context import BadSweep, DispatchContext, log
from .optuna_bridge import OptunaBridge, OptunaUnavailable, shape_of
from .plan import ShapeKey, plan_shapes

# Optuna sweeps stopped this recently are passed over at start-up (their trials left RUNNING
# in Optuna are told): a bound, so a start does not grow with every sweep ever cancelled
RECENTLY_STOPPED_S = 7 * 86_400.0


@dataclass
class FollowUp:
    """What a trial's stored outcome still needs: its Optuna tell and its sweep's status.
    Kept until written, so a write that fails (the loop backs off) is retried next tick
    rather than lost with the in-flight entry the outcome has already left."""
    trial: TrialRecord
    status: str
    result: dict | None
    tell: bool  # the trial's Optuna study has yet to hear its outcome


class RecoveryLedger:
    """Keeps what a failed write left half done, and finishes it on a later tick."""

    def __init__(self, context: DispatchContext, optuna_bridge: OptunaBridge) -> None:
        self.context, self.optuna_bridge = context, optuna_bridge
        self.pending_follow_ups: dict[str, FollowUp] = {}  # trial id -> its follow-ups
        self.asks_to_retract: list[tuple[optuna.Study, int]] = []
        self.leases_to_release: list[list[str]] = []  # trial ids, one list per task
        self.leases_unsure = False
        self.optuna_sweeps_to_resync: set[str] = set()

    # start-up --------------------------------------------------------------------------
    def recover_after_restart(self) -> None:
        """What a dead coordinator held in memory (its follow-ups, its asks to retract) is
        gone with it; on start, one pass over the active sweeps finishes it:
        - an Optuna trial left RUNNING (killed between storing a result and telling Optuna,
          or between asking Optuna and adding the row) is told its stored outcome, or
          retracted when no row has its number; trials still pending or running are told
          when they finish. Else the sampler would never learn its value and the bracketing
          would wait on it. A sweep whose pass Optuna's storage failed is passed over again
          on later ticks (`optuna_sweeps_to_resync`).
        - a sweep without pending or running trials is refreshed once (killed between storing
          its last result and refreshing it), an Optuna sweep after its pass; an Optuna
          search or a study with more to do waits."""
        store = self.context.store
        for sweep in store.active_sweeps():
            try:
                spec = self.context.spec(sweep)
            except BadSweep:
                continue  # marked failed
            if spec.search.method == "optuna":
                self.optuna_sweeps_to_resync.add(sweep.id)
            elif not store.count_trials(sweep.id, status=list(ACTIVE)):
                self.refresh_sweep(sweep.id)
        # stopped lately while no dispatcher was there to tell Optuna (cancelled through an
        # API-only server, or just before the last coordinator died)
        self.optuna_sweeps_to_resync |= set(store.stopped_sweep_ids(
            search="optuna", since=utcnow() - timedelta(seconds=RECENTLY_STOPPED_S)))
        self.resync_optuna_sweeps()

    # a stored outcome's follow-ups -------------------------------------------------------
    def follow_up(self, trial: TrialRecord, status: str, result: dict | None,
                  tell: bool) -> None:
        """Record what a stored outcome still needs (see FollowUp) and try to write it now."""
        self.pending_follow_ups[trial.id] = FollowUp(trial, status, result, tell)
        self._settle(trial.id)

    def settle_follow_ups(self) -> None:
        """Retry the follow-ups a failed write left pending."""
        for trial_id in list(self.pending_follow_ups):
            self._settle(trial_id)

    def _settle(self, trial_id: str) -> None:
        follow_up = self.pending_follow_ups[trial_id]
        try:
            if follow_up.tell:
                self.optuna_bridge.tell(follow_up.trial, follow_up.status, follow_up.result)
                follow_up.tell = False  # told: a retry of the refresh must not tell twice
            self.refresh_sweep(follow_up.trial.sweep_id)
        except BadSweep:
            pass  # marked failed: nothing more to do for its trials
        except OptunaUnavailable:
            return  # kept: told, then refreshed, once Optuna's storage answers
        del self.pending_follow_ups[trial_id]

    def refresh_sweep(self, sweep_id: str) -> None:
        """Recompute the sweep's status from its trials, unless it has more to do."""
        sweep = self.context.store.get_sweep(sweep_id)
        before = sweep.status
        spec = self.context.spec(sweep)
        if before in ACTIVE and spec.search.method == "optuna" and (
                self.optuna_bridge.trials_left_to_ask(sweep_id, spec)
                or self._optuna_has_results_to_hear(sweep_id)):
            return  # the studies have trials to ask or results to hear: not finished yet
        if before in ACTIVE and sweep.study and not sweep.study.get("done"):
            return  # a study with stages to plan: the study advancer (next tick) decides
        self.context.store.refresh_sweep_status(sweep_id)

    def _optuna_has_results_to_hear(self, sweep_id: str) -> bool:
        """Whether a result of the sweep has yet to reach its Optuna study (a tell pending,
        or its resync pass still to do): an Optuna sweep completes only once it has. Else a
        coordinator that died then would leave its trials RUNNING in a finished sweep's
        study, which no start-up pass visits."""
        return sweep_id in self.optuna_sweeps_to_resync or any(
            f.tell and f.trial.sweep_id == sweep_id for f in self.pending_follow_ups.values())

    # asks whose row was not added ------------------------------------------------------------
    def retract_later(self, asked: tuple[optuna.Study, int]) -> None:
        """An asked Optuna trial that will never run: retracted now, or on a later tick if
        Optuna's storage is failing too (by the next coordinator's start if this one dies
        first)."""
        self.asks_to_retract.append(asked)
        with contextlib.suppress(Exception):
            self.retract_asks()

    def retract_asks(self) -> None:
        """Retract the asked Optuna trials whose rows could not be added."""
        with contextlib.suppress(OptunaUnavailable):  # kept for a later tick
            _do_each_oldest_first(self.asks_to_retract, self.optuna_bridge.retract)

    # leases without a task -----------------------------------------------------------------
    def release_later(self, leased: list[list[TrialRecord]]) -> None:
        """Leased trials that will not be submitted: back to pending now, or once the
        database takes it."""
        self.leases_to_release.extend([t.id for t in pack] for pack in leased)
        with contextlib.suppress(Exception):
            self.release_leases()

    def release_leases(self) -> None:
        """Release leased trials whose task was never submitted."""
        store, owner = self.context.store, self.context.owner
        _do_each_oldest_first(self.leases_to_release, lambda ids: store.release(ids, owner))

    def lease_unsure(self) -> None:
        """A lease raised: whether it committed is unknown (see the module docstring)."""
        self.leases_unsure = True

    def release_unsure_leases(self, in_flight: Collection[str]) -> None:
        """After a lease that raised: the trials running under this coordinator's lease
        that have no task (not `in_flight`) go back to pending, the attempt not charged."""
        if not self.leases_unsure:
            return
        store, owner = self.context.store, self.context.owner
        taskless = [t for t in store.leased_ids(owner) if t not in in_flight]
        if taskless:
            store.release(taskless, owner)
            log.warning("released %d trials whose lease committed unanswered (the database "
                        "failed on the way): they had no task", len(taskless))
        self.leases_unsure = False

    # Optuna trials left RUNNING --------------------------------------------------------------
    def resync_later(self, sweep_id: str) -> None:
        """The sweep's studies may hold RUNNING trials its rows have finished: a pass tells
        them (the next tick's)."""
        self.optuna_sweeps_to_resync.add(sweep_id)

    def resync_optuna_sweeps(self) -> None:
        """The pass over `optuna_sweeps_to_resync`: tell or retract each sweep's Optuna
        trials left RUNNING, then refresh the sweep if nothing of it is pending or running."""
        if not self.optuna_sweeps_to_resync:
            return
        store = self.context.store
        with contextlib.suppress(OptunaUnavailable):
            studies = self.optuna_bridge.study_names()
            for sweep_id in sorted(self.optuna_sweeps_to_resync):
                try:
                    self._resync_sweep(sweep_id, studies)
                    idle = not store.count_trials(sweep_id, status=list(ACTIVE))
                except BadSweep:  # marked failed: nothing to tell
                    idle = False
                self.optuna_sweeps_to_resync.discard(sweep_id)  # before the refresh: it waits on it
                if idle:
                    try:
                        self.refresh_sweep(sweep_id)
                    except Exception:  # the database failed: the pass runs again (tells once)
                        self.optuna_sweeps_to_resync.add(sweep_id)
                        raise

    def _resync_sweep(self, sweep_id: str, studies: set[str]) -> None:
        """Tell or retract one sweep's Optuna trials left RUNNING."""
        store, bridge = self.context.store, self.optuna_bridge
        spec = self.context.spec(store.get_sweep(sweep_id))
        rows: dict[tuple[ShapeKey, int], TrialRecord] = {
            (shape_of(t), t.optuna_trial_number): t
            for t in store.trials(sweep_id, limit=None)
            if t.optuna_trial_number is not None}
        for shape in plan_shapes(spec):
            if bridge.study_name(sweep_id, shape) not in studies:
                continue  # nothing asked yet
            study, running = bridge.running(sweep_id, spec, shape)
            for number in running:
                row = rows.get((shape, number))
                if row is None:
                    bridge.retract((study, number))
                elif row.status not in ACTIVE:
                    bridge.tell(row, row.status, row.result)


def _do_each_oldest_first(queue: list, action: Callable[[Any], object]) -> None:
    """Apply `action` to each queued item, oldest first, dropping each once done; the first
    that fails raises (the loop backs off) and stays queued for the next tick."""
    while queue:
        action(queue[0])
        queue.pop(0)
