"""Optuna LR search through the real service, against the full grid it replaces.

Real local Ray, real SQLite app and Optuna databases, real training. The Optuna sweep runs one
trial at a time: its TPE sampler is seeded with the shape's seed (grid.seeds), so with a fixed
ask/tell order the LRs it proposes, and the pruner's decisions on the (deterministic, single
thread) validation losses, are the same on every run.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import optuna
import pandas as pd
import pytest
from fastapi.testclient import TestClient

from hptransfer.api.app import create_app
from hptransfer.api.server import serve_in_thread
from hptransfer.client import Client
from hptransfer.config import get_settings
from hptransfer.sweeper.optuna_search import OptunaSearch
from hptransfer.sweeper.service import Coordinator

TERMINAL_TRIAL = {"completed", "pruned", "diverged", "failed", "cancelled"}
LOG2_LRS = range(-10, -2)  # 2^-10 .. 2^-3: 8 LRs, one log2 step apart
STEPS, BATCH, SEQ = 60, 8, 64
N_TRIALS = 6

# One shape, enough steps for a clear LR optimum (2^-6 here, 2^-7 and 2^-5 clearly worse),
# and an evaluation every 10 steps so the pruner sees intermediate validation losses.
COMPARISON_SPEC: dict[str, Any] = {
    "name": "lr-search",
    "arms": [{"arch": "gpt", "parameterization": "completep"}],
    "grid": {
        "widths": [64],
        "depths": [2],
        "lrs": {"log2_min": LOG2_LRS[0], "log2_max": LOG2_LRS[-1], "step": 1},
        # also the TPE sampler's seed; 5 starts it far from the optimum (2^-8.45, 2^-3.9,
        # 2^-8.55), so the optimum must come from TPE itself, not from a lucky first draw
        "seeds": [5],
    },
    "fixed": {"head_dim": 32, "seq_len": SEQ, "base_width": 32, "base_depth": 1,
              "device": "cpu", "eval_every": 10},
    "budget": {"steps": STEPS, "batch_size": BATCH},
    "data": {"source": "stdlib", "val_tokens": 4096, "max_corpus_bytes": 400000},
    "resources": {"cpus": 1},
    "max_concurrent": 2,
    "retries": 1,
}

OPTUNA_SEARCH = {"method": "optuna", "sampler": "tpe", "pruner": "successive_halving",
                 "n_trials": N_TRIALS}


def _optuna_spec(base: dict[str, Any], **search: Any) -> dict[str, Any]:
    spec = copy.deepcopy(base)
    spec["name"] = base["name"] + "-optuna"
    spec["search"] = {**OPTUNA_SEARCH, **search}
    spec["max_concurrent"] = 1  # a fixed ask/tell order: the seeded sampler repeats itself
    return spec


def _watch(client: Client, sweep_id: str, timeout: float = 300) -> list[dict[str, Any]]:
    """Poll GET /sweeps/{id} until the sweep ends; every summary seen, in order."""
    seen = []
    deadline = time.time() + timeout
    while True:
        summary = client.get(sweep_id)
        seen.append(summary)
        if summary["status"] in ("completed", "cancelled", "failed"):
            return seen
        assert time.time() < deadline, f"sweep still {summary['status']}: {summary['counts']}"
        time.sleep(0.1)


def _study(settings, sweep_id: str) -> optuna.Study:
    names = [n for n in optuna.get_all_study_names(settings.optuna_url) if sweep_id in n]
    assert len(names) == 1, names  # one shape, one study
    return optuna.load_study(study_name=names[0], storage=settings.optuna_url)


def _check_study_matches(study: optuna.Study, trials: pd.DataFrame) -> None:
    """Every trial we ran is an Optuna trial with the same LR, told with the same outcome."""
    by_number = {t.number: t for t in study.get_trials(deepcopy=False)}
    assert set(by_number) == set(trials["optuna_trial_number"].astype(int))
    states = {"completed": optuna.trial.TrialState.COMPLETE,
              "diverged": optuna.trial.TrialState.COMPLETE,
              "pruned": optuna.trial.TrialState.PRUNED}
    for row in trials.itertuples():
        frozen = by_number[int(row.optuna_trial_number)]
        assert frozen.params["lr"] == pytest.approx(row.lr, rel=1e-12)
        assert frozen.state == states[row.status], (row.status, frozen.state)
        if row.status == "completed":
            assert frozen.value == pytest.approx(row.final_val_loss, rel=1e-9)
        if row.status == "pruned":
            # stopped on the pruner's word after at least one reported validation loss
            assert frozen.intermediate_values


def test_optuna_finds_the_grid_optimum_with_fewer_tokens(hpt_home, ray_cluster,
                                                         record_property):
    settings = get_settings()
    full_tokens = STEPS * BATCH * SEQ
    with serve_in_thread(settings) as url, Client(url) as client:
        grid_id = client.submit(COMPARISON_SPEC)["id"]
        assert _watch(client, grid_id)[-1]["status"] == "completed"
        grid = client.trials(grid_id)
        optuna_id = client.submit(_optuna_spec(COMPARISON_SPEC))["id"]
        seen = _watch(client, optuna_id)
        found = client.trials(optuna_id)

    # the grid: every LR ran to its budget, with an interior optimum
    assert len(grid) == len(LOG2_LRS) and set(grid["status"]) == {"completed"}
    assert (grid["tokens"] == full_tokens).all()
    grid_best = grid.loc[grid["final_val_loss"].idxmin()]
    grid_log2 = math.log2(grid_best["lr"])
    assert LOG2_LRS[0] < grid_log2 < LOG2_LRS[-1], grid[["lr", "final_val_loss"]]

    # the search: n_trials LRs in the grid's range, each finished, the sweep completed
    assert seen[-1]["status"] == "completed" and seen[-1]["done"] == N_TRIALS
    assert len(found) == N_TRIALS and set(found["status"]) <= {"completed", "pruned", "diverged"}
    assert found["lr"].between(2.0 ** LOG2_LRS[0], 2.0 ** LOG2_LRS[-1]).all()
    completed = found[found["status"] == "completed"]
    pruned = found[found["status"] == "pruned"]
    assert (completed["tokens"] == full_tokens).all()
    assert ((pruned["tokens"] > 0) & (pruned["tokens"] < full_tokens)).all()
    assert len(pruned) >= 1, found[["lr", "status", "tokens", "final_val_loss"]]

    # Optuna's answer is within one grid step of the grid's, for fewer tokens
    best = completed.loc[completed["final_val_loss"].idxmin()]
    assert abs(math.log2(best["lr"]) - grid_log2) <= 1.0, (best["lr"], grid_best["lr"])
    ratio = found["tokens"].sum() / grid["tokens"].sum()
    record_property("optuna_grid_token_ratio", round(float(ratio), 4))
    print(
        f"\ngrid argmin lr 2^{grid_log2:.0f} (val {grid_best['final_val_loss']:.4f}); "
        f"optuna best lr 2^{math.log2(best['lr']):.2f} (val {best['final_val_loss']:.4f}); "
        f"{len(completed)} completed, {len(pruned)} pruned; "
        f"tokens optuna/grid = {found['tokens'].sum()}/{grid['tokens'].sum()} = {ratio:.3f}"
    )
    for row in found.sort_values("optuna_trial_number").itertuples():
        print(f"  optuna #{row.optuna_trial_number}: lr 2^{math.log2(row.lr):.2f} "
              f"{row.status} tokens {row.tokens} val {row.final_val_loss:.4f}")
    assert ratio < 1.0

    # the study in Optuna's own storage holds exactly these trials, told the same outcomes
    _check_study_matches(_study(settings, optuna_id), found)

    # while it ran, GET /sweeps/{id} counted shapes x n_trials and never said completed early
    assert all(s["total"] == N_TRIALS for s in seen)
    assert all(s["status"] in ("pending", "running") for s in seen[:-1])


LIFECYCLE_SPEC: dict[str, Any] = {
    "name": "lifecycle",
    "arms": [{"arch": "gpt", "parameterization": "completep"}],
    "grid": {"widths": [32, 64], "depths": [1], "lrs": [2**-9, 2**-3], "seeds": [0]},
    "fixed": {"head_dim": 32, "seq_len": 32, "base_width": 32, "base_depth": 1,
              "device": "cpu", "eval_every": 5},
    "budget": {"steps": 10, "batch_size": 4},
    "data": {"source": "stdlib", "val_tokens": 1024, "max_corpus_bytes": 400000},
    "resources": {"cpus": 1},
    "search": {"method": "optuna", "sampler": "random", "pruner": "none", "n_trials": 3},
    "max_concurrent": 1,
    "retries": 1,
}


def _drive(dispatcher, api: TestClient, sweep_id: str, timeout: float = 240) -> list[dict]:
    """Tick the dispatch loop until the sweep ends; GET /sweeps/{id} after every tick."""
    ticks = []
    deadline = time.time() + timeout
    while True:
        dispatcher.run_once()
        summary = api.get(f"/sweeps/{sweep_id}").json()
        ticks.append(summary)
        if summary["status"] not in ("pending", "running"):
            return ticks
        assert time.time() < deadline, summary
        time.sleep(0.05)


def _study_states(settings, sweep_id: str) -> dict[str, list[tuple[str, float | None]]]:
    out = {}
    for name in optuna.get_all_study_names(settings.optuna_url):
        if sweep_id in name:
            study = optuna.load_study(study_name=name, storage=settings.optuna_url)
            out[name] = [(t.state.name, t.value) for t in study.get_trials(deepcopy=False)]
    return out


def test_optuna_sweep_runs_until_every_study_is_done(hpt_home, ray_cluster, monkeypatch):
    """Between two trials nothing is pending or running, yet the sweep is not done: it stays
    running until n_trials per shape were asked and finished, then completes once. The same
    holds when every asked trial is reused from an identical earlier sweep."""
    settings = get_settings()
    shapes, n_trials = 2, LIFECYCLE_SPEC["search"]["n_trials"]
    total = shapes * n_trials
    coordinator = Coordinator(settings)
    coordinator.start(background=False)  # this test drives the dispatch loop itself
    dispatcher, store = coordinator.dispatcher, coordinator.store
    finished: list[tuple[str, dict[str, int]]] = []

    def hook(_coordinator: Coordinator, sweep_id: str) -> dict[str, str | bytes]:
        finished.append((sweep_id, store.status_counts(sweep_id)))
        return {}

    coordinator.finished_hooks.append(hook)  # run by the MLflow mirror when a sweep ends
    # (sweep, status, trials asked, trials pending or running) right after every refresh:
    # when a trial has just finished, before the next is asked, no trial is active
    refreshed: list[tuple[str, str, int, int]] = []
    real_refresh = dispatcher._refresh

    def refresh(sweep_id: str) -> None:
        real_refresh(sweep_id)
        refreshed.append((sweep_id, store.get_sweep(sweep_id)["status"],
                          store.count_trials(sweep_id),
                          store.count_trials(sweep_id, status=("pending", "running"))))

    monkeypatch.setattr(dispatcher, "_refresh", refresh)
    try:
        with TestClient(create_app(settings, dispatch=False)) as api:
            sweep_ids, ticks, trials = [], [], []
            for _ in range(2):  # the second, identical sweep reuses every result
                created = api.post("/sweeps", json=LIFECYCLE_SPEC)
                assert created.status_code == 201, created.text
                sweep_id = created.json()["id"]
                first = api.get(f"/sweeps/{sweep_id}").json()
                assert first["status"] == "pending" and first["total"] == total
                assert first["done"] == 0 and store.count_trials(sweep_id) == 0
                sweep_ids.append(sweep_id)
                ticks.append(_drive(dispatcher, api, sweep_id))
                coordinator.mirror.sync()  # no mirror thread either: copy to MLflow now
                page = api.get(f"/sweeps/{sweep_id}/trials", params={"limit": 100}).json()
                assert page["total"] == total
                trials.append(page["items"])
    finally:
        coordinator.stop()

    for sweep_id, sweep_ticks, items in zip(sweep_ids, ticks, trials, strict=True):
        assert all(t["total"] == total for t in sweep_ticks)
        final = sweep_ticks[-1]
        assert final["status"] == "completed" and final["done"] == total, final
        assert final["finished_at"] is not None
        # n_trials asked per shape, all finished
        assert {t["status"] for t in items} <= {"completed", "diverged"}
        per_width = pd.Series([t["width"] for t in items]).value_counts().to_dict()
        assert per_width == {32: n_trials, 64: n_trials}
        # running after every refresh but the last, although the gap between trials
        # left nothing active; completed after the last
        mine = [r[1:] for r in refreshed if r[0] == sweep_id]
        assert len(mine) == total, mine
        assert all(status == "running" for status, _, _ in mine[:-1]) or (
            sweep_id == sweep_ids[1]  # all reused: never leased, so pending until done
            and all(status == "pending" for status, _, _ in mine[:-1])
        ), mine
        assert mine[-1] == ("completed", total, 0)
        # the sweep-finished hook ran once, after every trial had finished
        hooks = [counts for sid, counts in finished if sid == sweep_id]
        assert len(hooks) == 1
        assert sum(hooks[0].get(s, 0) for s in TERMINAL_TRIAL) == total
        # every asked Optuna trial was told its trial's loss (diverged: a penalty)
        studies = _study_states(settings, sweep_id)
        assert len(studies) == shapes
        losses = sorted(t["final_val_loss"] for t in items if t["status"] == "completed")
        told = sorted(v for states in studies.values() for state, v in states
                      if state == "COMPLETE" and v is not None)
        assert all(len(states) == n_trials for states in studies.values())
        assert all(state == "COMPLETE" for states in studies.values() for state, _ in states)
        assert set(losses) <= set(told)
    first_run, second_run = trials
    assert any(active == 0 for sid, _, _, active in refreshed[:-1] if sid == sweep_ids[0])
    assert not any(t["reused"] for t in first_run)
    # the seeded sampler asked the same LRs again; each reused the first sweep's result
    assert all(t["reused"] for t in second_run)
    assert sorted(t["lr"] for t in second_run) == sorted(t["lr"] for t in first_run)


def test_reports_after_a_prune_do_not_reach_the_pruner(tmp_path):
    """The worker sees a stop request late and may report again; those later values must not
    fill higher successive-halving rungs (timing-dependent, later-step competitors)."""
    search = OptunaSearch(f"sqlite:///{tmp_path / 'optuna.db'}")
    study = search.study("rungs", "tpe", "successive_halving", seed=0)
    number, _ = search.ask(study, 1e-4, 1e-1)
    search.bind("first", study, number)
    assert not search.should_prune("first", 10, 4.0)  # alone at its rungs: promoted
    search.forget("first")
    search.tell(study, number, "completed", 3.0, 256)
    number, _ = search.ask(study, 1e-4, 1e-1)
    search.bind("second", study, number)
    assert search.should_prune("second", 10, 5.0)  # worse than the first at rung 0
    assert search.should_prune("second", 20, 3.5)  # a late report: still pruned, not heard
    frozen = study.get_trials(deepcopy=False)[number]
    assert frozen.intermediate_values == {10: 5.0}
    assert [k for k in frozen.system_attrs if k.startswith("completed_rung")] == [
        "completed_rung_0"]
    search.forget("second")
    search.tell(study, number, "pruned", 5.0, 256)
    frozen = study.get_trials(deepcopy=False)[number]
    assert frozen.state == optuna.trial.TrialState.PRUNED and frozen.value == 5.0
