"""Optuna LR search through the real service, against the full grid it replaces.

Real local Ray, real SQLite app and Optuna databases, real training. The Optuna sweep runs one
trial at a time: each study's sampler is seeded from its own name and its first batch from its
shape, so with a fixed ask/tell order the LRs it proposes, and the pruner's decisions on the
(deterministic, single thread) validation losses, are the same on every run.
"""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
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
from hptransfer.coordinator.optuna_search import (
    BRACKET_ATTR,
    PROTECTED_ATTRS,
    REFINED_ATTR,
    RIVAL_ATTR,
    OptunaSearch,
    RankPruner,
    Seen,
    bracket,
    decision_step,
    first_batch,
    half_slice,
    refinement,
    rival_refinement,
    stable_seed,
)
from hptransfer.coordinator.service import Coordinator
from hptransfer.spec import Search
from hptransfer.spec.sections import MIN_FULL_BUDGET
from hptransfer.spec.trial import Budget, TrialSpec
from hptransfer.workers.trainer import run_trial

TERMINAL_TRIAL = {"completed", "pruned", "diverged", "failed", "cancelled"}
FINAL_SWEEP = ("completed", "cancelled", "failed")
LOG2_LRS = range(-13, -2)  # 2^-13 .. 2^-3: 11 LRs, one log2 step apart (the grid step)
STEPS, BATCH, SEQ = 100, 8, 64
N_TRIALS = 7  # 4 covering the range, 2 around the best of them, 1 from TPE
PRUNE_AFTER = 0.5

# Like examples/optuna_lr.yaml, scaled down for a CPU test: SP and CompleteP at two widths,
# a wide LR range (10 octaves), an evaluation every 10 steps so the pruner sees losses;
# 100 steps, not fewer: at 60 the loss is flat over 3 octaves around the grid argmin; widths
# 64 and 128, not 32: with 1-2 heads the final loss above 2^-5 jumps from LR to LR.
COMPARISON_SPEC: dict[str, Any] = {
    "name": "lr-search",
    "arms": [{"arch": "gpt", "parameterization": "sp"},
             {"arch": "gpt", "parameterization": "completep"}],
    "grid": {
        "widths": [64, 128],
        "depths": [1],
        "lrs": {"log2_min": LOG2_LRS[0], "log2_max": LOG2_LRS[-1], "step": 1},
        "seeds": [0],
    },
    "fixed": {"head_dim": 32, "seq_len": SEQ, "base_width": 64, "base_depth": 1,
              "device": "cpu", "eval_every": 10},
    "budget": {"steps": STEPS, "batch_size": BATCH},
    "data": {"source": "stdlib", "val_tokens": 4096, "max_corpus_bytes": 400000},
    "resources": {"cpus": 1},
    "max_concurrent": 2,
    "retries": 1,
}
N_SHAPES = 4

OPTUNA_SEARCH = {"method": "optuna", "sampler": "tpe", "pruner": "rank",
                 "n_trials": N_TRIALS, "n_startup": 4, "prune_after": PRUNE_AFTER,
                 "keep_top": 3}
SHAPE = ["arm", "width", "depth"]

# a trial of 100 steps: its decision step at prune_after 0.5 is 50
SMALL_TRIAL = TrialSpec(width=32, depth=1, head_dim=32, base_width=32, base_depth=1,
                        batch_size=4, seq_len=16, budget=Budget(steps=100))


def _optuna_spec(base: dict[str, Any], **search: Any) -> dict[str, Any]:
    spec = copy.deepcopy(base)
    spec["name"] = base["name"] + "-optuna"
    spec["search"] = {**OPTUNA_SEARCH, **search}
    spec["max_concurrent"] = 1  # a fixed ask/tell order: the seeded samplers repeat themselves
    return spec


def _watch_all(client: Client, sweep_ids: list[str],
               timeout: float = 600) -> dict[str, list[dict[str, Any]]]:
    """Poll GET /sweeps/{id} of every sweep until all have ended; each one's summaries."""
    seen: dict[str, list[dict[str, Any]]] = {i: [] for i in sweep_ids}
    deadline = time.time() + timeout
    while True:
        for sweep_id, summaries in seen.items():
            if not summaries or summaries[-1]["status"] not in FINAL_SWEEP:
                summaries.append(client.get(sweep_id))
        running = [s[-1] for s in seen.values() if s[-1]["status"] not in FINAL_SWEEP]
        if not running:
            return seen
        assert time.time() < deadline, [(s["status"], s["counts"]) for s in running]
        time.sleep(0.2)


def _studies(settings, sweep_id: str) -> list[optuna.Study]:
    return [optuna.load_study(study_name=n, storage=settings.optuna_url)
            for n in optuna.get_all_study_names(settings.optuna_url) if sweep_id in n]


def _check_study_matches(study: optuna.Study, trials: pd.DataFrame) -> None:
    """The shape's trials are exactly the study's, with the same LRs and outcomes."""
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
            # stopped on the pruner's word, never before PRUNE_AFTER of the budget
            assert max(frozen.intermediate_values) >= PRUNE_AFTER * STEPS


