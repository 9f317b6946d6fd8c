"""Stage targets: a study adds seeds (or an LR near η*) until a stage's headline is as sure
as its `target` asks, or its `max_extra_trials` are spent (coordinator/targets.py); the
spec fields, the planner's rounds, the trials' `reason`, restart safety through the store
and the dispatcher, and the report's account of each target."""

from __future__ import annotations

import copy
import math
import zlib

import numpy as np
import pandas as pd
import pytest
from sqlalchemy import event
from test_study import _dispatcher_without_ray, frame_of, study_dict

from hptransfer.analysis.staged import transfer_check
from hptransfer.analysis.study_report import study_fit_report
from hptransfer.config import get_settings
from hptransfer.coordinator.admission import stage_shapes
from hptransfer.coordinator.fits import study_targets
from hptransfer.coordinator.plan import plan_sweep
from hptransfer.coordinator.study import initial_state, next_step
from hptransfer.models.flops import training_flops
from hptransfer.spec import SpecError, load_spec
from hptransfer.spec.trial import MAX_SEED
from hptransfer.store.store import Store

TUNE_TARGET = {"target": {"eta_ci_log2": 0.5}, "max_extra_trials": 40}


def noisy_bowl(centre: float, curvature: float, sd: float, moved: float = 0.0,
               sd_elsewhere: float | None = None):
    """Loss of a trial: a parabola in log2(lr) plus seed noise that is a fixed function of
    the trial (its content hash), so a refit of the same trials sees the same losses;
    `moved`: how far η* moved at shapes other than the base (32x1); `sd_elsewhere`: their
    noise, when not `sd`."""
    def loss(p) -> float:
        rng = np.random.default_rng(zlib.crc32(p.content_hash.encode()))
        base = (p.width, p.depth) == (32, 1)
        c = centre + (0.0 if base else moved)
        noise = sd if base or sd_elsewhere is None else sd_elsewhere
        return 3.0 + curvature * (math.log2(p.lr) - c) ** 2 + noise * rng.standard_normal()
    return loss


def run_rounds(spec, loss, stop_at: str | None = None, limit: int = 12):
    """Plan round after round, every planned trial finishing at `loss`, until the study is
    done/stopped or a round plans trials of `stop_at`. (steps, all trials)."""
    tune = plan_sweep(spec)
    state, done, steps = initial_state(spec, len(tune)), list(tune), []
    for _ in range(limit):
        step = next_step(spec, state, frame_of(done, loss))
        steps.append(step)
        state, done = step.state, done + step.trials
        if step.kind != "plan" or (stop_at and stop_at in {p.stage for p in step.trials}):
            break
    return steps, done


# ------------------------------------------------------------------ spec


@pytest.mark.parametrize("stages, field", [
    ({"tune": {"target": {"eta_ci_log2": 0.5}}}, "stages.tune.max_extra_trials"),
    ({"tune": {"max_extra_trials": 4}}, "stages.tune.max_extra_trials"),
    ({"tune": {"target": {"eta_ci_log2": 0}, "max_extra_trials": 4}},
     "stages.tune.target.eta_ci_log2"),
    ({"tune": {"target": {"eta_ci_log2": 9}, "max_extra_trials": 4}},
     "stages.tune.target.eta_ci_log2"),
    ({"tune": {"target": {"eta_ci_log2": 0.5}, "max_extra_trials": -1}},
     "stages.tune.max_extra_trials"),
    ({"tune": {"target": {"eta_ci_log2": 0.5}, "max_extra_trials": 10_001}},
     "stages.tune.max_extra_trials"),
    ({"tune": {"target": {"savings_excludes_zero": True}, "max_extra_trials": 4}},
     "stages.tune.target.savings_excludes_zero"),
    ({"transfer": {"shapes": [{"width": 32, "depth": 2}],
                   "target": {"savings_excludes_zero": False}, "max_extra_trials": 4}},
     "stages.transfer.target.savings_excludes_zero"),
    ({"check": {"shapes": [{"width": 32, "depth": 2}],
                "target": {"eta_ci_log2": 0.5}, "max_extra_trials": 4}},
     "stages.check.target.eta_ci_log2"),
    ({"tune": {"target": {"eta_ci_log2": 0.5}, "max_extra_trials": 4,
               "max_extra_flops": -1.0}}, "stages.tune.max_extra_flops"),
    ({"tune": {"target": {"eta_ci_log2": 0.5}, "max_extra_trials": 4,
               "max_extra_flops": math.inf}}, "stages.tune.max_extra_flops"),
    ({"tune": {"target": {"eta_ci_log2": 0.5}, "max_extra_trials": 4,
               "max_extra_flops": 2e30}}, "stages.tune.max_extra_flops"),
    ({"tune": {"target": {"eta_ci_log2": 0.5}, "max_extra_trials": 4,
               "max_extra_flops": "1e12"}}, "stages.tune.max_extra_flops"),
    ({"tune": {"max_extra_flops": 1e12}}, "stages.tune.max_extra_flops"),
    ({"tune": {"target": {"eta_ci_log2": 0.5}, "max_extra_flops": 1e12}},
     "stages.tune.max_extra_trials"),
    ({"check": {"shapes": [{"width": 32, "depth": 2}], "max_extra_flops": 1e12}},
     "stages.check.max_extra_flops"),
    ({"aspect_ratio": {"shapes": [{"width": 32, "depth": 8}, {"width": 64, "depth": 2},
                                  {"width": 96, "depth": 1}, {"width": 128, "depth": 1}],
                       "target": {"eta_ci_log2": 0.5}}}, "stages.aspect_ratio.target"),
])
def test_bad_targets_name_the_field(stages, field):
    with pytest.raises(SpecError) as exc:
        load_spec(study_dict(**stages))
    assert field in [e["field"] for e in exc.value.errors], exc.value.errors


