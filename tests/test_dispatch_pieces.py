"""The dispatch loop's pieces one at a time, without Ray: the recovery ledger, the Optuna
bridge and asker, the study advancer, the Ray runner's slot arithmetic, and the tick loop's
order and back-off. A real SQLite app database and Optuna storage; Ray is never started."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import optuna
import pytest
from conftest import TINY_SPEC

from hptransfer.config import get_settings
from hptransfer.coordinator.dispatch import Dispatcher
from hptransfer.coordinator.dispatch_context import DispatchContext
from hptransfer.coordinator.optuna_asks import OptunaAsker
from hptransfer.coordinator.optuna_bridge import OptunaBridge, OptunaUnavailable
from hptransfer.coordinator.plan import plan_shapes, plan_sweep
from hptransfer.coordinator.ray_runner import ClusterCapacity, InFlight, RayRunner
from hptransfer.coordinator.recovery import RecoveryLedger
from hptransfer.coordinator.study import initial_state
from hptransfer.coordinator.study_advancer import StudyAdvancer
from hptransfer.spec import load_spec
from hptransfer.store.store import Store


@pytest.fixture
def store(hpt_home):
    store = Store(get_settings().database_url)
    store.migrate()
    yield store
    store.close()


def context_of(store: Store, owner: str = "me") -> DispatchContext:
    return DispatchContext(store, get_settings(), None, owner, poll_interval=0.01)


def grid_sweep(store: Store, name: str = "grid", **changes) -> str:
    spec = load_spec({**copy.deepcopy(TINY_SPEC), "name": name, **changes})
    return store.create_sweep(name, spec.model_dump(mode="json"), name, "grid",
                              plan_sweep(spec))


def optuna_sweep(store: Store, name: str = "searched", n_trials: int = 4) -> str:
    spec = load_spec({**copy.deepcopy(TINY_SPEC), "name": name, "resources": {"pack": 1},
                      "search": {"method": "optuna", "sampler": "tpe", "pruner": "none",
                                 "n_trials": n_trials}})
    return store.create_sweep(name, spec.model_dump(mode="json"), name, "optuna", [],
                              planned_total=len(plan_shapes(spec)) * n_trials)


class FakeBridge:
    """The Optuna bridge's tell and retract, failing while `failing` is set."""

    def __init__(self) -> None:
        self.failing = False
        self.told: list[str] = []
        self.retracted: list[tuple] = []

    def tell(self, trial, status, result) -> None:  # noqa: ANN001
        if self.failing:
            raise OptunaUnavailable("down")
        self.told.append(trial.id)

    def retract(self, asked: tuple) -> None:
        if self.failing:
            raise OptunaUnavailable("down")
        self.retracted.append(asked)

    def trials_left_to_ask(self, sweep_id: str, spec) -> int:  # noqa: ANN001
        return 0


# ---------------------------------------------------------------- the recovery ledger


def test_the_ledger_releases_leases_once_the_database_takes_them(store, monkeypatch):
    sweep_id = grid_sweep(store)
    ledger = RecoveryLedger(context_of(store), FakeBridge())
    leased = store.lease_pending("me", 3, sweep_id=sweep_id)
    real_release, calls = store.release, []

    def release(ids, owner):  # noqa: ANN001, ANN202
        calls.append(list(ids))
        if len(calls) <= 2:
            raise RuntimeError("database is locked")
        return real_release(ids, owner)

    monkeypatch.setattr(store, "release", release)
    ledger.release_later([leased[:2], leased[2:]])  # the first try fails: kept, not raised
    assert ledger.leases_to_release == [[t.id for t in leased[:2]], [leased[2].id]]
    with pytest.raises(RuntimeError):
        ledger.release_leases()  # still failing: kept for the next tick
    assert len(ledger.leases_to_release) == 2
    assert store.count_trials(sweep_id, status="running") == 3
    ledger.release_leases()
    assert ledger.leases_to_release == []
    assert calls[2:] == [[t.id for t in leased[:2]], [leased[2].id]]  # oldest first
    assert store.count_trials(sweep_id, status="pending") == 3


def test_the_ledger_keeps_an_ask_to_retract_while_optuna_fails():
    bridge = FakeBridge()
    ledger = RecoveryLedger(SimpleNamespace(), bridge)
    bridge.failing = True
    ledger.retract_later(("study", 7))
    ledger.retract_later(("study", 8))
    ledger.retract_asks()  # Optuna's storage still failing: nothing raised, both kept
    assert ledger.asks_to_retract == [("study", 7), ("study", 8)] and not bridge.retracted
    bridge.failing = False
    ledger.retract_asks()
    assert bridge.retracted == [("study", 7), ("study", 8)] and not ledger.asks_to_retract


