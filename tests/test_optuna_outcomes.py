"""What an Optuna search is told and asks, driven without Ray (the dispatcher's Optuna paths
called as its tick calls them): cancels from another server, reproducible asks, the diverged
penalty's vocabulary, LRs inside the range, the pruners' yardsticks, and the η* a study with
an Optuna tune stage transfers."""

from __future__ import annotations

import copy
import math
import warnings

import optuna
import pandas as pd
import pytest
from conftest import TINY_SPEC

from hptransfer.analysis.optimal_lr import optimal_lr
from hptransfer.analysis.study_report import study_fit_report
from hptransfer.config import get_settings
from hptransfer.coordinator.optuna_search import (
    DIVERGED_PENALTY,
    PROTECTED_ATTRS,
    OptunaSearch,
    fit_neighbours,
    refinement,
)
from hptransfer.coordinator.service import Coordinator
from hptransfer.coordinator.study import initial_state, next_step
from hptransfer.spec import Search, load_spec
from hptransfer.spec.trial import Budget, TrialSpec


def optuna_spec(name: str, **search) -> dict:
    spec = {**copy.deepcopy(TINY_SPEC), "name": name, "resources": {"pack": 1}}
    spec["search"] = {"method": "optuna", "sampler": "tpe", "pruner": "none", **search}
    return spec


def states(sweep_id: str) -> dict[int, optuna.trial.TrialState]:
    url = get_settings().optuna_url
    (name,) = [n for n in optuna.get_all_study_names(url) if sweep_id in n]
    study = optuna.load_study(study_name=name, storage=url)
    return {t.number: t.state for t in study.get_trials(deepcopy=False)}


def test_a_cancel_from_an_api_only_server_leaves_no_optuna_trial_running(hpt_home,
                                                                        monkeypatch):
    from hptransfer.coordinator.ray_runner import ClusterCapacity

    settings = get_settings()
    dispatching = Coordinator(settings)
    d = dispatching.dispatcher
    monkeypatch.setattr(d.ray_runner, "capacity", lambda: ClusterCapacity.one_node(cpus=1.0))
    # no Ray: nothing is in flight
    monkeypatch.setattr(d.ray_runner, "relay_progress", lambda: None)
    monkeypatch.setattr(d, "_lease", lambda *args: [])  # asked, left pending
    ids = []
    for name in ("seen-active", "cancelled-while-down"):
        ids.append(dispatching.submit(optuna_spec(name, n_trials=6))["id"])
        sweep = dispatching.store.get_sweep(ids[-1])
        d.optuna_asker.ask(sweep, load_spec(sweep.spec), free=1)  # its first batch, pending
        assert optuna.trial.TrialState.RUNNING in states(ids[-1]).values()
    d.run_once()  # a tick sees both active
    api_only = Coordinator(settings, dispatch=False)
    api_only.cancel(ids[0])  # another server's request: this dispatcher is not told
    d.run_once()  # sees it gone from the active sweeps ...
    d.run_once()  # ... and tells its trials
    assert optuna.trial.TrialState.RUNNING not in states(ids[0]).values()
    # cancelled while no dispatcher ran: the next start's pass tells them
    api_only.cancel(ids[1])
    Coordinator(settings).dispatcher.recovery.recover_after_restart()
    assert optuna.trial.TrialState.RUNNING not in states(ids[1]).values()


def _drive(coordinator: Coordinator, sweep_id: str, loss) -> list:
    """The sweep's asks, each leased and completed with loss(lr), until its studies end."""
    store, d = coordinator.store, coordinator.dispatcher
    while True:
        sweep = store.get_sweep(sweep_id)
        spec = load_spec(sweep.spec)
        if not d.optuna_bridge.trials_left_to_ask(sweep_id, spec) and not store.count_trials(
                sweep_id, status="pending"):
            return sorted(store.trials(sweep_id, limit=None),
                          key=lambda r: r.optuna_trial_number)
        d.optuna_asker.ask(sweep, spec, free=1)
        for trial in store.lease_pending(d.owner, 10, sweep_id=sweep_id):
            result = {"status": "completed", "final_val_loss": loss(trial.lr)}
            assert store.finish_trial(trial.id, "completed", result, owner=d.owner)
            d.recovery.follow_up(store.get_trial(trial.id), "completed", result, True)