def test_every_cap_counts_in_the_worst_case():
    base = load_spec(study_dict())
    stages = study_dict()["stages"]
    stages["tune"] = TUNE_TARGET
    stages["check"] = {"target": {"shift_ci_log2": 0.5}, "max_extra_trials": 30}
    spec = load_spec(study_dict(**stages))
    assert spec.trial_count() == base.trial_count() + 40 + 30
    # pricing's worst case: each cap at its stage's largest shape, per arm
    before = {(s.stage, s.width, s.depth): s.trials for s in stage_shapes(base)}
    after = {(s.stage, s.width, s.depth): s.trials for s in stage_shapes(spec)}
    assert {k: after[k] - before[k] for k in after if after[k] != before[k]} == {
        ("tune", 32, 1): 40, ("check", 64, 2): 30}
    # the targets push it past the cap: the error names the larger cap, and the parts
    with pytest.raises(SpecError) as exc:
        load_spec(study_dict(**stages), max_trials=base.trial_count() + 69)
    (err,) = exc.value.errors
    grid = len(plan_sweep(base))  # the tune stage's trials, planned
    assert err["field"] == "stages.tune.max_extra_trials"
    assert err["message"] == (
        f"the study may plan {base.trial_count() + 70} trials ({grid} in the grid, "
        f"{base.trial_count() - grid} in its later stages and extension rounds, 40 that "
        "stages.tune.max_extra_trials may add, 30 that stages.check.max_extra_trials may "
        f"add), more than the cap of {base.trial_count() + 69}; lower "
        "stages.tune.max_extra_trials or raise HPT_MAX_TRIALS")
    # the stages alone past it: "stages"; the grid alone: "grid"
    with pytest.raises(SpecError) as exc:
        load_spec(study_dict(**stages), max_trials=base.trial_count() - 1)
    assert [e["field"] for e in exc.value.errors] == ["stages"]
    with pytest.raises(SpecError) as exc:
        load_spec(study_dict(**stages), max_trials=grid - 1)
    assert [e["field"] for e in exc.value.errors] == ["grid"]
    assert exc.value.errors[0]["message"].startswith(f"grid has {grid} trials, more than")


def trial_flops(p) -> float:
    """A planned trial's (or a TrialSpec's) training FLOPs, summed here from models.flops
    and its own budget (the tiny spec trains a fixed number of steps), not via the planner."""
    t = getattr(p, "trial", p)
    assert t.budget.steps
    return training_flops(t.model_config_obj(vocab_size=256), t.seq_len,
                          t.budget.steps * t.batch_size * t.seq_len)


def test_a_flop_cap_counts_in_the_worst_case():
    """Admission's worst case of a target with max_extra_flops: no more trials than the
    FLOPs buy at the cheapest shape it may add at, no more at the largest than the cap
    needs there, the rest at the cheapest."""
    def with_stages(**changed):
        stages = study_dict()["stages"]
        stages.update(changed)
        return load_spec(study_dict(**stages))

    base = with_stages()
    f = {(w, d): trial_flops(base.trial_spec(base.arms[0], w, d, 0.01, 1.0, 0))
         for w, d in ((32, 1), (32, 2), (64, 2))}
    before = {(s.stage, s.width, s.depth): s.trials for s in stage_shapes(base)}

    def added(spec):
        after = {(s.stage, s.width, s.depth): s.trials for s in stage_shapes(spec)}
        return {k: after[k] - before[k] for k in after if after[k] != before[k]}

    # the tune stage trains one shape: floor(5.5) trials of it, not the 40 the count allows
    assert added(with_stages(tune={**TUNE_TARGET, "max_extra_flops": 5.5 * f[(32, 1)]})) == {
        ("tune", 32, 1): 5}
    # a loose FLOP cap changes nothing
    assert added(with_stages(tune={**TUNE_TARGET, "max_extra_flops": 1e20})) == {
        ("tune", 32, 1): 40}
    # the ladder (32x2, 64x2): 2.5 trials of 64x2 worth of FLOPs buy n trials of 32x2;
    # 3 priced at 64x2 (its FLOPs at least the cap), the rest at 32x2
    cap = 2.5 * f[(64, 2)]
    n = math.floor(cap / f[(32, 2)])
    assert n > 3
    ladder = with_stages(transfer={**base.stages.transfer.model_dump(mode="json"),
                                   "target": {"savings_excludes_zero": True},
                                   "max_extra_trials": 100, "max_extra_flops": cap})
    assert added(ladder) == {("transfer", 64, 2): 3, ("transfer", 32, 2): n - 3}
    assert 3 * f[(64, 2)] + (n - 3) * f[(32, 2)] >= cap