def test_a_follow_up_is_told_once_then_refreshed_even_when_its_writes_fail(store,
                                                                           monkeypatch):
    sweep_id = grid_sweep(store)
    bridge = FakeBridge()
    ledger = RecoveryLedger(context_of(store), bridge)
    trials = store.lease_pending("me", 3, sweep_id=sweep_id)
    for t in trials:
        assert store.finish_trial(t.id, "completed", {"final_val_loss": 3.0}, owner="me")
    real_refresh, refreshes = store.refresh_sweep_status, []

    def refresh(sweep_id):  # noqa: ANN001, ANN202
        refreshes.append(sweep_id)
        if len(refreshes) == 1:
            raise RuntimeError("database is locked")
        return real_refresh(sweep_id)

    monkeypatch.setattr(store, "refresh_sweep_status", refresh)
    last = store.get_trial(trials[-1].id)
    bridge.failing = True
    ledger.follow_up(last, "completed", last.result, tell=True)  # Optuna down: kept
    assert ledger.pending_follow_ups[last.id].tell and not refreshes
    bridge.failing = False
    with pytest.raises(RuntimeError):
        ledger.settle_follow_ups()  # told; then the refresh fails: kept, told no more
    assert bridge.told == [last.id] and not ledger.pending_follow_ups[last.id].tell
    ledger.settle_follow_ups()
    assert bridge.told == [last.id] and not ledger.pending_follow_ups
    assert store.get_sweep(sweep_id).status == "completed"


def test_an_optuna_sweep_is_not_refreshed_while_its_studies_have_results_to_hear(
        store, monkeypatch):
    sweep_id = optuna_sweep(store, n_trials=2)
    ledger = RecoveryLedger(context_of(store), FakeBridge())  # nothing left to ask
    refreshed: list[str] = []
    monkeypatch.setattr(store, "refresh_sweep_status", refreshed.append)
    store.set_sweep_status(sweep_id, "running")
    ledger.resync_later(sweep_id)
    ledger.refresh_sweep(sweep_id)  # its resync pass is still to do
    assert refreshed == []
    ledger.optuna_sweeps_to_resync.clear()
    ledger.optuna_bridge.failing = True
    trial = SimpleNamespace(id="t1", sweep_id=sweep_id)
    ledger.follow_up(trial, "completed", {}, tell=True)  # a tell still pending
    assert refreshed == [] and ledger.pending_follow_ups
    ledger.optuna_bridge.failing = False
    ledger.settle_follow_ups()  # told: now the sweep may finish
    assert refreshed == [sweep_id] and not ledger.pending_follow_ups


# ---------------------------------------------------------------- the Optuna bridge


def test_the_bridge_backs_off_a_failing_storage_and_reconnects(store, monkeypatch):
    bridge = OptunaBridge(context_of(store))
    reconnects = []
    monkeypatch.setattr(bridge.search, "reconnect", lambda: reconnects.append(1))
    with pytest.raises(OptunaUnavailable, match="OperationalError: disk I/O error"):
        with bridge.calls():
            raise optuna.exceptions.StorageInternalError("commit") from \
                __import__("sqlite3").OperationalError("disk I/O error")
    assert reconnects == [1] and "disk I/O error" in bridge.storage_backoff.error
    ran = []
    with pytest.raises(OptunaUnavailable):  # backed off: not even tried
        with bridge.calls():
            ran.append(1)
    assert not ran
    assert bridge.should_prune("t1", [{"step": 1, "val_loss": 9.0}]) is False


def test_the_asker_retracts_an_ask_whose_row_was_not_added(store, monkeypatch):
    sweep_id = optuna_sweep(store)
    context = context_of(store)
    bridge = OptunaBridge(context)
    ledger = RecoveryLedger(context, bridge)
    asker = OptunaAsker(context, bridge, ledger)
    monkeypatch.setattr(store, "add_trial", lambda *a, **kw: (_ for _ in ()).throw(
        RuntimeError("database is locked")))
    sweep = store.get_sweep(sweep_id)
    with pytest.raises(RuntimeError, match="locked"):
        asker.ask(sweep, context.spec(sweep), free=1)
    assert not ledger.asks_to_retract  # retracted at once: Optuna's storage answered
    (name,) = [n for n in optuna.get_all_study_names(bridge.search.storage) if sweep_id in n]
    trials = optuna.load_study(study_name=name, storage=bridge.search.storage).get_trials()
    states = {t.number: t.state for t in trials}
    assert states[0] == optuna.trial.TrialState.FAIL  # the ask whose row failed
    assert optuna.trial.TrialState.RUNNING not in states.values()  # no phantom left
    assert store.count_trials(sweep_id) == 0