def test_the_same_spec_and_results_ask_the_same_lrs_so_a_resubmission_trains_nothing(
        hpt_home):
    spec = optuna_spec("again", n_trials=9, n_startup=4)
    spec["grid"]["lrs"] = {"log2_min": -13, "log2_max": -3, "step": 1}
    coordinator = Coordinator(get_settings())

    def bowl(lr):
        return 3.0 + 0.05 * (math.log2(lr) + 7.3) ** 2

    first = _drive(coordinator, coordinator.submit(copy.deepcopy(spec))["id"], bowl)
    second = _drive(coordinator, coordinator.submit(copy.deepcopy(spec))["id"], bowl)
    assert [r.lr for r in first] == [r.lr for r in second] and len(first) == 9
    assert all(r.reused_from for r in second)  # the sampler's asks too, not the first batch only


def test_a_diverged_bpe_trial_is_told_the_penalty_of_its_own_vocabulary(hpt_home):
    spec = optuna_spec("bpe", n_trials=4)
    spec["data"] = {**spec["data"], "tokenizer": "bpe", "bpe_vocab_size": 8192}
    coordinator = Coordinator(get_settings())
    store, d = coordinator.store, coordinator.dispatcher
    sweep_id = coordinator.submit(spec)["id"]
    sweep = store.get_sweep(sweep_id)
    d.optuna_asker.ask(sweep, load_spec(sweep.spec), free=1)
    trial = store.lease_pending(d.owner, 1, sweep_id=sweep_id)[0]
    result = {"status": "diverged", "final_val_loss": None, "param_table": {"wte": {}}}
    assert store.finish_trial(trial.id, "diverged", result, owner=d.owner)
    d.recovery.follow_up(store.get_trial(trial.id), "diverged", result, True)
    url = get_settings().optuna_url
    (name,) = [n for n in optuna.get_all_study_names(url) if sweep_id in n]
    told = optuna.load_study(study_name=name, storage=url).get_trials(
        deepcopy=False)[trial.optuna_trial_number]
    assert told.value == pytest.approx(DIVERGED_PENALTY * math.log(8192))  # was ln 256


def test_a_refinement_at_the_top_of_the_range_stays_inside_it(tmp_path):
    low, high = 1e-4, 0.01
    assert all(low <= lr <= high for lr in refinement(0.007, low, high, 4))  # 1 ulp above
    search = OptunaSearch(f"sqlite:///{tmp_path / 'o.db'}")
    study = search.study("s", Search(method="optuna", n_trials=8, n_startup=4), "shape",
                         low, high)
    study.enqueue_trial({"lr": refinement(0.007, low, high, 4)[-1]})
    for _ in range(4):
        search.ask(study, low, high)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # Optuna warned "Fixed parameter lr ... out of range"
        _, lr = search.ask(study, low, high)
    assert low <= lr <= high


SMALL = TrialSpec(width=32, depth=1, head_dim=32, base_width=32, base_depth=1,
                  batch_size=4, seq_len=16, budget=Budget(steps=100))  # decides from step 50