# ------------------------------------------------------------------ planner


def test_a_tune_target_is_met_after_added_seeds_and_the_refined_eta_transfers():
    stages = study_dict()["stages"]
    stages["tune"] = TUNE_TARGET
    spec = load_spec(study_dict(**stages))
    loss = noisy_bowl(-8.3, 0.05, 0.01)
    steps, done = run_rounds(spec, loss, stop_at="transfer")
    first, second = steps[0], steps[1]
    # one seed per LR: no noise measured, no CI: round 1 adds seed 1 at each arm's fitted LRs
    assert first.kind == "plan" and {p.stage for p in first.trials} == {"tune"}
    assert {p.seed for p in first.trials} == {1}
    book = first.state["targets"]["tune"]
    assert [i["met"] for i in book["items"]] == [False, False]
    assert all("one seed per LR" in i["why"] for i in book["items"])
    assert book["spent"] == len(first.trials) and book["rounds"] == 1 and not book["final"]
    for p in first.trials:
        assert p.reason.startswith("target stages.tune.eta_ci_log2 round 1: η* of " + p.arm)
        assert "+1 seed(s) [1]" in p.reason
    fitted = {arm: sorted(p.lr for p in first.trials if p.arm == arm)
              for arm in ("gpt/sp", "gpt/completep")}
    assert all(len(v) >= 3 for v in fitted.values())
    # two seeds measure the noise: η* is within ±0.5 octave, the later stages are planned
    assert second.kind == "plan" and "transfer" in {p.stage for p in second.trials}
    book = second.state["targets"]["tune"]
    assert book["final"] and book["outcome"] == "met" and book["spent"] == len(first.trials)
    assert all(i["met"] and i["value"] <= 0.5 for i in book["items"])
    assert all(p.reason is None for p in second.trials)
    # the η* transferred is the refit over both seeds, not the first seed's
    from hptransfer.analysis import optimal_lr
    from hptransfer.coordinator.study import _round_lr

    tune = frame_of([p for p in done if p.stage == "tune"], loss)
    fit = optimal_lr(tune, bootstrap=0).shapes.set_index("arm")
    for arm, hp in second.state["hps"].items():
        assert hp["lr"] == _round_lr(float(fit.loc[arm, "lr_opt"]))
    # the same inputs plan the same trials (restart safety of the planner itself)
    again = next_step(spec, steps[0].state, frame_of(done[:len(done) - len(second.trials)],
                                                     loss))
    assert [p.content_hash for p in again.trials] == [p.content_hash for p in second.trials]


def test_the_cap_is_spent_first_then_the_study_goes_on_unmet():
    stages = study_dict()["stages"]
    stages["tune"] = {"target": {"eta_ci_log2": 0.5}, "max_extra_trials": 11}
    spec = load_spec(study_dict(**stages))
    loss = noisy_bowl(-8.3, 0.01, 0.02)  # a bowl flat within the noise
    steps, done = run_rounds(spec, loss, stop_at="transfer")
    added = [p for p in done if p.reason]
    assert len(added) == 11  # the cap, not a trial more (round 2 was cut to what was left)
    assert [s.kind for s in steps][-1] == "plan" and "transfer" in {
        p.stage for p in steps[-1].trials}
    book = steps[-1].state["targets"]["tune"]
    assert book["spent"] == 11 and book["final"]
    assert book["outcome"] == "cap spent (11 extra trials)"
    assert book["stopped_by"] == "max_extra_trials"
    assert not all(i["met"] for i in book["items"])
    # each round shares what is left between the arms, turn by turn
    for step in steps[:-1]:
        arms = [p.arm for p in step.trials]
        assert abs(arms.count("gpt/sp") - arms.count("gpt/completep")) <= 1 or len(
            set(arms)) == 1
    # nothing planned twice (64x2 is a ladder and an aspect-ratio shape: a row per stage)
    assert len({(p.stage, p.content_hash) for p in done}) == len(done)
    # flatter still, the fit is unsound (two basins, a vertex outside its LRs): seeds
    # instead of a stop while the cap lasts, then the stop with its reason
    steps, done = run_rounds(spec, noisy_bowl(-8.3, 0.002, 0.05), stop_at="transfer")
    assert [s.kind for s in steps] == ["plan", "plan", "stop"]
    assert steps[-1].state["targets"]["tune"]["spent"] == 11 == len(
        [p for p in done if p.reason])
    assert "no reliable η* at the base shape" in steps[-1].reason
    # 0 extra trials: the target is only reported
    stages["tune"] = {"target": {"eta_ci_log2": 0.5}, "max_extra_trials": 0}
    spec0 = load_spec(study_dict(**stages))
    steps0, _ = run_rounds(spec0, loss, stop_at="transfer")
    assert len(steps0) == 1 and steps0[0].state["targets"]["tune"]["outcome"].startswith(
        "cap spent")