def test_the_asker_asks_a_first_batch_once_and_not_while_trials_are_pending(store):
    sweep_id = optuna_sweep(store, n_trials=6)
    context = context_of(store)
    bridge = OptunaBridge(context)
    asker = OptunaAsker(context, bridge, RecoveryLedger(context, bridge))
    sweep = store.get_sweep(sweep_id)
    asker.ask(sweep, context.spec(sweep), free=1)
    asked = store.count_trials(sweep_id, status="pending")
    assert asked >= 1
    asker.ask(sweep, context.spec(sweep), free=1)  # pending ones first
    assert store.count_trials(sweep_id) == asked
    assert bridge.trials_left_to_ask(sweep_id, context.spec(sweep)) == 6 - asked


# ---------------------------------------------------------------- the study advancer


def study_sweep(store: Store) -> str:
    spec = load_spec({**copy.deepcopy(TINY_SPEC), "name": "study",
                      "grid": {**TINY_SPEC["grid"], "lrs": [2.0**k for k in range(-10, -5)]},
                      "stages": {"transfer": {"shapes": [{"width": 64, "depth": 2}]}}})
    tune = plan_sweep(spec)
    return store.create_sweep("study", spec.model_dump(mode="json"), "h", "grid", tune,
                              study=initial_state(spec, len(tune)))


def finish_all(store: Store, sweep_id: str) -> None:
    for t in store.lease_pending("me", 1000, sweep_id=sweep_id):
        loss = 3.0 + 0.01 * (math.log2(t.lr) + 8) ** 2
        assert store.finish_trial(t.id, "completed", {"final_val_loss": loss}, owner="me")


def test_the_advancer_plans_the_next_stage_exactly_once(store, monkeypatch):
    sweep_id = study_sweep(store)
    context = context_of(store)
    bridge = OptunaBridge(context)
    ledger = RecoveryLedger(context, bridge)
    runner = RayRunner(context, should_prune=lambda *a: False, after_stored=lambda *a: None)
    advancer = StudyAdvancer(context, runner, bridge, ledger)
    real_plan, planned = store.plan_stage, []
    monkeypatch.setattr(store, "plan_stage",
                        lambda *a, **kw: planned.append(a[1]) or real_plan(*a, **kw))

    def advance() -> bool:
        sweep = store.get_sweep(sweep_id)
        return advancer.advance(sweep, context.spec(sweep))

    tune = store.count_trials(sweep_id)
    assert advance() is False and not planned  # the tune stage is still pending
    finish_all(store, sweep_id)
    runner.in_flight["x"] = InFlight(SimpleNamespace(sweep_id=sweep_id), "ref", 1, 0)
    assert advance() is False and not planned  # an outcome not yet stored
    runner.in_flight.clear()
    assert advance() is False and planned == [0]  # the transfer stage, planned
    transfer = store.count_trials(sweep_id) - tune
    assert transfer > 0 and store.count_trials(sweep_id, status="pending") == transfer
    assert advance() is False and planned == [0]  # its trials pending: nothing to plan
    assert store.count_trials(sweep_id) == tune + transfer


def test_a_study_the_planner_fails_on_is_failed_with_the_reason(store, monkeypatch):
    from hptransfer.coordinator import study_advancer

    sweep_id = study_sweep(store)
    finish_all(store, sweep_id)
    context = context_of(store)
    bridge = OptunaBridge(context)
    runner = RayRunner(context, should_prune=lambda *a: False, after_stored=lambda *a: None)
    advancer = StudyAdvancer(context, runner, bridge, RecoveryLedger(context, bridge))
    monkeypatch.setattr(study_advancer, "next_step",
                        lambda *a: (_ for _ in ()).throw(KeyError("hps")))
    sweep = store.get_sweep(sweep_id)
    assert advancer.advance(sweep, context.spec(sweep)) is True
    failed = store.get_sweep(sweep_id)
    assert failed.status == "failed" and "KeyError" in failed.error


# ---------------------------------------------------------------- the Ray runner


def test_capacity_reads_the_nodes_once_and_only_live_ones():
    reads = []

    def nodes() -> list[dict]:
        reads.append(1)
        return [{"Alive": False, "Resources": {"CPU": 64.0}},
                {"Alive": True, "Resources": {"CPU": 4.0}},
                {"Alive": True, "Resources": {"CPU": 8.0}}]

    capacity = ClusterCapacity({"CPU": 12.0}, nodes)
    assert not reads  # not read until asked
    assert capacity.largest_node_cpus() == 8.0 and capacity.largest_node_cpus() == 8.0
    assert reads == [1]


