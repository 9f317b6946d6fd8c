"""Asks an Optuna sweep's studies for its next learning rates and adds them as pending
trials. What a failed write leaves half done (an ask without a row, a row not read back)
goes to the recovery ledger."""

from __future__ import annotations

import contextlib

import optuna

from hptransfer.spec import SweepSpec
from hptransfer.store.store import SweepRecord

from .dispatch_context import DispatchContext
from .optuna_bridge import OptunaBridge, OptunaUnavailable
from .packing import pack_size
from .plan import ShapeKey, plan_shapes, trial_for
from .recovery import RecoveryLedger


class OptunaAsker:
    """Turns an Optuna sweep's free slots into asked, stored trials."""

    def __init__(self, context: DispatchContext, optuna_bridge: OptunaBridge,
                 recovery: RecoveryLedger) -> None:
        self.context, self.optuna_bridge, self.recovery = context, optuna_bridge, recovery

    def ask(self, sweep: SweepRecord, spec: SweepSpec, free: int) -> None:
        """Ask for up to `free` tasks' worth of trials, unless some are still pending."""
        store, bridge = self.context.store, self.optuna_bridge
        if store.count_trials(sweep.id, status="pending"):
            return
        low, high = spec.grid.lr_bounds()
        # tasks' worth: a shape that packs asks its first batch (fixed LRs that need no
        # results) a pack at a time; every later ask learns from the results, so one by one
        asked = 0
        for shape in plan_shapes(spec):
            if asked >= free:
                return
            have = store.count_trials(sweep.id, arm=shape.arm, width=shape.width,
                                      depth=shape.depth, sigma_base=shape.sigma_base,
                                      seed=shape.seed)
            if have >= spec.search.n_trials:
                continue
            with bridge.calls():
                study = bridge.study(sweep.id, spec, shape)
            shape_spec = trial_for(spec, shape, low).trial.model_dump()
            batch = min(pack_size(spec, shape_spec), spec.search.startup_count() - have)
            for _ in range(max(1, batch)):
                self._ask_one(sweep.id, spec, shape, study, low, high)
            asked += 1

    def _ask_one(self, sweep_id: str, spec: SweepSpec, shape: ShapeKey, study: optuna.Study,
                 low: float, high: float) -> None:
        store, bridge = self.context.store, self.optuna_bridge
        with bridge.calls():
            number, lr = bridge.search.ask(study, low, high)
            bridge.storage_backoff.succeeded()
        planned = trial_for(spec, shape, lr)
        try:
            trial_id = store.add_trial(sweep_id, planned, optuna_trial_number=number)
        except Exception:
            self.recovery.retract_later((study, number))  # asked but never to run
            raise
        with contextlib.suppress(OptunaUnavailable), bridge.calls():
            # unbound when Optuna's storage failed here: it runs unpruned, as after a restart
            bridge.search.bind(trial_id, study, number, planned.trial)
        try:
            added = store.get_trial(trial_id)
        except Exception:
            # reused or not is unknown now: the resync pass tells it if it was (each tick)
            self.recovery.resync_later(sweep_id)
            raise
        if added is not None and added.status != "pending":
            # reused from an identical earlier trial: it never runs, so tell it now
            bridge.forget(trial_id)
            self.recovery.follow_up(added, added.status, added.result, tell=True)