def test_a_flop_cap_spent_first_stops_the_adding():
    """max_extra_flops tighter than max_extra_trials: the added trials' FLOPs (summed here)
    stay within the cap, one trial more would exceed it, and the ledger and the report say
    the FLOP cap stopped it."""
    probe = load_spec(study_dict(tune=TUNE_TARGET))
    one = trial_flops(plan_sweep(probe)[0])  # every trial trains at 32x1 (gpt: same FLOPs)
    cap = 7.5 * one
    stages = study_dict()["stages"]
    stages["tune"] = {**TUNE_TARGET, "max_extra_flops": cap}
    spec = load_spec(study_dict(**stages))
    loss = noisy_bowl(-8.3, 0.01, 0.02)  # flat within the noise: the target is not met
    steps, done = run_rounds(spec, loss, stop_at="transfer")
    added = [p for p in done if p.reason]
    spent = math.fsum(trial_flops(p) for p in added)
    assert {trial_flops(p) for p in added} == {one}
    assert spent <= cap < spent + one and len(added) == 7 < 40
    book = steps[-1].state["targets"]["tune"]
    assert book["final"] and book["stopped_by"] == "max_extra_flops"
    assert book["spent"] == 7 and math.isclose(book["spent_flops"], spent, rel_tol=1e-12)
    assert book["outcome"].startswith("FLOP cap spent (7 extra trials, ")
    assert "transfer" in {p.stage for p in steps[-1].trials}  # the study goes on, unmet
    report = study_fit_report(frame_of(done, loss), bootstrap=0)
    report.targets = study_targets(steps[-1].state)
    assert (f"spent 7 of 40 extra trials ({spent:.3g} of {cap:.3g} FLOPs) in "
            f"{book['rounds']} round(s); FLOP cap spent") in report.format_text()
    assert "[stopped by max_extra_flops]" in report.format_text()
    assert report.to_dict()["targets"][0]["stopped_by"] == "max_extra_flops"
    # a cap of exactly 7 trials (summed in the order the ledger sums them) admits the 7th
    exact = 0.0
    for _ in range(7):
        exact += one
    stages["tune"] = {**TUNE_TARGET, "max_extra_flops": exact}
    steps, done = run_rounds(load_spec(study_dict(**stages)), loss, stop_at="transfer")
    assert len([p for p in done if p.reason]) == 7
    assert steps[-1].state["targets"]["tune"]["spent_flops"] == exact
    # a cap below one trial: nothing is added, and it says why
    stages["tune"] = {**TUNE_TARGET, "max_extra_flops": 0.5 * one}
    steps, done = run_rounds(load_spec(study_dict(**stages)), loss, stop_at="transfer")
    book = steps[0].state["targets"]["tune"]
    assert not [p for p in done if p.reason] and book["stopped_by"] == "max_extra_flops"
    assert book["spent"] == 0 and book["spent_flops"] == 0


def test_eta_between_lrs_far_apart_gets_an_lr_in_the_gap():
    d = study_dict(tune={"target": {"eta_ci_log2": 0.1}, "max_extra_trials": 100})
    d["grid"]["lrs"] = [2.0**k for k in (-12, -10, -8, -6, -4)]  # two octaves apart
    d["grid"]["seeds"] = [0, 1]
    spec = load_spec(d)
    tune = plan_sweep(spec)
    step = next_step(spec, initial_state(spec, len(tune)),
                     frame_of(tune, noisy_bowl(-8.9, 0.01, 0.01)))
    # a curved bowl (the bracket rises above the noise), CI wider than ±0.1, η* between
    # 2^-10 and 2^-8: one LR in the middle, at both seeds, per arm
    assert sorted((p.arm, p.seed, math.log2(p.lr)) for p in step.trials) == [
        (arm, seed, -9.0) for arm in ("gpt/completep", "gpt/sp") for seed in (0, 1)]
    assert all("between LRs 2^-10.00 and 2^-8.00" in p.reason for p in step.trials)
    # the same grid an octave apart: seeds instead (a point between LRs an octave apart
    # narrows the fitted window and widens the CI)
    d["grid"]["lrs"] = [2.0**k for k in range(-12, -3)]
    spec = load_spec(d)
    tune = plan_sweep(spec)
    step = next_step(spec, initial_state(spec, len(tune)),
                     frame_of(tune, noisy_bowl(-8.9, 0.01, 0.01)))
    assert step.trials and {p.seed for p in step.trials} >= {2}
    assert all(p.lr in d["grid"]["lrs"] and "seed(s)" in p.reason for p in step.trials)