# The reference the searches are judged against: per arm, the grid over its basins and an LR
# beyond them on each side, not the whole range: 22 trials, not 44. Run over the whole range,
# the LRs left out trained to 3.43 or more (SP: 2^-13 .. 2^-11, 2^-5 .. 2^-3) and 3.65 or
# more (CompleteP: 2^-13 .. 2^-10, 2^-3), above every shape's best + BASIN (3.14 .. 3.31):
# none is a shape's best or in its basin, so the basins, the best losses and the argmins are
# those of the whole grid (the check below that every argmin has a reference LR on both
# sides catches a best at the reference's edge). The search is priced against the whole
# grid, the one it replaces: every LR of its range trained to the budget, as every reference
# trial is (checked).
REFERENCE_LOG2_LRS = {"sp": range(-10, -5), "completep": range(-9, -3)}  # the grid step apart

# At this budget the final loss is a noisy function of the LR, at every scale: trained alone,
# SP 128x1 at 2^-7.53 .. 2^-7.45 (0.02 octave apart) gives 2.952-3.043 (std 0.035), and
# 2^-9.25 / 2^-9 give 3.094 / 2.992; with seed 1 instead of 0 its best grid LR moves from 2^-9
# to 2^-8. So the grid's argmin is one draw of that noise, and a search is judged against the
# grid's basin, not its argmin: BASIN is three standard deviations of the difference of two
# runs' losses (3 x 0.035 x sqrt 2). It still bounds η* to about 2 octaves of the 10 searched:
# SP 128x1 is 0.25 above its best at 2^-10 and 0.29 at 2^-7, CompleteP 128x1 0.20 at 2^-9.
BASIN = 0.15


@pytest.fixture(scope="module")
def reference_grid(module_hpt_home, module_ray_cluster) -> pd.DataFrame:
    """The grid the searches are judged against (each arm over its REFERENCE_LOG2_LRS), run
    once for the module: every trial trained alone (pack 1, the trainer's reference
    numerics, which packing matches up to rounding)."""
    with serve_in_thread(get_settings()) as url, Client(url) as client:
        ids = []
        for arm in COMPARISON_SPEC["arms"]:
            lrs = REFERENCE_LOG2_LRS[arm["parameterization"]]
            spec = copy.deepcopy(COMPARISON_SPEC)
            spec["name"] = f"{spec['name']}-{arm['parameterization']}"
            spec["arms"] = [arm]
            spec["grid"]["lrs"] = {"log2_min": lrs[0], "log2_max": lrs[-1], "step": 1}
            spec["resources"] = {**spec["resources"], "pack": 1}
            ids.append(client.submit(spec)["id"])
        seen = _watch_all(client, ids)
        assert all(s[-1]["status"] == "completed" for s in seen.values())
        return pd.concat([client.trials(i) for i in ids], ignore_index=True)


# each way of running the search takes one arm of the grid (its two widths): the two
# together cover the grid's four shapes at half the cost of running both on all four
# (pack 8, not auto: on one thread per task `auto` does not pack these widths). SP alone is
# the hard case: at 64 x 1 its loss dips twice (grid: 2^-7 at 3.16, 2^-4 at 3.36), and its
# search's first batch lands three LRs within 0.004 of each other, the best of them in the
# shallower dip; before rival basins got refined (analysis/basins.py) the search called
# 2^-4.19 a reliable η*, which trained to 3.51.
SEARCHES = [(1, "sp"), (8, "completep")]


@pytest.fixture(scope="module")
def searches(reference_grid, module_hpt_home, module_ray_cluster) -> dict[tuple, dict]:
    """Both searches of SEARCHES, run at once in the grid's home: each asks one trial at a
    time (max_concurrent 1), so together they keep the two CPUs busy, and neither's ask/tell
    order depends on the other. Per search: its summaries as watched, trials and fits."""
    settings = get_settings()
    ids = {}
    with serve_in_thread(settings) as url, Client(url) as client:
        for pack, parameterization in SEARCHES:
            arm = {"arch": "gpt", "parameterization": parameterization}
            assert arm in COMPARISON_SPEC["arms"]
            spec = _optuna_spec({**COMPARISON_SPEC, "arms": [arm]})
            spec["resources"] = {**spec["resources"], "pack": pack}
            ids[pack, parameterization] = client.submit(spec)["id"]
        seen = _watch_all(client, list(ids.values()))
        return {key: {"id": i, "seen": seen[i], "found": client.trials(i),
                      "fits": client.fits_raw(i, bootstrap=0), "settings": settings}
                for key, i in ids.items()}