def _pruning(tmp_path, pruner: str, n_startup: int, runs: list[tuple[float, str]]):
    """A study whose trials reported `at50` at step 50 and ended `status`; returns whether a
    further (sampler) trial reporting `probe` at step 50 is pruned."""
    search = OptunaSearch(f"sqlite:///{tmp_path / 'o.db'}")
    config = Search(method="optuna", n_trials=12, n_startup=n_startup, pruner=pruner,
                    keep_top=3)
    study = search.study("s", config, "shape", 1e-4, 1e-1)
    for i, (at50, status) in enumerate(runs):
        number, _ = search.ask(study, 1e-4, 1e-1)
        search.bind(f"t{i}", study, number, SMALL)
        search.should_prune(f"t{i}", 50, at50)
        search.forget(f"t{i}")
        search.tell(study, number, status, at50 - 1.0 if status == "completed" else None, 256)

    def probe(value: float) -> bool:
        number, _ = search.ask(study, 1e-4, 1e-1)
        assert not any(number in study.user_attrs.get(a, []) for a in PROTECTED_ATTRS)
        search.bind("probe", study, number, SMALL)
        return search.should_prune("probe", 50, value)

    return probe


@pytest.mark.parametrize("pruner", ["successive_halving", "median", "rank"])
def test_a_trial_far_worse_than_every_full_run_is_pruned(tmp_path, pruner):
    # the first batch (gated: fewer than 3 full runs) and the refinement (protected) never
    # reached successive halving's rungs, so it compared with sampler trials only
    probe = _pruning(tmp_path, pruner, 3, [(v, "completed") for v in (3.0, 3.1, 3.2, 3.3,
                                                                      3.4)])
    assert probe(9.0)


@pytest.mark.parametrize("pruner, value", [("median", 3.15), ("rank", 3.15),
                                           ("successive_halving", 2.95)])
def test_trials_that_diverged_later_are_no_yardstick(tmp_path, pruner, value):
    # two high LRs, far the best at step 50, diverged later; `value` is among the best of
    # the runs that did not diverge (the best, for successive halving's halving rungs)
    runs = [(3.0, "completed"), (3.1, "completed"), (3.2, "completed"), (1.0, "diverged"),
            (1.0, "diverged"), (3.3, "completed"), (3.4, "completed")]
    assert not _pruning(tmp_path, pruner, 5, runs)(value)


def test_a_study_with_an_optuna_tune_stage_transfers_the_eta_star_a_search_fits():
    spec_dict = optuna_spec("study", n_trials=9, n_startup=4)
    spec_dict["grid"]["lrs"] = {"log2_min": -13, "log2_max": -3, "step": 1}
    spec_dict["stages"] = {"transfer": {"shapes": [{"width": 64, "depth": 1}]}}
    spec = load_spec(spec_dict)
    arm = spec.arms[0].name
    log2_lrs = [-11.76, -9.26, -6.76, -4.26, -8.01, -5.51, -7.3, -7.0, -6.2]

    def loss(x):  # steeper above η* (-7.5) than below, as loss-vs-LR curves are
        return 3.0 + (0.03 if x < -7.5 else 0.25) * (x + 7.5) ** 2

    frame = pd.DataFrame([dict(trial_id=f"t{i}", arm=arm, width=32, depth=1, lr=2.0**x,
                               sigma_base=0.02, seed=0, stage="tune", status="completed",
                               final_val_loss=loss(x)) for i, x in enumerate(log2_lrs)])
    searched = optimal_lr(frame.drop(columns=["stage"]), bootstrap=0,
                          neighbours=fit_neighbours("optuna"))
    want = math.log2(float(searched.shapes["lr_opt"].iloc[0]))
    step = next_step(spec, initial_state(spec, len(log2_lrs)), frame)
    assert step.kind == "plan"
    assert math.log2(step.state["hps"][arm]["lr"]) == pytest.approx(want, abs=1e-5)
    report = study_fit_report(frame, bootstrap=0, neighbours=fit_neighbours("optuna"))
    assert math.log2(float(report.optimal_lr.shapes["lr_opt"].iloc[0])) == pytest.approx(want)
    wide = optimal_lr(frame.drop(columns=["stage"]), bootstrap=0, neighbours=2)
    assert abs(math.log2(float(wide.shapes["lr_opt"].iloc[0])) - want) > 0.1  # it moved