def test_free_slots_say_why_a_sweep_waits_and_count_what_is_in_flight(store):
    runner = RayRunner(context_of(store), should_prune=lambda *a: False,
                       after_stored=lambda *a: None)
    spec = load_spec({**copy.deepcopy(TINY_SPEC), "max_concurrent": 3,
                      "resources": {"cpus": 2, "pack": 1}})
    gpu_spec = load_spec({**copy.deepcopy(TINY_SPEC), "resources": {"cpus": 1, "gpus": 1}})
    free, why = runner.free_slots(gpu_spec, "s", ClusterCapacity.one_node(cpus=8))
    assert free == 0 and "GPU" in why
    free, why = runner.free_slots(spec, "s", ClusterCapacity.one_node(cpus=1))
    assert free == 0 and "largest Ray node has 1" in why
    assert runner.free_slots(spec, "s", ClusterCapacity.one_node(cpus=5)) == (2, None)
    runner.in_flight["a"] = InFlight(SimpleNamespace(sweep_id="other"), "ref-a", 2, 0)
    assert runner.free_slots(spec, "s", ClusterCapacity.one_node(cpus=5)) == (1, None)
    runner.in_flight["b"] = InFlight(SimpleNamespace(sweep_id="s"), "ref-b", 2, 0)
    # a pack's members share a task: counted once
    runner.in_flight["c"] = InFlight(SimpleNamespace(sweep_id="s"), "ref-b", 2, 0)
    assert runner.free_slots(spec, "s", ClusterCapacity.one_node(cpus=8)) == (2, None)


# ---------------------------------------------------------------- the tick loop


def test_a_tick_runs_the_pieces_in_order(store, monkeypatch):
    d = Dispatcher(store, get_settings())
    ran: list[str] = []
    for piece, method in [(d.ray_runner, "cancel_stopped_sweeps"),
                          (d.ray_runner, "relay_progress"),
                          (d.recovery, "retract_asks"), (d.recovery, "release_leases"),
                          (d, "_take_stopped"), (d.recovery, "resync_optuna_sweeps"),
                          (d.recovery, "settle_follow_ups"), (d.ray_runner, "collect"),
                          (d, "_fill")]:
        monkeypatch.setattr(piece, method, lambda method=method: ran.append(method) or 0)
    assert d.run_once() is False
    assert ran == ["cancel_stopped_sweeps", "relay_progress", "retract_asks",
                   "release_leases", "_take_stopped", "resync_optuna_sweeps",
                   "settle_follow_ups", "collect", "_fill"]


def test_failing_ticks_back_off_and_a_good_tick_clears_the_error(store, monkeypatch):
    d = Dispatcher(store, get_settings(), poll_interval=0.01)
    monkeypatch.setattr(d.ray_runner, "start", lambda: None)
    delays: list[float] = []  # the loop's pauses after failed ticks
    errors: list[str | None] = []
    monkeypatch.setattr(d._stop, "wait", delays.append)

    def tick() -> bool:
        if len(delays) < 3:
            raise RuntimeError("database is locked")
        errors.append(d.last_error)
        d._stop.set()
        return True

    monkeypatch.setattr(d, "run_once", tick)
    d.start(background=True)
    d._thread.join(10)
    assert delays == [0.01, 0.02, 0.04] and errors == ["RuntimeError: database is locked"]
    assert d.last_error is None and d.ticks.delay == 0.0


def test_a_cancelled_optuna_sweep_goes_to_the_resync_pass(store):
    d = Dispatcher(store, get_settings())
    searched, gridded = optuna_sweep(store), grid_sweep(store)
    d.sweep_stopped(searched)
    d.sweep_stopped(gridded)
    d._take_stopped()
    assert d.recovery.optuna_sweeps_to_resync == {searched}


def test_a_retry_with_a_checkpoint_runs_alone_and_others_may_pack(store):
    """A retried trial whose earlier attempt checkpointed must resume from it, so the
    dispatcher leases it alone (a pack starts every member at step 0); a fresh trial, or a
    retry with nothing to resume (a pack's member), may pack."""
    from hptransfer.workers.checkpoints import CheckpointPolicy, TrialCheckpoints

    sweep_id = grid_sweep(store, checkpoint={"every_steps": 5})
    spec = load_spec(store.get_sweep(sweep_id).spec)
    runner = RayRunner(context_of(store), should_prune=lambda *a: False,
                       after_stored=lambda *a: None)
    import dataclasses

    fresh, retried, checkpointed = store.trials(sweep_id, limit=None)[:3]
    retried, checkpointed = (dataclasses.replace(t, attempts=1) for t in (retried, checkpointed))
    saved = TrialCheckpoints(CheckpointPolicy(**runner._checkpoint(spec, checkpointed)), [])
    assert saved.save(5, {"step": 5})
    assert not runner.may_resume(spec, fresh)
    assert not runner.may_resume(spec, retried)
    assert runner.may_resume(spec, checkpointed)