@pytest.mark.slow
@pytest.mark.parametrize("pack, parameterization", SEARCHES)
def test_optuna_finds_every_shapes_eta_star_with_fewer_tokens(pack, parameterization,
                                                              reference_grid, searches,
                                                              record_property):
    """Alone (pack 1: every trial is asked after the previous one finished, so the first
    batch's lowest LR can be pruned) or packed (pack 8: the first batch trains together,
    then one trial at a time), each shape's η* is in the grid's basin and trains as well as
    the grid's best LR, and the search costs a fraction of the grid's tokens."""
    run = searches[pack, parameterization]
    settings, optuna_id, seen = run["settings"], run["id"], run["seen"]
    found, fits = run["found"], run["fits"]
    full_tokens = STEPS * BATCH * SEQ
    grid = reference_grid[reference_grid["arm"] == f"gpt/{parameterization}"]
    n_shapes = N_SHAPES // 2
    reference = REFERENCE_LOG2_LRS[parameterization]

    # the grid: every LR ran to its budget; each shape's argmin is inside the range, with a
    # reference LR on both sides
    assert len(grid) == n_shapes * len(reference)
    assert (grid["tokens"] == full_tokens).all()
    ok = grid[grid["status"] == "completed"]
    argmin = ok.loc[ok.groupby(SHAPE)["final_val_loss"].idxmin()].set_index(SHAPE)
    grid_log2 = argmin["lr"].map(math.log2)
    assert grid_log2.between(reference[0] + 1, reference[-1] - 1).all(), grid_log2

    # the search: n_trials LRs per shape in the grid's range, the sweep completed
    assert seen[-1]["status"] == "completed" and seen[-1]["done"] == n_shapes * N_TRIALS
    assert all(s["total"] == n_shapes * N_TRIALS for s in seen)
    assert all(s["status"] in ("pending", "running") for s in seen[:-1])
    assert set(found["status"]) <= {"completed", "pruned", "diverged"}
    assert found["lr"].between(2.0 ** LOG2_LRS[0], 2.0 ** LOG2_LRS[-1]).all()
    completed = found[found["status"] == "completed"]
    pruned = found[found["status"] == "pruned"]
    assert (completed["tokens"] == full_tokens).all()
    assert ((pruned["tokens"] >= PRUNE_AFTER * full_tokens)
            & (pruned["tokens"] < full_tokens)).all(), pruned
    # at least MIN_FULL_BUDGET trials of every shape trained to the full budget
    assert (completed.groupby(SHAPE).size() >= MIN_FULL_BUDGET).all()

    # shapes do not share a proposal sequence: no LR is proposed in two shapes
    sequences = {k: [lr for _, lr in sorted(zip(g["optuna_trial_number"], g["lr"],
                                                strict=True))]
                 for k, g in found.groupby(SHAPE)}
    assert len(sequences) == n_shapes
    all_lrs = [lr for seq in sequences.values() for lr in seq]
    assert len(set(all_lrs)) == len(all_lrs), sequences
    # each began with a first batch that covers the range: one LR in each quarter of it
    span = LOG2_LRS[-1] - LOG2_LRS[0]
    for seq in sequences.values():
        quarters = [int((math.log2(lr) - LOG2_LRS[0]) / span * 4) for lr in seq[:4]]
        assert sorted(quarters) == [0, 1, 2, 3], [math.log2(lr) for lr in seq]
    # one trial at a time (pack 1), the first batch's lowest LR, asked 4th, is far behind the
    # three before it at the decision step: every shape prunes it. Packed, the first batch
    # trains together (no finished run to rank it against), so only the sampler's trial after
    # the refinement can be pruned, and whether it is depends on where TPE explores.
    if pack == 1:
        for key, seq in sequences.items():
            lowest = found[(found["lr"] == min(seq[:4]))].iloc[0]
            assert lowest["status"] == "pruned", (key, [math.log2(lr) for lr in seq])

    # every shape has a sound fitted η* (quadratic in log2 LR, as for grids: the best LR
    # has a full run on both sides, so the vertex is interpolated, not clamped) within one
    # grid step of a grid LR in the basin (within BASIN of the grid's best loss), and the
    # report lists its pruned trials with their steps
    shapes = pd.DataFrame(fits["tables"]["optimal_lr"]).set_index(SHAPE)
    assert len(shapes) == n_shapes
    best_loss = ok.groupby(SHAPE)["final_val_loss"].min()
    in_basin = ok[ok["final_val_loss"] <= ok.groupby(SHAPE)["final_val_loss"].transform("min")
                  + BASIN]
    basin = in_basin.groupby(SHAPE)["lr"].agg(lambda lrs: sorted(math.log2(lr) for lr in lrs))
    lines = []
    for key, log2_grid in grid_log2.items():
        row = shapes.loc[key]
        assert row["log2_lr_opt"] is not None, (key, row["reason"])
        # one seed: no CI, so not "reliable" (no noise measured); sound: the fit itself holds
        assert row["sound"], (key, row["reason"], row["warnings"])
        # what η* trains to, alone, with the grid's spec of that shape: as good as the grid's
        # best up to the noise (the check a user makes before training large at η*)
        best_spec = argmin.loc[key, "spec"]
        at_eta = run_trial(TrialSpec.model_validate(
            {**best_spec, "lr": 2.0 ** row["log2_lr_opt"]})).final_val_loss
        lines.append(f"  {key}: grid argmin 2^{log2_grid:.0f} (loss {best_loss[key]:.3f}; "
                     f"basin 2^{basin[key]}), optuna η* 2^{row['log2_lr_opt']:.2f} "
                     f"(loss trained alone {at_eta:.3f}; {int(row['n_completed'])} completed, "
                     f"{int(row['n_pruned'])} pruned)")
        assert at_eta <= best_loss[key] + BASIN, lines[-1]
        stopped = pruned[(pruned["arm"] == key[0]) & (pruned["width"] == key[1])]
        assert sorted((p["lr"], p["step"]) for p in row["pruned"]) == sorted(
            zip(stopped["lr"], (stopped["tokens"] // (BATCH * SEQ)).astype(int), strict=True))
    print("\n" + "\n".join(lines))
    for line, key in zip(lines, grid_log2.index, strict=True):
        assert min(abs(shapes.loc[key]["log2_lr_opt"] - x) for x in basin[key]) <= 1.0, line
    assert ("pruned trials (stopped early, so not in the fit)" in fits["text"]) == \
        (len(pruned) > 0)

    # the real bound: without pruning the search costs N_TRIALS / len(LOG2_LRS) of the
    # tokens of the grid over its range (every LR of it to the budget, as each reference
    # trial trained); pruning saves tokens on top of that
    grid_tokens = n_shapes * len(LOG2_LRS) * full_tokens
    ratio = found["tokens"].sum() / grid_tokens
    record_property("optuna_grid_token_ratio", round(float(ratio), 4))
    print(f"tokens optuna/grid = {found['tokens'].sum()}/{grid_tokens} = "
          f"{ratio:.3f} (bound without pruning {N_TRIALS / len(LOG2_LRS):.3f}); "
          f"{len(completed)} completed, {len(pruned)} pruned")
    assert ratio <= N_TRIALS / len(LOG2_LRS)
    if len(pruned):
        assert ratio < N_TRIALS / len(LOG2_LRS)

    # each study in Optuna's own storage holds exactly its shape's trials
    studies = _studies(settings, optuna_id)
    assert len(studies) == n_shapes
    for study in studies:
        lrs = {t.params["lr"] for t in study.get_trials(deepcopy=False)}
        _check_study_matches(study, found[found["lr"].isin(lrs)])


def test_seeds_and_first_batches_are_stable_and_per_shape():
    """Seeds are the same in a fresh interpreter with another hash seed (not hash()), and
    each shape gets its own stratified first batch over the whole range."""
    names = ["hpt-a-gpt/sp-N64-L2-s0.02-seed0", "hpt-a-gpt/sp-N128-L2-s0.02-seed0"]
    code = ("from hptransfer.coordinator.optuna_search import stable_seed; "
            f"print([stable_seed(n) for n in {names!r}])")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == str([stable_seed(n) for n in names])
    assert stable_seed(names[0]) != stable_seed(names[1])
    a, b = (first_batch(n, 2.0**-12, 2.0**-4, 4) for n in names)
    assert a != b
    for batch in (a, b):
        logs = [math.log2(x) for x in batch]
        # one LR in each 2-octave slice of [-12, -4], from the middle out, each at the same
        # offset into its slice
        assert [int((v + 12) // 2) for v in logs] == [2, 1, 3, 0], logs
        offsets = [(v + 12) / 2 - i for v, i in zip(logs, (2, 1, 3, 0), strict=True)]
        assert 0 <= offsets[0] < 1 and offsets == pytest.approx([offsets[0]] * 4, abs=1e-12)
    # half a slice: 8 octaves in 4 slices of 2
    assert half_slice(2.0**-12, 2.0**-4, 4) == pytest.approx(1.0)
    assert half_slice(1e-4, 1e-1, 3) == pytest.approx(math.log2(1000) / 6)


def test_the_rank_pruner_stops_a_trial_once_keep_top_others_were_better_at_its_step():
    """Counted at the trial's own last step only; equal values are not better; NaN is
    pruned at once."""
    study = optuna.create_study()
    for value in (3.0, 3.1, 3.2):
        study.add_trial(optuna.trial.create_trial(
            value=value, intermediate_values={5: value, 9: 0.0},
            params={}, distributions={}))
    pruner = RankPruner(keep_top=2)

    def candidate(at_step_5: float) -> optuna.trial.FrozenTrial:
        return optuna.trial.create_trial(state=optuna.trial.TrialState.RUNNING,
                                         intermediate_values={5: at_step_5},
                                         params={}, distributions={})

    assert pruner.prune(study, candidate(3.15))  # 3.0 and 3.1 better: two, prune
    assert not pruner.prune(study, candidate(3.05))  # only 3.0 better
    assert not pruner.prune(study, candidate(3.1))  # 3.0 better, 3.1 equal: one
    assert pruner.prune(study, candidate(math.nan))


def test_pruning_waits_for_the_budget_fraction_and_three_full_runs(tmp_path):
    """The gate: no decision before prune_after of the budget (and the warmup), none while
    fewer than MIN_FULL_BUDGET trials completed without diverging, never on the refinement
    around the best; then the rank pruner stops a trial only when keep_top others were
    better at the same step, and reports after a prune do not reach the pruner."""
    spec = SMALL_TRIAL
    assert decision_step(spec, 0.5) == 50
    assert decision_step(spec, 0.0) == 10  # the warmup (10 % of 100 steps) still counts
    search = OptunaSearch(f"sqlite:///{tmp_path / 'optuna.db'}")
    config = Search(method="optuna", n_trials=8, n_startup=3, pruner="rank", keep_top=2)
    study = search.study("gate", config, "shape", 1e-4, 1e-1)

    def start(name: str) -> int:
        number, _ = search.ask(study, 1e-4, 1e-1)
        search.bind(name, study, number, spec)
        return number

    def end(name: str, number: int, status: str, value: float) -> None:
        search.forget(name)
        search.tell(study, number, status, value, 256)

    # the enqueued first batch comes first, then the sampler
    asked = [(start(f"t{i}"), i) for i in range(3)]
    assert [study.get_trials(deepcopy=False)[n].params["lr"] for n, _ in asked] == \
        pytest.approx(first_batch("shape", 1e-4, 1e-1, 3), rel=1e-12)
    # far worse than the others at step 50, yet fewer than 3 runs have completed: kept
    for (number, i), (loss50, final) in zip(asked, [(3.0, 2.0), (3.1, 2.1), (9.0, 9.0)],
                                            strict=True):
        assert not search.should_prune(f"t{i}", 50, loss50)
        end(f"t{i}", number, "diverged" if i == 2 else "completed", final)
    assert search.full_budget_count(study) == 2  # a diverged run is no full-budget run

    # then the refinement: half a slice (of 3) either side of the best LR so far (t0's);
    # never pruned, however bad, since it gives the fit its neighbours around η*
    best_lr = study.get_trials(deepcopy=False)[asked[0][0]].params["lr"]
    refined = [start("t3"), start("t4")]
    assert [study.get_trials(deepcopy=False)[n].params["lr"] for n in refined] == \
        pytest.approx(refinement(best_lr, 1e-4, 1e-1, 3), rel=1e-12)
    assert not search.should_prune("t3", 50, 8.0)  # also: only 2 full-budget runs so far
    end("t3", refined[0], "completed", 2.5)
    assert search.full_budget_count(study) == MIN_FULL_BUDGET
    assert not search.should_prune("t4", 50, 9.5)  # 3.0, 3.1 and 8.0 were better: kept
    end("t4", refined[1], "completed", 2.9)

    number = start("t5")  # from the sampler: prunable
    assert not search.should_prune("t5", 40, 50.0)  # before the decision step
    assert not search.should_prune("t5", 50, 3.05)  # one better at step 50 (3.0): kept
    # worse than every value seen at step 50, but no other trial reported step 60: kept
    assert not search.should_prune("t5", 60, 3.2)
    assert not search.should_prune("t5", 100, 99.0)  # the last report is never pruned
    end("t5", number, "completed", 2.4)

    number = start("t6")
    assert search.should_prune("t6", 50, 3.5)  # 3.0, 3.05, 3.1 were better at step 50
    assert search.should_prune("t6", 60, 1.0)  # a late report: still pruned, not heard
    frozen = study.get_trials(deepcopy=False)[number]
    assert frozen.intermediate_values == {50: 3.5}
    end("t6", number, "pruned", 3.5)
    frozen = study.get_trials(deepcopy=False)[number]
    assert frozen.state == optuna.trial.TrialState.PRUNED and frozen.value == 3.5


def _keep_top_one_search(tmp_path, name: str) -> tuple[OptunaSearch, optuna.Study,
                                                      tuple[float, float]]:
    """A study of 8 trials, first batch of 3, the rank pruner keeping the best 1; its LR range."""
    search = OptunaSearch(f"sqlite:///{tmp_path / 'optuna.db'}")
    config = Search(method="optuna", n_trials=8, n_startup=3, pruner="rank", keep_top=1)
    low, high = 1e-4, 1e-1
    return search, search.study(name, config, "shape", low, high), (low, high)


def test_the_best_lr_is_bracketed_by_full_runs_before_the_sampler_proposes(tmp_path):
    """Whatever order trials finish in: when the best full-budget LR has no full-budget
    neighbour on a side (here the first batch's upper LR was pruned and the refinement's
    upper LR became the best), the next ask goes to that side, halfway to the pruned LR, and
    is never pruned; once both sides are covered the sampler proposes again."""
    spec = SMALL_TRIAL
    search, study, (low, high) = _keep_top_one_search(tmp_path, "bracket")
    half = half_slice(low, high, 3)

    def run(name: str, status: str, value: float) -> float:
        number, lr = search.ask(study, low, high)
        search.bind(name, study, number, spec)
        search.should_prune(name, 50, value)  # a yardstick for later trials at step 50
        search.forget(name)
        search.tell(study, number, status, value, 256)
        return math.log2(lr)

    middle, upper, lower = first_batch("shape", low, high, 3)  # asked in this order
    assert run("t0", "completed", 3.0) == pytest.approx(math.log2(middle))
    assert run("t1", "pruned", 4.0) == pytest.approx(math.log2(upper))  # stopped early
    assert run("t2", "completed", 3.4) == pytest.approx(math.log2(lower))
    # the refinement around the middle; its upper LR is the new best, whose upper
    # neighbour (the first batch's upper LR) never ran to the full budget
    assert run("t3", "completed", 3.2) == pytest.approx(math.log2(middle) - half)
    best = run("t4", "completed", 2.5)
    assert best == pytest.approx(math.log2(middle) + half)
    assert math.log2(upper) - best == pytest.approx(half)

    number, lr = search.ask(study, low, high)
    assert math.log2(lr) == pytest.approx(best + half / 2)  # halfway to the pruned LR
    assert number in study.user_attrs[BRACKET_ATTR]
    search.bind("t5", study, number, spec)
    assert search.full_budget_count(study) >= MIN_FULL_BUDGET
    assert not search.should_prune("t5", 50, 9.0)  # the worst at step 50, yet kept
    search.forget("t5")
    search.tell(study, number, "completed", 2.7, 256)

    # bracketed on both sides now: the sampler proposes, and its trial may be pruned
    number, _ = search.ask(study, low, high)
    assert number not in study.user_attrs[BRACKET_ATTR]
    search.bind("t6", study, number, spec)
    assert search.should_prune("t6", 50, 9.0)


def test_a_trial_is_told_once_and_a_retracted_one_keeps_its_lr_and_protection(tmp_path):
    """A second tell (a restart's catch-up told it already) changes nothing and raises
    nothing. A retracted trial (asked, its row never added) is FAIL, and its LR is asked next,
    still protected from pruning when it was a refinement's."""
    spec = SMALL_TRIAL
    search, study, (low, high) = _keep_top_one_search(tmp_path, "once")
    values = [3.0, 3.1, 3.2]
    for value in values:
        number, _ = search.ask(study, low, high)
        search.tell(study, number, "completed", value, 256)
        search.tell(study, number, "completed", 9.9, 256)  # again: ignored
        search.tell(study, number, "diverged", None, 256)  # and again, otherwise: ignored
    done = study.get_trials(deepcopy=False)
    assert [t.value for t in done] == values
    assert not any(t.user_attrs.get("hpt_diverged") for t in done)

    number, lr = search.ask(study, low, high)  # the refinement's first LR
    assert number in study.user_attrs[REFINED_ATTR]
    search.retract(study, number)
    search.retract(study, number)  # twice: nothing more
    assert study.get_trials(deepcopy=False)[number].state == optuna.trial.TrialState.FAIL
    second, _ = search.ask(study, low, high)  # the refinement's second LR, enqueued earlier
    assert second == number + 1
    again, lr_again = search.ask(study, low, high)
    assert (again, lr_again) == (number + 2, lr)
    assert again in study.user_attrs[REFINED_ATTR]
    search.bind("t", study, again, spec)
    assert not search.should_prune("t", 50, 99.0)  # protected: never pruned


def test_bracket_covers_both_sides_and_respects_the_range():
    lo, hi = 2.0**-13, 2.0**-3
    half = half_slice(lo, hi, 4)  # 1.25 octaves

    def seen(*points: tuple[float, float | None]) -> list[Seen]:
        return [Seen(x, v, False) for x, v in points]

    # both sides have a full run within a slice: nothing to add (the SP 64 study's LRs)
    sp64 = seen((-6.52, 3.36), (-9.02, 3.40), (-4.02, 3.41), (-11.52, None), (-7.77, 3.12),
                (-5.27, 3.46))
    assert bracket(sp64, lo, hi, 4) is None
    # the nearest full run above is more than a slice away: half a slice up
    assert math.log2(bracket(seen((-8.0, 3.1), (-10.0, 3.3), (-5.0, 3.4)), lo, hi, 4)) == \
        pytest.approx(-8.0 + half)
    # the upper side first, then the lower one
    assert math.log2(bracket(seen((-8.0, 3.1)), lo, hi, 4)) == pytest.approx(-8.0 + half)
    assert math.log2(bracket(seen((-8.0, 3.1), (-7.0, 3.2)), lo, hi, 4)) == \
        pytest.approx(-8.0 - half)
    # an open trial on a side may still complete: no second one there
    assert bracket([Seen(-8.0, 3.1, False), Seen(-7.0, None, True), Seen(-9.0, 3.2, False)],
                   lo, hi, 4) is None
    # near the top edge: clamped to it; at the edge: only the other side needs a point
    assert math.log2(bracket(seen((-3.5, 3.1), (-4.5, 3.2)), lo, hi, 4)) == \
        pytest.approx(-3.0)
    assert bracket(seen((-3.0, 3.1), (-4.0, 3.2)), lo, hi, 4) is None
    assert [math.log2(x) for x in refinement(2.0**-3.5, lo, hi, 4)] == \
        pytest.approx([-4.75, -3.0])
    assert refinement(2.0**-3.0, lo, hi, 4) == pytest.approx([2.0**-4.25])
    assert bracket(seen((-8.0, None)), lo, hi, 4) is None  # no full run yet



def test_a_rival_basin_gets_the_refinement_the_best_got(tmp_path):
    """The SP 64 x 1 study's losses (tests/test_analysis.py, SP64_SEARCH): the first batch's
    best (slice 3) wins by 0.0004 over slice 2 with a worse LR between them once the
    refinement has run. Before the sampler, the rival gets its missing refinement point (half
    a slice below it: above it the best's refinement already lies), never pruned; once it
    trains best and no rival is left, the sampler proposes again."""
    search = OptunaSearch(f"sqlite:///{tmp_path / 'optuna.db'}")
    config = Search(method="optuna", n_trials=9, n_startup=4, pruner="rank", keep_top=3)
    low, high = 2.0**LOG2_LRS[0], 2.0**LOG2_LRS[-1]
    study = search.study("rival", config, "sp64x1", low, high)  # slice 3 at 2^-4.78
    half = half_slice(low, high, 4)

    def run(name: str, status: str, value: float) -> float:
        number, lr = search.ask(study, low, high)
        search.bind(name, study, number, SMALL_TRIAL)
        search.should_prune(name, 50, value)
        search.forget(name)
        search.tell(study, number, status, value, 256)
        return math.log2(lr)

    first = [math.log2(lr) for lr in first_batch("sp64x1", low, high, 4)]  # slices 2, 1, 3, 0
    assert run("t0", "completed", 3.382391) == pytest.approx(first[0])
    run("t1", "completed", 3.385334)
    best = run("t2", "completed", 3.381978)
    run("t3", "pruned", 4.709458)
    assert run("t4", "completed", 3.626345) == pytest.approx(best - half)  # refinement
    assert run("t5", "completed", 3.681906) == pytest.approx(best + half)

    number, lr = search.ask(study, low, high)
    assert math.log2(lr) == pytest.approx(first[0] - half)
    assert number in study.user_attrs[RIVAL_ATTR]
    search.bind("t6", study, number, SMALL_TRIAL)
    assert not search.should_prune("t6", 50, 9.0)  # the worst at step 50, yet kept
    search.forget("t6")
    search.tell(study, number, "completed", 3.16, 256)

    # one basin now, bracketed by the first batch's slices 1 and 2: the sampler proposes
    number, _ = search.ask(study, low, high)
    assert not any(number in study.user_attrs.get(a, []) for a in PROTECTED_ATTRS)


def test_rival_refinement_asks_each_missing_side_once():
    lo, hi = 2.0**-13, 2.0**-3
    half = half_slice(lo, hi, 4)  # 1.25 octaves

    def seen(*points: tuple[float, float | None]) -> list[Seen]:
        return [Seen(x, v, False) for x, v in points]

    study = [(-9.02, 3.385), (-6.52, 3.382), (-5.27, 3.626), (-4.02, 3.381978), (-3.0, 3.682)]
    assert math.log2(rival_refinement(seen(*study), lo, hi, 4)) == pytest.approx(-6.52 - half)
    # no rival: the second dip is 6 % above the best
    assert rival_refinement(seen((-8.0, 3.16), (-6.0, 3.35), (-4.0, 3.36), (-3.0, 3.68)),
                            lo, hi, 4) is None
    # the missing side is open (may complete), or was asked before and diverged: not again
    assert rival_refinement([*seen(*study), Seen(-7.77, None, True)], lo, hi, 4) is None
    assert rival_refinement([*seen(*study), Seen(-7.77, None, False)], lo, hi, 4) is None
    # both sides missing: the lower first, clamped to the range near its edge
    two = seen((-12.5, 3.30), (-10.5, 3.6), (-8.0, 3.29), (-6.5, 3.5))
    assert math.log2(rival_refinement(two, lo, hi, 4)) == pytest.approx(-13.0)
    assert math.log2(rival_refinement([*two, Seen(-13.0, 3.4, False)], lo, hi, 4)) == \
        pytest.approx(-12.5 + half)

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
    real_refresh = dispatcher.recovery.refresh_sweep

    def refresh(sweep_id: str) -> None:
        real_refresh(sweep_id)
        refreshed.append((sweep_id, store.get_sweep(sweep_id).status,
                          store.count_trials(sweep_id),
                          store.count_trials(sweep_id, status=("pending", "running"))))

    monkeypatch.setattr(dispatcher.recovery, "refresh_sweep", refresh)
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
    # each shape's first batch (placed by the shape, not the sweep) was asked again, and each
    # of its trials reused the first sweep's result
    assert all(t["reused"] for t in second_run)
    assert sorted(t["lr"] for t in second_run) == sorted(t["lr"] for t in first_run)




def test_report_and_dashboard_mark_pruned_trials_and_their_step():
    """A search's frame: η* and drift come from the completed trials only; the fit report
    and the dashboard list every pruned trial with the step it stopped at."""
    from hptransfer.analysis import fit_report
    from hptransfer.dashboards import render_sweep_html
    from hptransfer.store.store import RESULT_FRAME_COLUMNS

    rows = []
    for width, opt in ((64, -7.0), (128, -8.0), (256, -9.0)):  # SP-like: η* halves per doubling
        for i, x in enumerate([-11.3, -9.3, -7.3, -5.3, opt - 0.4, opt + 0.5]):
            stopped = i == 3  # the high-LR start is pruned at step 80 of 160
            rows.append({
                "trial_id": f"w{width}-{i}", "arm": "gpt/sp", "arch": "gpt",
                "parameterization": "sp", "width": width, "depth": 2, "lr": 2.0**x,
                "sigma_base": 0.02, "seed": 0, "status": "pruned" if stopped else "completed",
                "final_val_loss": 3.0 + 0.05 * (x - opt) ** 2, "flops": 1e12,
                "tokens": 80 * 512 if stopped else 160 * 512, "params_non_embedding": 1e5,
                "params_embedding": 1e4, "wall_time_s": 1.0, "reused": False,
                "steps": 80 if stopped else 160,
            })
    frame = pd.DataFrame(rows, columns=list(RESULT_FRAME_COLUMNS))
    report = fit_report(frame, bootstrap=0)
    shapes = report.optimal_lr.shapes.set_index("width")
    assert (shapes["n_pruned"] == 1).all() and (shapes["n_completed"] == 5).all()
    for width, opt in ((64, -7.0), (128, -8.0), (256, -9.0)):
        assert shapes.loc[width, "pruned"] == [
            {"lr": 2.0**-5.3, "step": 80, "trial_id": f"w{width}-3"}]
        assert shapes.loc[width, "log2_lr_opt"] == pytest.approx(opt, abs=1e-6)
    width_drift = report.transfer.slopes.set_index("axis").loc["width"]
    assert width_drift["slope"] == pytest.approx(-1.0, abs=1e-6)
    text = report.format_text()
    assert "n_pruned" in text and "pruned trials (stopped early, so not in the fit)" in text
    assert "gpt/sp width=64 depth=2: 2^-5.30 @ 80" in text
    summary = {"id": "s1", "name": "search", "status": "completed",
               "counts": frame["status"].value_counts().to_dict(), "total": len(frame),
               "done": len(frame), "progress": 1.0, "eta_s": None}
    html = render_sweep_html(summary, frame, report)
    assert "pruned: LR @ step (not fitted)" in html and "@ 80" in html
    assert "pruned at step 80" in html  # the LR figure's ▽ marks, on hover


@pytest.mark.parametrize(("field", "value", "message"), [
    ("n_startup", 8, "more than n_trials (7)"),
    ("n_startup", 1, "greater than or equal to 2"),
    ("n_startup", "3", "must be an integer, got the string"),
    ("n_trials", True, "must be an integer, got the boolean"),
    ("prune_after", True, "must be a number, got the boolean"),
    ("prune_after", 1.5, "less than or equal to 1"),
    ("prune_after", float("nan"), "finite number"),
    ("keep_top", 0, "greater than or equal to 1"),
    ("pruner", "hyperband", "'rank'"),
])
def test_search_fields_are_checked_and_named(field, value, message):
    from pathlib import Path

    import yaml

    from hptransfer.spec import SpecError, load_spec

    example = Path(__file__).resolve().parent.parent / "examples" / "optuna_lr.yaml"
    spec = yaml.safe_load(example.read_text())
    assert load_spec(spec).search.startup_count() == 4  # the example itself is valid
    spec["search"][field] = value
    with pytest.raises(SpecError) as info:
        load_spec(spec)
    problems = info.value.errors
    assert [p["field"] for p in problems] == [f"search.{field}"], problems
    assert message in problems[0]["message"], problems


def test_a_best_lr_at_the_edge_still_gets_three_points_with_one_neighbour():
    """Searches fit with neighbours=1; a best LR with no completed LR on one side takes
    the next one on the other, like a grid's edge fit with neighbours=2."""
    from hptransfer.analysis.parabola import fit_lr_parabola

    lrs = [2.0**x for x in (-9.0, -8.0, -7.0, -6.0)]
    losses = [3.0, 3.1, 3.3, 3.6]
    one, two = (fit_lr_parabola(lrs, losses, neighbours=n) for n in (1, 2))
    assert one["fit_ok"] and one["n_fit_points"] == 3 and one["clamped"]
    assert one["log2_lr_opt"] == two["log2_lr_opt"] == -9.0  # clamped to the edge
    inner = fit_lr_parabola(lrs, [3.3, 3.0, 3.1, 3.6], neighbours=1)
    assert inner["n_fit_points"] == 3 and -9.0 < inner["log2_lr_opt"] < -7.0