def test_a_gap_lr_that_diverged_is_not_added_again():
    # the gap's LR (2^-9) diverges at every seed: it was planned again every round (only
    # completed LRs counted as tried) until the cap was spent on the same trials
    d = study_dict(tune={"target": {"eta_ci_log2": 0.1}, "max_extra_trials": 100})
    d["grid"]["lrs"] = [2.0**k for k in (-12, -10, -8, -6, -4)]
    d["grid"]["seeds"] = [0, 1]
    spec = load_spec(d)
    curve = noisy_bowl(-8.9, 0.01, 0.01)

    def loss(p):
        return None if math.isclose(math.log2(p.lr), -9.0) else curve(p)

    steps, done = run_rounds(spec, loss, stop_at="transfer")
    gap = [p for p in done if math.isclose(math.log2(p.lr), -9.0)]
    assert len(gap) == 4  # once per arm and seed, in round 1
    assert len({(p.stage, p.content_hash) for p in done}) == len(done)
    # later rounds add seeds at the fitted LRs instead
    assert all("seed(s)" in p.reason for s in steps[1:] for p in s.trials if p.reason)


def test_an_unsound_fit_on_fewer_than_three_lrs_gets_no_seeds():
    # only one LR trains (the rest diverge): no number of seeds makes a parabola of it, so
    # the target adds nothing (it doubled the seeds until the cap was spent), and the study
    # stops with the fit's reason
    d = study_dict(tune={"target": {"eta_ci_log2": 0.5}, "max_extra_trials": 1000})
    d["grid"]["seeds"] = [0, 1]
    spec = load_spec(d)
    survivor = sorted(spec.grid.lr_values())[2]
    steps, done = run_rounds(spec, lambda p: 3.0 if p.lr == survivor else None)
    assert not [p for p in done if p.reason]
    book = steps[-1].state["targets"]["tune"]
    assert book["spent"] == 0 and book["final"]
    assert book["outcome"].startswith("no trial can bring it closer")
    assert steps[-1].kind == "stop" and "no reliable η* at the base shape" in steps[-1].reason


@pytest.mark.parametrize("top", [MAX_SEED, MAX_SEED - 1])
def test_added_seeds_stay_within_the_seed_bound(top):
    # seeds added above a grid's largest one passed MAX_SEED: a ValidationError on SQLite,
    # and past PostgreSQL's INTEGER a refused insert on every dispatcher tick
    d = study_dict(tune={"target": {"eta_ci_log2": 0.5}, "max_extra_trials": 40})
    d["grid"]["seeds"] = [top]
    spec = load_spec(d)
    steps, done = run_rounds(spec, noisy_bowl(-8.3, 0.05, 0.01), stop_at="transfer")
    added = {p.seed for p in done if p.reason}
    assert added and max(added) <= MAX_SEED and top not in added
    assert added == ({0} if top == MAX_SEED else {MAX_SEED})


def test_a_check_target_adds_trials_to_the_wider_side_of_the_shift():
    stages = {"transfer": {"shapes": [{"width": 64, "depth": 2}]},
              "check": {"target": {"shift_ci_log2": 0.5}, "max_extra_trials": 60}}
    d = study_dict(**stages)
    d["grid"]["seeds"] = [0, 1, 2, 3]  # a well-measured base
    spec = load_spec(d)
    # the base is tight (4 seeds); the check's bracket has 4 seeds too but a flat bowl there
    # would need the base side... first: a check shape whose own η* is the wide part
    loss = noisy_bowl(-8.3, 0.05, 0.004, moved=0.4)
    steps, done = run_rounds(spec, loss)
    assert steps[-1].kind == "done"
    book = steps[-1].state["targets"]["check"]
    assert book["final"], book
    added = [p for p in done if p.reason]
    if book["spent"]:
        assert {p.stage for p in added} <= {"check", "tune"}
        assert all(p.reason.startswith("target stages.check.shift_ci_log2") for p in added)
    # a one-seed base with a many-seed check: the base is the wider side, trials go to tune
    d1 = study_dict(**stages)
    spec1 = load_spec(d1)
    tune = plan_sweep(spec1)
    later = next_step(spec1, initial_state(spec1, len(tune)), frame_of(tune, loss))
    check_more = []
    for seed in (1, 2, 3):  # the check shape at 4 seeds, trained "by hand"
        check_more += [type(p)(**{**p.__dict__, "seed": seed,
                                  "content_hash": f"{p.content_hash}-{seed}"})
                       for p in later.trials]
    step = next_step(spec1, later.state, frame_of(tune + later.trials + check_more, loss))
    assert step.kind == "plan"
    assert {p.stage for p in step.trials} == {"tune"}
    assert {(p.width, p.depth) for p in step.trials} == {(32, 1)}
    assert all("its base η* the wider part" in p.reason for p in step.trials)


def _ladder_frame(planned, loss) -> pd.DataFrame:
    """frame_of plus what the frontier needs: compute, tokens, size, parameterization;
    the ladder's loss falls with compute, SP's a little above CompleteP's (within noise)."""
    df = frame_of(planned, loss)
    n = np.array([12 * p.width**2 * p.depth for p in planned], dtype=float)
    tokens = 20 * n
    df["params_non_embedding"], df["tokens"], df["flops"] = n, tokens, 6 * n * tokens
    df["params_embedding"] = 0.0
    df["parameterization"] = [p.arm.split("/")[1] for p in planned]
    ladder = (df["stage"] == "transfer").to_numpy()
    rng = np.random.default_rng(0)
    gap = np.where(df["arm"] == "gpt/sp", 1.01, 1.0)
    df.loc[ladder, "final_val_loss"] = (2.0 + 40 * gap[ladder] * df.loc[ladder, "flops"]
                                        ** -0.15 + 0.01 * rng.standard_normal(ladder.sum()))
    return df


def test_a_savings_target_adds_seeds_to_both_arms_ladders():
    ladder = [{"width": w, "depth": d} for w, d in ((32, 1), (32, 2), (64, 1), (64, 2),
                                                     (96, 2), (128, 2))]
    spec = load_spec(study_dict(transfer={
        "shapes": ladder, "target": {"savings_excludes_zero": True},
        "max_extra_trials": 100}))
    tune = plan_sweep(spec)
    bowl_loss = noisy_bowl(-8.0, 0.05, 0.0)
    later = next_step(spec, initial_state(spec, len(tune)), frame_of(tune, bowl_loss))
    done = tune + later.trials
    step = next_step(spec, later.state, _ladder_frame(done, bowl_loss))
    # the savings CI straddles 0: a seed more on every ladder shape of both arms
    book = step.state["targets"]["transfer"]
    assert [i["met"] for i in book["items"]] == [False]
    assert "straddles 0" in book["items"][0]["why"]
    assert step.kind == "plan" and len(step.trials) == 2 * len(ladder)
    for arm in ("gpt/sp", "gpt/completep"):
        mine = [p for p in step.trials if p.arm == arm]
        assert sorted((p.width, p.depth) for p in mine) == sorted(
            (s["width"], s["depth"]) for s in ladder)
        assert {(p.seed, p.stage, p.lr) for p in mine} == {
            (1, "transfer", step.state["hps"][arm]["lr"])}
    assert all("savings gpt/completep over gpt/sp" in p.reason for p in step.trials)


# ------------------------------------------------------------------ store, restart, report


def test_a_coordinator_killed_mid_extension_neither_loses_nor_repeats(hpt_home, monkeypatch):
    """Through the store and the dispatcher's ticks (no Ray): a round of added trials is
    planned, a kill at the commit of the next round's planning leaves nothing of it, a new
    coordinator (new store, new dispatcher) finishes the round's trials, plans the next
    round exactly once, and every added trial keeps its stored reason."""
    stages = study_dict()["stages"]
    stages["tune"] = {"target": {"eta_ci_log2": 0.2}, "max_extra_trials": 30}
    spec = load_spec(study_dict(**stages))
    loss = noisy_bowl(-8.3, 0.02, 0.02)
    url = get_settings().database_url
    store = Store(url)
    store.migrate()
    tune = plan_sweep(spec)
    sid = store.create_sweep("s", spec.model_dump(mode="json"), "h", "grid", tune,
                             study=initial_state(spec, len(tune)))

    def finish(st: Store, n: int | None = None) -> None:
        st.lease_pending("me", 1000, sweep_id=sid)
        for t in st.trials(sid, status="running", limit=None)[:n]:
            st.finish_trial(t.id, "completed", {"final_val_loss": loss(t)})

    d, _ = _dispatcher_without_ray(store, monkeypatch)
    finish(store)
    d.run_once()  # round 1 of the target: planned and leased
    first = [t for t in store.trials(sid, limit=None) if t.reason]
    assert first and store.get_sweep(sid).study["targets"]["tune"]["spent"] == len(first)
    finish(store, n=len(first) // 2)  # half of the round trained ...
    assert store.count_trials(sid, status="running") == len(first) - len(first) // 2
    before_kill = {t.id: (t.finished_at, t.final_val_loss)
                   for t in store.trials(sid, status="completed", limit=None)}
    store.close()  # ... and the coordinator is killed

    store2 = Store(url)
    assert store2.requeue_orphans("new-coordinator") == len(first) - len(first) // 2
    d2, _ = _dispatcher_without_ray(store2, monkeypatch)
    d2.run_once()  # leases the round's rest; nothing new is planned while they run
    assert len([t for t in store2.trials(sid, limit=None) if t.reason]) == len(first)
    finish(store2)
    # a kill at the commit of the next round's planning: nothing of it may remain
    sweep = store2.get_sweep(sid)
    step = next_step(spec, sweep.study, store2.results_frame(sid))
    assert step.kind == "plan" and step.trials

    def killed(conn) -> None:
        raise RuntimeError("coordinator killed while planning")

    event.listen(store2.engine, "commit", killed)
    try:
        with pytest.raises(RuntimeError, match="killed while planning"):
            store2.plan_stage(sid, sweep.study["round"], step.state, step.trials)
    finally:
        event.remove(store2.engine, "commit", killed)
    assert store2.get_sweep(sid).study == sweep.study
    assert store2.get_sweep(sid).n_trials == len(tune) + len(first)
    while store2.get_sweep(sid).status == "running":
        d2.run_once()  # plans the next round (or the later stages) once, then the rest
        finish(store2)
        before = store2.get_sweep(sid)
        # a second, stale planner from the same round writes nothing
        assert not store2.plan_stage(sid, before.study["round"] - 1, before.study, [])
    rows = store2.trials(sid, limit=None)
    assert store2.get_sweep(sid).status == "completed"
    # nothing planned twice (64x2 is a ladder and an aspect-ratio shape: a row per stage,
    # trained once), nothing lost, nothing trained twice
    assert len({(t.stage, t.content_hash) for t in rows}) == len(rows)
    assert [t.idx for t in rows] == list(range(len(rows)))
    assert all(t.status == "completed" for t in rows)
    for t in rows:  # a trial finished before the kill is never run again; one running then
        # is run once more (its attempt died with the coordinator); the rest once
        if t.id in before_kill:
            assert (t.finished_at, t.final_val_loss, t.attempts) == (*before_kill[t.id], 1)
        else:
            assert t.attempts == (0 if t.reused else 2 if t.reason and t.idx < len(tune)
                                  + len(first) else 1), t
    added = [t for t in rows if t.reason]
    book = store2.get_sweep(sid).study["targets"]["tune"]
    assert book["final"] and book["spent"] == len(added) <= 30
    assert all(t.to_dict()["reason"].startswith("target stages.tune.eta_ci_log2 round ")
               for t in added)
    assert {t.stage for t in added} == {"tune"}
    store2.close()


def test_the_report_says_which_targets_were_met_and_what_each_spent():
    stages = study_dict()["stages"]
    stages["tune"] = TUNE_TARGET
    spec = load_spec(study_dict(**stages))
    loss = noisy_bowl(-8.3, 0.05, 0.01)
    steps, done = run_rounds(spec, loss, stop_at="transfer")
    report = study_fit_report(frame_of(done, loss), bootstrap=0)
    report.targets = study_targets(steps[-1].state)
    spent = steps[-1].state["targets"]["tune"]["spent"]
    text = report.format_text()
    assert (f"target stages.tune.eta_ci_log2: met (2 of 2); spent {spent} of 40 extra "
            "trials in 1 round(s); met") in text
    assert "ok  gpt/sp: CI ±" in text
    head = report.to_dict()["headline"]["targets"]
    assert head[0]["spent"] == spent and head[0]["final"] and head[0]["outcome"] == "met"
    assert report.to_dict()["targets"] == head
    # a study without targets says nothing of them
    plain = study_fit_report(frame_of(done, loss), bootstrap=0)
    plain.targets = study_targets(copy.deepcopy(steps[0].state) | {"targets": {}})
    assert "Targets" not in plain.format_text()


def test_seeds_added_shrink_the_ci_as_one_over_the_root_of_the_seeds():
    """`_more(n, r)`: a half-width r times the target needs n·r² seeds in all (SE ∝
    1/sqrt(seeds)), at least 1 more and at most n more (doubling) in one round."""
    from hptransfer.coordinator.targets import _more

    assert _more(10, 1.2) == 5  # ceil(14.4) - 10
    assert _more(4, 1.1) == 1  # ceil(4.84) - 4
    assert _more(2, 3.0) == 2  # 18 - 2, held to doubling
    assert _more(5, 0.5) == 1  # met already: still one, the round's least
    assert _more(3, math.inf) == 3


def test_a_round_with_one_target_item_met_and_another_not_is_not_met():
    from hptransfer.analysis.targets import TargetCheck
    from hptransfer.coordinator.targets import _spend

    book = {"max_extra_trials": 10, "spent": 0, "rounds": 0, "final": False}
    checks = [TargetCheck("gpt/sp", True, 0.2, "met"),
              TargetCheck("gpt/mup", False, 0.9, "CI ±0.90 octave > ±0.5")]
    assert _spend(None, book, checks, []) == []  # nothing to add: final, but not met
    assert book["final"] and book["outcome"] != "met"
    assert [i["met"] for i in book["items"]] == [True, False]
    book = {"max_extra_trials": 10, "spent": 0, "rounds": 0, "final": False}
    _spend(None, book, checks[:1], [])
    assert book["outcome"] == "met"


def test_savings_seeds_are_counted_at_the_ladders_least_sampled_shape():
    """The ladder's CI is as wide as its least-seeded shape allows: 2 seeds at one shape, 4
    at another, a CI twice the target's half-width: n = 2, so 2·2² - 2 more (held to 2)."""
    from hptransfer.contracts.status import TrialStatus
    from hptransfer.coordinator.targets import _seeds_for_savings

    ladder = pd.DataFrame(
        [{"arm": "gpt/sp", "width": 64, "depth": 2, "lr": 0.01, "seed": s,
          "status": TrialStatus.COMPLETED} for s in range(2)]
        + [{"arm": "gpt/sp", "width": 128, "depth": 2, "lr": 0.01, "seed": s,
            "status": TrialStatus.COMPLETED} for s in range(4)])
    head = {"ci_low": -0.1, "ci_high": 0.3, "savings": 0.1}  # half-width 0.2 = 2 x |0.1|
    assert _seeds_for_savings(ladder, "gpt/sp", head) == 2
    one = ladder[(ladder["width"] == 128) | (ladder["seed"] == 0)]
    assert _seeds_for_savings(one, "gpt/sp", head) == 1  # a shape at one seed: measure it


def test_a_trial_kept_out_by_the_flop_cap_ends_the_round():
    """Trials are taken in turn across groups (each number some before any all); the first
    one the FLOP cap keeps out ends the round, so a cheaper trial later in the turn order
    does not jump ahead of it. Costs here are the trials' FLOPs as the spec prices them."""
    from types import SimpleNamespace

    from hptransfer.analysis.targets import TargetCheck
    from hptransfer.coordinator.plan import PlannedTrial
    from hptransfer.coordinator.targets import _Group, _spend

    def trial(name: str, flops: float) -> PlannedTrial:
        return PlannedTrial("gpt/sp", flops, 32, 1, 0.01, 1.0, 0, name, "tune")

    spec = SimpleNamespace(trial_flops=lambda cost: cost)
    book = {"stage": "tune", "target": "eta_ci_log2", "max_extra_trials": 10,
            "max_extra_flops": 5.0, "spent": 0, "spent_flops": 0.0, "rounds": 0,
            "final": False}
    unmet = [TargetCheck("gpt/sp", False, 0.9, "CI ±0.90 octave > ±0.5")]
    groups = [_Group("cheap", [trial("a0", 1.0), trial("a1", 1.0)]),
              _Group("dear", [trial("b0", 10.0)])]
    # turn order a0, b0, a1: b0 would pass the cap (1 + 10 > 5), so a1 waits too
    picked = _spend(spec, book, unmet, groups)
    assert [p.content_hash for p in picked] == ["a0"]
    assert book["spent"] == 1 and book["spent_flops"] == 1.0 and not book["final"]
    assert picked[0].reason.startswith("target stages.tune.eta_ci_log2 round 1: cheap")


def test_a_check_target_sizes_a_sides_seeds_to_its_share_of_the_shifts_width():
    """The shift's CI adds its base's and its check's halves (about equal when both are
    measured alike), so a side that must narrow gets seeds for width/√2, not the whole
    width: a check η* at ±0.105 octave against a ±0.1 target needs (0.105·√2/0.1)² ≈ 2.2
    times its 4 seeds (held to doubling: +4), where the whole width would ask for +1."""
    loss = noisy_bowl(-8.3, 0.05, 0.0005, sd_elsewhere=0.014)  # a tight base, a noisier check

    d = study_dict(transfer={"shapes": [{"width": 64, "depth": 2}]},
                   check={"target": {"shift_ci_log2": 0.1}, "max_extra_trials": 200})
    d["grid"]["seeds"] = [0, 1, 2, 3]
    steps, done = run_rounds(load_spec(d), loss)
    first = next(s for s in steps if any(p.reason for p in s.trials))
    added = [p for p in first.trials if p.reason]
    assert {(p.arm, p.stage, p.width, p.depth) for p in added} == {("gpt/sp", "check", 64, 2)}
    before = frame_of([p for p in done if p not in first.trials], loss)
    at = before[(before["arm"] == "gpt/sp") & (before["stage"] == "check")]
    n = at["seed"].nunique()
    half = float(transfer_check(before, bootstrap=0, max_ci_log2=0.1).check_fit.shapes
                 .set_index("arm").loc["gpt/sp", "ci_half_log2"])
    assert n == 4 and 0.1 < half < 0.1 * math.sqrt(2)  # the frame this test is about
    want = min(max(math.ceil(n * (half * math.sqrt(2) / 0.1) ** 2) - n, 1), n)
    assert want == 4 and {p.seed for p in added} == {4, 5, 6, 7}
    assert len(added) == 4 * 3 and "+4 seed(s) [4, 5, 6, 7] at its 3 fitted LRs" in (
        added[0].reason)
