"""Staged studies: the `stages:` spec section, the pure planner (coordinator/study.py), the store's
one-transaction stage planning, and a real study through the API (real Ray, real training)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pandas as pd
import pytest
from conftest import TINY_SPEC
from scipy import stats
from test_spec import one_error

from hptransfer.api.server import serve_in_thread
from hptransfer.client import ApiError, Client
from hptransfer.config import get_settings
from hptransfer.coordinator.plan import plan_sweep
from hptransfer.coordinator.study import initial_state, next_step
from hptransfer.spec import SpecError, load_spec
from hptransfer.spec.trial import Budget
from hptransfer.store.store import Store

LRS = [2.0**k for k in range(-10, -5)]  # 2^-10 ... 2^-6


def study_dict(**stages) -> dict:
    spec = copy.deepcopy(TINY_SPEC)
    spec["name"] = "study"
    spec["arms"] = [{"arch": "gpt", "parameterization": "sp"},
                    {"arch": "gpt", "parameterization": "completep"}]
    spec["grid"]["lrs"] = list(LRS)
    spec["stages"] = stages or {
        "transfer": {"shapes": [{"width": 32, "depth": 2}, {"width": 64, "depth": 2}]},
        "check": {},
        # N²·L of 7k-9k: one size, within the fit's ±15 %
        "aspect_ratio": {"shapes": [{"width": 32, "depth": 8}, {"width": 64, "depth": 2},
                                    {"width": 96, "depth": 1}, {"width": 32, "depth": 7}]},
    }
    return spec


def frame_of(planned, loss_of) -> pd.DataFrame:
    """A results frame as Store.results_frame gives it, with losses from `loss_of(p)`."""
    rows = []
    for i, p in enumerate(planned):
        loss = loss_of(p)
        rows.append(dict(
            trial_id=f"t{i}", arm=p.arm, width=p.width, depth=p.depth, lr=p.lr,
            sigma_base=p.sigma_base, seed=p.seed, stage=p.stage,
            status="diverged" if loss is None else "completed",
            final_val_loss=np.nan if loss is None else loss,
        ))
    return pd.DataFrame(rows)


def bowl(centre_log2: float):
    return lambda p: 3.0 + 0.01 * (math.log2(p.lr) - centre_log2) ** 2


# ------------------------------------------------------------------ spec


@pytest.mark.parametrize("stages, field", [
    ({"transfer": {"shapes": [{"width": 33, "depth": 2}]}}, "stages.transfer.shapes[0].width"),
    ({"transfer": {"shapes": [{"width": 32, "depth": 0}]}}, "stages.transfer.shapes[0].depth"),
    ({"transfer": {"shapes": []}}, "stages.transfer.shapes"),
    ({"transfer": {"shapes": [{"width": 32, "depth": 2}, {"width": 32, "depth": 2}]}},
     "stages.transfer.shapes"),
    ({"check": {}}, "stages.check.shapes"),
    ({"check": {"shapes": [{"width": 32, "depth": 2}], "log2_offsets": [0, 1, 2]}},
     "stages.check.log2_offsets"),
    ({"check": {"shapes": [{"width": 32, "depth": 2}], "log2_offsets": [-1, 1, 2]}},
     "stages.check.log2_offsets"),
    # distinct numbers, one LR once planned (at 1e-6 octave): the same trial three times
    ({"check": {"shapes": [{"width": 32, "depth": 2}], "log2_offsets": [-1e-300, 0, 1e-300]}},
     "stages.check.log2_offsets"),
    ({"check": {"shapes": [{"width": 32, "depth": 2}], "log2_offsets": [-1, 0, 0.0009]}},
     "stages.check.log2_offsets"),
    ({"aspect_ratio": {"shapes": [{"width": 32, "depth": 1}]}}, "stages.aspect_ratio.shapes"),
    ({"aspect_ratio": {"shapes": [{"width": 32, "depth": 1}, {"width": 64, "depth": 2},
                                  {"width": 96, "depth": 3}, {"width": 128, "depth": 4}]}},
     "stages.aspect_ratio.shapes"),  # four shapes but one width:depth ratio
    ({"aspect_ratio": {"shapes": [{"width": 32, "depth": 8}, {"width": 64, "depth": 2},
                                  {"width": 96, "depth": 1}, {"width": 128, "depth": 1}]}},
     "stages.aspect_ratio.shapes"),  # four ratios, but 128x1 is twice the others' size
    ({"transfer": {"shapes": [{"width": 64, "depth": 2, "tokens_per_param": 20}]}},
     "stages.transfer.shapes"),  # a second budget of a shape not on the ladder
    ({"transfer": {"shapes": [{"width": 32, "depth": 2},
                              {"width": 32, "depth": 2, "tokens_per_param": -1}]}},
     "stages.transfer.shapes[1].tokens_per_param"),
    ({"aspect_ratio": {"shapes": [{"width": 32, "depth": 8, "tokens_per_param": 20},
                                  {"width": 64, "depth": 2}, {"width": 96, "depth": 1},
                                  {"width": 128, "depth": 1}]}},
     "stages.aspect_ratio.shapes[0].tokens_per_param"),  # only ladder shapes take a budget
    ({"aspect_ratio": {"tokens_per_param": 0, "shapes": [
        {"width": 32, "depth": 8}, {"width": 64, "depth": 2}, {"width": 96, "depth": 1},
        {"width": 128, "depth": 1}]}}, "stages.aspect_ratio.tokens_per_param"),
    ({"tune": {"extend": 9}}, "stages.tune.extend"),
    ({"check": {"shapes": [{"width": 32, "depth": 2}], "extend": 5}}, "stages.check.extend"),
    ({"check": {"shapes": [{"width": 32, "depth": 2}], "extend_lrs": 0}},
     "stages.check.extend_lrs"),
    ({"transfr": {}}, "stages.transfr"),
])
def test_bad_stage_specs_name_the_field(stages, field):
    with pytest.raises(SpecError) as exc:
        load_spec(study_dict(**stages))
    assert field in [e["field"] for e in exc.value.errors], exc.value.errors


def _check(**fields) -> dict:
    return {"check": {"shapes": [{"width": 32, "depth": 2}], **fields}}


def _transfer(depths: range) -> dict:
    return {"transfer": {"shapes": [{"width": 32, "depth": d} for d in depths]}}


# (stages accepted at a bound, stages one past it, the field the refusal names)
STAGE_BOUNDS = [
    (_check(log2_offsets=[-8, 0, 8]), _check(log2_offsets=[-8.01, 0, 8]),
     "stages.check.log2_offsets"),
    (_check(log2_offsets=[-8, 0, 8]), _check(log2_offsets=[-8, 0, 8.01]),
     "stages.check.log2_offsets"),
    (_check(log2_offsets=list(range(-4, 5))), _check(log2_offsets=list(range(-4, 6))),
     "stages.check.log2_offsets"),
    ({"check": {"shapes": [{"width": 32, "depth": d} for d in range(1, 9)]}},
     {"check": {"shapes": [{"width": 32, "depth": d} for d in range(1, 10)]}},
     "stages.check.shapes"),
    ({"tune": {"extend": 4}}, {"tune": {"extend": 5}}, "stages.tune.extend"),
    ({"tune": {"extend_lrs": 1}}, {"tune": {"extend_lrs": 0}}, "stages.tune.extend_lrs"),
    (_transfer(range(1, 65)), _transfer(range(1, 66)), "stages.transfer.shapes"),
    ({"tune": {"target": {"eta_ci_log2": 0.5}, "max_extra_trials": 10_000}},
     {"tune": {"target": {"eta_ci_log2": 0.5}, "max_extra_trials": 10_001}},
     "stages.tune.max_extra_trials"),
]


@pytest.mark.parametrize("ok, bad, field", STAGE_BOUNDS)
def test_each_stage_bound_accepts_its_value_and_refuses_one_past_it(
        ok: dict, bad: dict, field: str) -> None:
    """At a stage field's bound the study is accepted; one past it is refused with one error
    naming the field (a trial cap high enough that only the field's own bound can refuse)."""
    assert load_spec(study_dict(**ok), max_trials=10**6).stages is not None
    one_error(study_dict(**bad), field, max_trials=10**6)


def test_aspect_ratio_shapes_with_three_ratios_say_the_cubic_needs_four():
    """Three distinct width:depth ratios are refused for the ratio count itself."""
    shapes = [{"width": 32, "depth": 2}, {"width": 64, "depth": 4}, {"width": 64, "depth": 2},
              {"width": 96, "depth": 1}]  # ratios 16, 16, 32, 96
    err = one_error(study_dict(aspect_ratio={"shapes": shapes}), "stages.aspect_ratio.shapes")
    assert err["message"].startswith("3 distinct width:depth ratios"), err


def test_an_optuna_study_needs_three_lrs_per_shape():
    """The tune stage fits a parabola: Optuna with n_trials 3 is accepted, 2 refused."""
    spec = study_dict()
    spec["search"] = {"method": "optuna", "n_trials": 3}
    assert load_spec(spec).search.n_trials == 3
    spec["search"]["n_trials"] = 2
    one_error(spec, "search.n_trials")


def test_check_offsets_a_thousandth_of_an_octave_apart_are_accepted():
    spec = load_spec(study_dict(check={"shapes": [{"width": 32, "depth": 2}],
                                       "log2_offsets": [-0.001, 0, 0.001]}))
    assert spec.stages.check.log2_offsets == [-0.001, 0.0, 0.001]


def test_aspect_ratio_shapes_must_share_one_size_as_the_fit_groups_them():
    """The N:L fit compares shapes within ±15 % of one size; a stage spread over sizes would
    train, then fit nothing, so it is refused at submit, naming each shape's size."""
    shapes = [{"width": 32, "depth": 8}, {"width": 64, "depth": 2}, {"width": 96, "depth": 1}]
    # 99k, 99k, 111k parameters; 32x7 (87k) is 12 % under their median, 32x6 (75k) 25 %
    load_spec(study_dict(aspect_ratio={"shapes": [*shapes, {"width": 32, "depth": 7}]}))
    with pytest.raises(SpecError) as exc:
        load_spec(study_dict(aspect_ratio={"shapes": [*shapes, {"width": 32, "depth": 6}]}))
    (problem,) = {e["field"]: e for e in exc.value.errors}.values()
    assert problem["field"] == "stages.aspect_ratio.shapes"
    # the fit's greedy grouping (sizes in order) pairs 32x6 with 64x2, and 32x8 with 96x1
    assert "at most 2" in problem["message"] and "32x6: 74,560" in problem["message"]
    assert "±15%" in problem["message"]


def test_a_study_tunes_at_the_base_shape():
    spec = study_dict()
    spec["grid"]["widths"] = [32, 64]
    with pytest.raises(SpecError) as exc:
        load_spec(spec)
    assert [e["field"] for e in exc.value.errors] == ["grid.widths"]
    spec = study_dict()
    spec["grid"]["lrs"] = LRS[:2]
    with pytest.raises(SpecError) as exc:
        load_spec(spec)
    assert [e["field"] for e in exc.value.errors] == ["grid.lrs"]


def test_trial_cap_counts_every_stage():
    spec = load_spec(study_dict())
    # the most it can plan: tune 2 arms x 5 LRs; per arm an extension of 2 LRs, transfer 2,
    # check 2 offsets (its offset 0 is the ladder's own trial) and one extension of 1 LR,
    # aspect ratio 4
    assert spec.trial_count() == 10 + 2 * (2 + 2 + 2 + 1 + 4)
    with pytest.raises(SpecError) as exc:
        load_spec(study_dict(), max_trials=27)
    (err,) = exc.value.errors  # the later stages push it over: they are what to shrink
    assert err["field"] == "stages" and err["message"] == (
        "the study may plan 32 trials (10 in the grid, 22 in its later stages and extension "
        "rounds), more than the cap of 27; shrink the later stages (their shapes, offsets or "
        "extend) or raise HPT_MAX_TRIALS")


# ------------------------------------------------------------------ planner


def test_a_ladder_shape_at_a_second_token_budget_is_its_own_trial():
    spec = load_spec(study_dict(
        transfer={"shapes": [{"width": 32, "depth": 2}, {"width": 64, "depth": 2},
                             {"width": 32, "depth": 2, "tokens_per_param": 20}]},
        check={}))
    tune = plan_sweep(spec)
    step = next_step(spec, initial_state(spec, len(tune)), frame_of(tune, bowl(-8)))
    ladder = [p for p in step.trials if p.stage == "transfer"]
    assert len(ladder) == 2 * 3
    budgets = {(p.arm, p.width, p.depth, p.trial.budget.tokens_per_param,
                p.trial.budget.tokens, p.trial.budget.steps) for p in ladder}
    default = spec.budget.trial_budget()
    for arm in ("gpt/sp", "gpt/completep"):
        assert (arm, 32, 2, 20.0, None, None) in budgets
        assert (arm, 32, 2, default.tokens_per_param, default.tokens, default.steps) in budgets
    assert len({p.content_hash for p in ladder}) == len(ladder)
    # the check brackets the largest shape at the sweep's own budget, and its offset 0 is
    # that ladder trial (not trained twice)
    check = [p for p in step.trials if p.stage == "check"]
    assert {(p.width, p.depth) for p in check} == {(64, 2)} and len(check) == 2 * 2
    assert all(p.trial.budget == default for p in check)


def test_the_aspect_ratio_stage_trains_every_shape_at_its_own_budget():
    stages = study_dict()["stages"]
    stages["aspect_ratio"]["tokens_per_param"] = 4
    spec = load_spec(study_dict(**stages))
    tune = plan_sweep(spec)
    step = next_step(spec, initial_state(spec, len(tune)), frame_of(tune, bowl(-8)))
    by_stage: dict[str, list] = {}
    for p in step.trials:
        by_stage.setdefault(p.stage, []).append(p)
    # one budget for the whole stage (N:L compares its shapes at equal tokens per parameter)
    assert len(by_stage["aspect_ratio"]) == 8
    assert {p.trial.budget for p in by_stage["aspect_ratio"]} == {Budget(tokens_per_param=4)}
    # the other stages keep the sweep's budget
    default = spec.budget.trial_budget()
    assert default != Budget(tokens_per_param=4)
    assert all(p.trial.budget == default for p in by_stage["transfer"] + by_stage["check"])
    # (64, 2) is both a ladder shape and an aspect-ratio shape: two budgets, two trials
    both = [p for p in step.trials if (p.width, p.depth) == (64, 2) and p.lr == pytest.approx(
        step.state["hps"][p.arm]["lr"])]
    assert {p.stage for p in both} == {"transfer", "aspect_ratio"}
    assert len({p.content_hash for p in both}) == len(both)


def test_planner_transfers_the_tuned_lr_to_every_later_stage():
    spec = load_spec(study_dict())
    tune = plan_sweep(spec)
    assert {p.stage for p in tune} == {"tune"} and len(tune) == 10
    centre = {"gpt/sp": -8.3, "gpt/completep": -7.6}
    step = next_step(spec, initial_state(spec, 10), frame_of(tune, lambda p: bowl(
        centre[p.arm])(p)))
    assert step.kind == "plan" and step.reason is None
    assert [s["name"] for s in step.state["stages"]] == [
        "tune", "transfer", "check", "aspect_ratio"]
    for arm, c in centre.items():
        # the parabola through the best LR and its neighbours finds the bowl's centre
        assert math.log2(step.state["hps"][arm]["lr"]) == pytest.approx(c, abs=1e-6)
    by_stage: dict[str, list] = {}
    for p in step.trials:
        by_stage.setdefault(p.stage, []).append(p)
    # stage order is plan order, so trials lease stage by stage
    assert [p.stage for p in step.trials] == sorted(
        (p.stage for p in step.trials), key=["transfer", "check", "aspect_ratio"].index)
    assert len(by_stage["transfer"]) == 4 and len(by_stage["aspect_ratio"]) == 8
    check = by_stage["check"]  # the largest ladder shape, at η*·2^-1 and η*·2^+1
    assert {(p.width, p.depth) for p in check} == {(64, 2)}
    for p in check:
        shift = math.log2(p.lr) - centre[p.arm]
        assert shift == pytest.approx(-1, abs=1e-5) or shift == pytest.approx(1, abs=1e-5)
    for p in by_stage["transfer"] + by_stage["aspect_ratio"]:
        assert math.log2(p.lr) == pytest.approx(centre[p.arm], abs=1e-5)
    # deterministic: planning the same inputs again gives the same trials (restart safety)
    again = next_step(spec, initial_state(spec, 10), frame_of(tune, lambda p: bowl(
        centre[p.arm])(p)))
    assert [p.content_hash for p in again.trials] == [p.content_hash for p in step.trials]
    # once the later stages have run, the study is done
    done = next_step(spec, step.state, frame_of(tune + step.trials, bowl(-8)))
    assert done.kind == "done" and done.state["done"] and not done.trials


def test_grid_edge_extends_then_stops_with_the_reason():
    spec = load_spec(study_dict())
    tune = plan_sweep(spec)
    edge = bowl(-4.0)  # optimum above the grid (2^-6 is the largest LR)
    step = next_step(spec, initial_state(spec, 10), frame_of(tune, edge))
    assert step.kind == "plan" and {p.stage for p in step.trials} == {"tune"}
    assert sorted({p.lr for p in step.trials}) == [2.0**-5, 2.0**-4]  # two octaves beyond
    assert step.state["extensions"] == {"gpt/sp": 1, "gpt/completep": 1}
    # the extension found the optimum (interior now): the study moves on
    moved = next_step(spec, step.state, frame_of(tune + step.trials, bowl(-4.6)))
    assert moved.kind == "plan" and "transfer" in {p.stage for p in moved.trials}
    # still at the edge after the one allowed extension: stop, saying why
    stop = next_step(spec, step.state, frame_of(tune + step.trials, bowl(0.0)))
    assert stop.kind == "stop" and not stop.trials
    assert "high edge" in stop.reason and "stages.tune.extend" in stop.reason
    assert stop.state["stop_reason"] == stop.reason


def test_check_at_the_bracket_edge_extends_then_reports_a_bound():
    study = study_dict()
    study["stages"]["check"] = {"log2_offsets": [-1, 0, 1], "extend": 2}
    spec = load_spec(study)
    tune = plan_sweep(spec)
    centre = {"gpt/sp": -8.3, "gpt/completep": -7.6}
    later = next_step(spec, initial_state(spec, 10),
                      frame_of(tune, lambda p: bowl(centre[p.arm])(p)))
    # at the checked shape (64x2) SP's optimum moved 2.4 octaves up, CompleteP's stayed
    moved = {"gpt/sp": centre["gpt/sp"] + 2.4, "gpt/completep": centre["gpt/completep"]}

    def loss(p):
        on_check = (p.width, p.depth) == (64, 2) and p.stage in ("transfer", "check")
        return bowl(moved[p.arm] if on_check else centre[p.arm])(p)

    done = tune + later.trials
    step = next_step(spec, later.state, frame_of(done, loss))
    # one LR one bracket step (1 octave) above SP's highest, at the checked shape, SP only
    assert step.kind == "plan" and {p.stage for p in step.trials} == {"check"}
    assert [(p.arm, p.width, p.depth) for p in step.trials] == [("gpt/sp", 64, 2)]
    assert math.log2(step.trials[0].lr) == pytest.approx(centre["gpt/sp"] + 2, abs=1e-5)
    assert step.state["check_extensions"] == {"gpt/sp 64x2": 1}
    assert step.state["stages"][-1]["name"] == "check"
    # deterministic (restart safety): the same inputs plan the same trial
    again = next_step(spec, later.state, frame_of(done, loss))
    assert [p.content_hash for p in again.trials] == [p.content_hash for p in step.trials]
    # still at the edge: the second (last) allowed round steps once more
    done += step.trials
    second = next_step(spec, step.state, frame_of(done, loss))
    assert [math.log2(p.lr) for p in second.trials] == pytest.approx([centre["gpt/sp"] + 3])
    # the optimum (+2.4) is inside now: the study is done, and the report measures the shift
    done += second.trials
    final = next_step(spec, second.state, frame_of(done, loss))
    assert final.kind == "done" and final.state["done"] and not final.trials
    from hptransfer.analysis.staged import transfer_check
    table = transfer_check(frame_of(done, loss), bootstrap=0).table.set_index("arm")
    assert table.loc["gpt/sp", "edge"] is None
    assert table.loc["gpt/sp", "shift_log2"] == pytest.approx(2.4, abs=1e-3)
    # with no extension left the edge stays a bound: done, and the report says why
    spent = next_step(spec, step.state | {"check_extensions": {"gpt/sp 64x2": 2}},
                      frame_of(done[:-1], loss))
    assert spent.kind == "done" and not spent.trials
    table = transfer_check(frame_of(done[:-1], loss), bootstrap=0).table.set_index("arm")
    assert table.loc["gpt/sp", "edge"] == "high" and not table.loc["gpt/sp", "reliable"]
    assert "stages.check.extend" in table.loc["gpt/sp", "reason"]


def test_optuna_tune_at_the_edge_extends_by_one_first_batch_slice():
    # sampled LRs are irregular (the refinement is half a slice): the extension steps by a
    # slice of the first batch, log2(hi/lo)/n_startup, not by the closest pair of samples
    from hptransfer.coordinator.plan import ShapeKey, plan_shapes, trial_for

    d = study_dict()
    d["search"] = {"method": "optuna", "n_trials": 8, "n_startup": 5}
    d["grid"]["lrs"] = [2.0**-11, 2.0**-6]  # 5 slices of one octave
    spec = load_spec(d)
    lrs = [2.0**-10.7, 2.0**-9.5, 2.0**-8.4, 2.0**-7.6, 2.0**-6.5, 2.0**-6.25, 2.0**-6.1]
    tune = [trial_for(spec, ShapeKey(*s), lr) for s in plan_shapes(spec) for lr in lrs]
    step = next_step(spec, initial_state(spec, len(tune)), frame_of(tune, bowl(-3.0)))
    assert step.kind == "plan" and {p.stage for p in step.trials} == {"tune"}
    got = sorted({math.log2(p.lr) for p in step.trials})
    assert got == pytest.approx([-5.1, -4.1], abs=1e-9)


def test_all_diverged_stops_with_the_reason():
    spec = load_spec(study_dict())
    tune = plan_sweep(spec)
    step = next_step(spec, initial_state(spec, 10), frame_of(
        tune, lambda p: None if p.arm == "gpt/sp" else bowl(-8)(p)))
    assert step.kind == "stop" and not step.trials
    assert "arm gpt/sp: no tune trial completed; 5 diverged; lower the LR range" in step.reason
    assert "completep" not in step.reason


def test_tune_trials_that_failed_are_not_blamed_on_the_lr_range():
    spec = load_spec(study_dict())
    tune = plan_sweep(spec)
    frame = frame_of(tune, bowl(-8))
    frame.loc[frame["arm"] == "gpt/sp", ["status", "final_val_loss"]] = ["failed", np.nan]
    step = next_step(spec, initial_state(spec, 10), frame)
    assert step.kind == "stop"
    assert "arm gpt/sp: no tune trial completed; 5 failed; see the trials' errors" in step.reason
    assert "lower the LR range" not in step.reason


def test_eta_is_not_transferred_from_an_lr_that_diverged_in_most_of_its_seeds():
    """Its mean loss is its one survivor's: it won on survivorship, at the edge of stability."""
    d = study_dict()
    d["grid"]["seeds"] = [0, 1, 2]
    spec = load_spec(d)
    tune = plan_sweep(spec)

    def loss(p, unstable=(1, 2)):
        if p.lr == 2.0**-6 or (p.lr == 2.0**-7 and p.seed in unstable):
            return None  # 2^-7 diverged in 2 of 3 seeds, 2^-6 in all
        return bowl(-7.4)(p)

    step = next_step(spec, initial_state(spec, len(tune)), frame_of(tune, loss))
    assert step.kind == "stop" and not step.trials
    assert "the best LR 0.007812 diverged in 2 of its 3 runs" in step.reason
    # in one of its 3 seeds only: the survivors are the majority, η* transfers
    step = next_step(spec, initial_state(spec, len(tune)),
                     frame_of(tune, lambda p: loss(p, unstable=(2,))))
    assert step.kind == "plan" and step.state["hps"]["gpt/sp"]["best_grid_lr"] == 2.0**-7


def test_an_optuna_study_needs_three_lrs_per_shape_and_its_edge_names_its_fields():
    d = study_dict()
    d["search"] = {"method": "optuna", "n_trials": 2}
    with pytest.raises(SpecError) as exc:
        load_spec(d)
    assert "search.n_trials" in [e["field"] for e in exc.value.errors]
    d["search"]["n_trials"] = 3
    d["stages"]["tune"] = {"extend": 0}
    spec = load_spec(d)
    lrs = [2.0**-10, 2.0**-9, 2.0**-8]
    tune = [p for p in plan_sweep(load_spec(study_dict())) if p.lr in lrs]
    step = next_step(spec, initial_state(spec, len(tune)), frame_of(tune, bowl(-6)))
    assert step.kind == "stop" and "high edge of the LRs tried" in step.reason
    assert "raise search.n_trials or stages.tune.extend" in step.reason
    assert "grid.lrs" not in step.reason


# ------------------------------------------------------------------ store


def stored_study(tmp_path, data_hash=None):
    """(spec, store, sweep id) of study_dict()'s study, its tune stage stored."""
    spec = load_spec(study_dict())
    tune = plan_sweep(spec)
    store = Store(f"sqlite:///{tmp_path}/hpt.db")
    store.migrate()
    sid = store.create_sweep("s", spec.model_dump(mode="json"), "h", "grid", tune,
                             data_hash=data_hash, study=initial_state(spec, len(tune)))
    return spec, store, sid


def test_plan_stage_is_one_transaction_and_never_twice(tmp_path):
    spec, store, sid = stored_study(tmp_path)
    for t in store.lease_pending("me", 100, sweep_id=sid):  # all tune trials finish
        store.finish_trial(t.id, "completed", {"final_val_loss": bowl(-8)(
            type("P", (), {"lr": t.lr})())})
    assert store.get_sweep(sid).status == "running"  # a study is not completed by this
    step = next_step(spec, store.get_sweep(sid).study, store.results_frame(sid))
    assert store.plan_stage(sid, 0, step.state, step.trials)
    # a second planner working from the same (now stale) round writes nothing
    assert not store.plan_stage(sid, 0, step.state, step.trials)
    trials = store.trials(sid, limit=None)
    assert len(trials) == 10 + len(step.trials) == store.get_sweep(sid).n_trials
    assert [t.idx for t in trials] == list(range(len(trials)))
    assert store.get_sweep(sid).study["round"] == 1
    counts = store.stage_counts(sid)
    assert counts["tune"]["completed"] == 10 and counts["check"]["pending"] == 4
    # a stop records the reason with the status, in the same transaction
    stop_state = dict(step.state, round=2, stop_reason="why")
    assert store.plan_stage(sid, 1, stop_state, [], stop=("stopped", "why"))
    sweep = store.get_sweep(sid)
    assert sweep.status == "stopped" and sweep.error == "why"
    store.close()


def test_a_shape_in_the_ladder_and_the_aspect_ratio_stage_trains_once(tmp_path):
    # (64, 2) is a ladder shape and an aspect-ratio shape at the sweep's budget: both stages
    # plan it (each keeps its row, for its own fit) and the store trains it once
    spec, store, sid = stored_study(tmp_path, data_hash="data")
    for t in store.lease_pending("me", 100, sweep_id=sid):
        store.finish_trial(t.id, "completed", {"final_val_loss": bowl(-8)(t)})
    step = next_step(spec, store.get_sweep(sid).study, store.results_frame(sid))
    assert store.plan_stage(sid, 0, step.state, step.trials)
    planned = store.trials(sid, status="pending", limit=None)
    twins = [t for t in planned if (t.width, t.depth) == (64, 2) and t.stage != "check"]
    assert sorted(t.stage for t in twins) == ["aspect_ratio"] * 2 + ["transfer"] * 2
    assert len({t.content_hash for t in twins}) == 2  # one per arm
    leased = store.lease_pending("me", 100, sweep_id=sid)
    assert len(leased) == len(planned) - 2
    assert {(t.stage, t.content_hash) for t in leased if t.id in {x.id for x in twins}} == {
        ("transfer", h) for h in {t.content_hash for t in twins}}
    for t in leased:
        store.finish_trial(t.id, "completed", {"final_val_loss": 3.0 + t.width / 1e3})
    frame = store.results_frame(sid)
    at = frame[(frame["width"] == 64) & (frame["depth"] == 2) & frame["stage"].isin(
        ["transfer", "aspect_ratio"])]
    assert len(at) == 4 and (at["status"] == "completed").all()
    assert at.groupby("stage")["reused"].agg(list).to_dict() == {
        "aspect_ratio": [True, True], "transfer": [False, False]}
    assert store.count_trials(sid, status=["pending", "running"]) == 0
    store.close()


def test_an_extension_or_offset_past_max_lr_is_left_out_not_planned():
    """A grid that validates up to MAX_LR: the tune extension past it, or a check offset
    past it, would be trials that cannot validate (the planner raised)."""
    from hptransfer.spec.trial import MAX_LR

    top = study_dict()
    top["grid"]["lrs"] = [MAX_LR / 4, MAX_LR / 2, MAX_LR]
    spec = load_spec(top)
    tune = plan_sweep(spec)
    step = next_step(spec, initial_state(spec, len(tune)),
                     frame_of(tune, lambda p: 10 - 0.1 * math.log2(p.lr)))  # falls to the top
    assert step.kind == "stop" and not step.trials
    assert "high edge" in step.reason and f"exceed {MAX_LR:g}" in step.reason
    offsets = study_dict()
    offsets["grid"]["lrs"] = [2.0**k for k in range(1, 6)]
    offsets["stages"]["check"] = {"log2_offsets": [-1, 0, 8]}  # η* 2^3: 2^11 > MAX_LR
    spec = load_spec(offsets)
    tune = plan_sweep(spec)
    step = next_step(spec, initial_state(spec, len(tune)), frame_of(tune, bowl(3)))
    check = [p for p in step.trials if p.stage == "check"]
    assert step.kind == "plan" and check and all(p.lr <= MAX_LR for p in step.trials)
    assert {round(math.log2(p.lr)) for p in check} == {2}  # -1 only: 0 is the ladder's


def _dispatcher_without_ray(store: Store, monkeypatch) -> tuple[object, list]:
    """A Dispatcher whose ticks plan and lease but hand nothing to Ray (nothing is in
    flight): what it would start is collected."""
    from hptransfer.coordinator.dispatch import Dispatcher
    from hptransfer.coordinator.ray_runner import ClusterCapacity

    d = Dispatcher(store, get_settings())
    monkeypatch.setattr(d.ray_runner, "capacity", lambda: ClusterCapacity.one_node(cpus=2.0))
    monkeypatch.setattr(d.ray_runner, "relay_progress", lambda: None)
    started: list = []
    monkeypatch.setattr(d.ray_runner, "submit", lambda spec, trials: started.extend(trials))
    return d, started


def _finish_every_trial(store: Store, sid: str) -> None:
    """Every pending or running (leased, handed to no one) trial of `sid` completes."""
    store.lease_pending("me", 1000, sweep_id=sid)
    for t in store.trials(sid, status="running", limit=None):
        store.finish_trial(t.id, "completed",
                           {"final_val_loss": bowl(-8)(type("P", (), {"lr": t.lr})())})


def _a_tuned_study_and_a_plain_sweep() -> tuple[Store, str, str]:
    """A store with a study whose tune stage has finished (its next stage due) and a plain
    sweep created after it."""
    store = Store(get_settings().database_url)
    store.migrate()
    spec = load_spec(study_dict())
    tune = plan_sweep(spec)
    study_id = store.create_sweep("study", spec.model_dump(mode="json"), "h1", "grid", tune,
                                  study=initial_state(spec, len(tune)))
    _finish_every_trial(store, study_id)
    plain = load_spec(copy.deepcopy(TINY_SPEC))
    plain_id = store.create_sweep("plain", plain.model_dump(mode="json"), "h2", "grid",
                                  plan_sweep(plain))
    return store, study_id, plain_id


def test_a_study_that_cannot_be_planned_fails_and_the_other_sweeps_go_on(hpt_home, monkeypatch):
    from hptransfer.coordinator import study_advancer

    store, study_id, plain_id = _a_tuned_study_and_a_plain_sweep()

    def planner_bug(*args):
        raise KeyError("hps")

    monkeypatch.setattr(study_advancer, "next_step", planner_bug)
    d, started = _dispatcher_without_ray(store, monkeypatch)
    for _ in range(2):
        d.run_once()  # raised out of every tick, for every sweep, before
    assert {t.sweep_id for t in started} == {plain_id}
    study = store.get_sweep(study_id)
    assert study.status == "failed"
    assert study.error.startswith("could not plan the study's next stage: KeyError")
    assert study.study["stop_reason"] == study.error
    store.close()


def test_a_stage_the_database_refuses_fails_its_study_and_an_outage_does_not(
        hpt_home, monkeypatch):
    """A stage whose rows the database refuses for good (PostgreSQL's INTEGER and a seed
    past it, say) failed every tick of every sweep, the study never marked; an outage (an
    OperationalError) is the tick's to back off from and leaves the study as it was."""
    from sqlalchemy.exc import DataError, OperationalError
    from sqlalchemy.exc import TimeoutError as PoolTimeout

    store, study_id, plain_id = _a_tuned_study_and_a_plain_sweep()
    real_plan_stage = store.plan_stage
    refusal: list[Exception] = [OperationalError("INSERT", {}, Exception("server closed"))]

    def refusing(sid, round_no, state, trials, stop=None):
        if trials and refusal:  # the stage's rows; the failed study's mark has none
            raise refusal[0]
        return real_plan_stage(sid, round_no, state, trials, stop=stop)

    monkeypatch.setattr(store, "plan_stage", refusing)
    d, started = _dispatcher_without_ray(store, monkeypatch)
    with pytest.raises(OperationalError):
        d.run_once()
    refusal[0] = PoolTimeout("QueuePool limit reached")  # a busy pool: transient too
    with pytest.raises(PoolTimeout):
        d.run_once()
    assert store.get_sweep(study_id).status != "failed"
    refusal[0] = DataError("INSERT", {}, Exception("integer out of range"))
    for _ in range(2):
        d.run_once()
    assert {t.sweep_id for t in started} == {plain_id}
    study = store.get_sweep(study_id)
    assert study.status == "failed"
    assert study.error.startswith("could not store the study's next stage: DataError")
    assert "integer out of range" in study.error
    assert "[SQL:" not in study.error  # served by the API: the error, not the statement
    store.close()


def test_a_done_study_whose_refresh_failed_completes_on_a_later_tick(hpt_home, monkeypatch):
    store = Store(get_settings().database_url)
    store.migrate()
    spec = load_spec(study_dict(transfer={"shapes": [{"width": 64, "depth": 2}]}))
    tune = plan_sweep(spec)
    sid = store.create_sweep("s", spec.model_dump(mode="json"), "h", "grid", tune,
                             study=initial_state(spec, len(tune)))
    d, _ = _dispatcher_without_ray(store, monkeypatch)
    _finish_every_trial(store, sid)
    d.run_once()  # plans the transfer stage (and leases it)
    assert store.count_trials(sid, status="running") == 2
    _finish_every_trial(store, sid)
    real, calls = store.refresh_sweep_status, []

    def fails_once(sweep_id):
        calls.append(sweep_id)
        if len(calls) == 1:
            raise RuntimeError("database is locked")
        return real(sweep_id)

    monkeypatch.setattr(store, "refresh_sweep_status", fails_once)
    with pytest.raises(RuntimeError):
        d.run_once()  # records done, then its refresh fails
    assert store.get_sweep(sid).study["done"] and store.get_sweep(sid).status == "running"
    d.run_once()  # stayed running for good before
    assert store.get_sweep(sid).status == "completed"
    store.close()


def test_a_cancelled_study_has_no_stage_waiting_or_done(tmp_path):
    from hptransfer.coordinator.study import study_progress

    spec, store, sid = stored_study(tmp_path)
    leased = store.lease_pending("me", 3, sweep_id=sid)
    store.finish_trial(leased[0].id, "completed", {"final_val_loss": 3.0})
    running = {s["stage"]: s["state"] for s in study_progress(
        spec, store.get_sweep(sid).study, store.stage_counts(sid), "running")}
    assert running == {"tune": "running", "transfer": "waiting", "check": "waiting",
                       "aspect_ratio": "waiting"}
    for trial_id in store.cancel_sweep(sid):
        store.mark_cancelled(trial_id)
    sweep = store.get_sweep(sid)
    stages = {s["stage"]: s["state"] for s in study_progress(
        spec, sweep.study, store.stage_counts(sid), sweep.status)}
    # 1 of 10 trained, 9 cancelled: it read "done", and the rest "waiting"
    assert stages == {"tune": "cancelled", "transfer": "skipped", "check": "skipped",
                      "aspect_ratio": "skipped"}
    store.close()


# ------------------------------------------------------------------ through the service


@pytest.fixture
def server(hpt_home, ray_cluster):
    settings = get_settings()
    with serve_in_thread(settings) as url:
        yield url, settings


def small_study(name: str) -> dict:
    spec = copy.deepcopy(TINY_SPEC)
    spec.update(name=name, max_concurrent=2)
    spec["grid"]["lrs"] = {"log2_min": -9, "log2_max": -3, "step": 2}
    spec["budget"] = {"steps": 30, "batch_size": 4}
    spec["fixed"]["eval_every"] = 30
    spec["stages"] = {"tune": {"extend": 2},
                      "transfer": {"shapes": [{"width": 32, "depth": 2}]}, "check": {}}
    return spec


def test_study_runs_its_stages_in_order_and_reuses_across_studies(server):
    url, _ = server
    with Client(url) as c:
        first = c.submit(small_study("study-a"))
        assert [st["stage"] for st in first["stages"]] == ["tune", "transfer", "check"]
        assert first["stages"][1]["planned"] is False and first["total"] == 4 + 1 + 2
        done = c.wait(first["id"], poll=0.3, timeout=300, progress=False)
        df = c.trials(first["id"])
        by_stage = {st: c.trials(first["id"], stage=st) for st in ("tune", "check")}
        fits = c.fits(first["id"]) if done["status"] == "completed" else None
        second = c.submit(small_study("study-b"))
        again = c.wait(second["id"], poll=0.3, timeout=300, progress=False)
        df2 = c.trials(second["id"])
    assert done["status"] in ("completed", "stopped"), done
    if done["status"] == "stopped":  # a legitimate outcome; it must say why
        assert done["error"] and "tune stage gave no η*" in done["error"]
    else:
        assert [st["state"] for st in done["stages"]] == ["done"] * 3
        assert list(df["stage"].drop_duplicates()) == ["tune", "transfer", "check"]
        assert (df["idx"].diff().dropna() > 0).all()
        assert fits is not None
    # ?stage= returns exactly that stage's trials, in plan order
    for st, part in by_stage.items():
        assert list(part.get("id", [])) == list(df.loc[df["stage"] == st, "id"])
    # planned exactly once: no content hash twice in the study
    assert df["content_hash"].is_unique
    # the second, identical study trains nothing: every trial is reused by content hash
    assert again["status"] == done["status"]
    assert len(df2) == len(df) and df2["reused"].all()
    assert list(df2["stage"]) == list(df["stage"])


def test_api_rejects_a_bad_stage_spec_with_the_field(server):
    url, _ = server
    bad = small_study("bad")
    bad["stages"]["transfer"]["shapes"][0]["width"] = 48
    with Client(url) as c, pytest.raises(ApiError) as exc:
        c.submit(bad)
    assert exc.value.status == 422
    assert [e["field"] for e in exc.value.errors] == ["stages.transfer.shapes[0].width"]
    # an unknown stage in the trial filter: 422 naming the parameter, never an empty page
    # (the query is checked before the sweep is looked up: a 422, not the id's 404)
    with Client(url) as c, pytest.raises(ApiError) as exc:
        c.trials("no-such-sweep", stage="tunes")
    assert exc.value.status == 422
    assert "stage" in str(exc.value) and "tune|transfer|check|aspect_ratio" in str(exc.value)


# ------------------------------------------------------------------ fits per stage


def test_study_report_takes_each_fit_from_its_stage():
    from hptransfer.analysis.staged import STAGE_SOURCES, transfer_check
    from hptransfer.analysis.study_report import study_fit_report

    rows = []
    centre = {"gpt/sp": -8.0, "gpt/completep": -7.0}
    moved = {"gpt/sp": -0.4, "gpt/completep": 0.0}  # true shift of η* at the check shape

    def add(stage, arm, w, d, lr, loss, flops=np.nan, params=np.nan):
        rows.append(dict(trial_id=f"t{len(rows)}", arm=arm, width=w, depth=d, lr=lr,
                         sigma_base=0.02, seed=0, status="completed", final_val_loss=loss,
                         stage=stage, flops=flops, tokens=np.nan,
                         params_non_embedding=params, params_embedding=0.0,
                         parameterization=arm.split("/")[1]))

    for arm, c in centre.items():
        for k in range(-10, -4):
            add("tune", arm, 32, 2, 2.0**k, 3 + 0.02 * (k - c) ** 2)
        # the ladder: loss = E + A C^-b with a small deterministic wiggle; SP is worse
        for i, (w, d) in enumerate([(32, 2), (32, 3), (40, 3), (48, 3), (56, 3), (64, 3)]):
            flops = 1e12 * 2.0**i
            wig = 1 + 0.002 * (-1) ** i * (1 + i % 3)
            e = 1.5 if arm == "gpt/sp" else 1.45
            add("transfer", arm, w, d, 2.0**c, (e + 30 * flops**-0.12) * wig, flops=flops)
        # check at (64, 3): the centre moved by `moved`; offset 0 is the ladder's trial
        for off in (-1, 1):
            k = c + off
            add("check", arm, 64, 3, 2.0**k, 3 + 0.02 * (k - c - moved[arm]) ** 2)
        # the ladder's trial at (64, 3) sits on the same bowl at offset 0
        rows[-3]["final_val_loss"] = 3 + 0.02 * moved[arm] ** 2
        # aspect ratio: a cubic-ish bowl in log(N/L) with its minimum at N:L = 8
        for w, d in [(16, 16), (24, 7), (32, 4), (48, 2), (64, 1)]:
            x = math.log(w / d)
            add("aspect_ratio", arm, w, d, 2.0**c, 3 + 0.05 * (x - math.log(8)) ** 2,
                params=50_000.0)
    df = pd.DataFrame(rows)
    report = study_fit_report(df, bootstrap=50)
    assert report.stages == STAGE_SOURCES and not report.failures
    eta = report.optimal_lr.shapes.set_index("arm")["log2_lr_opt"]
    for arm, c in centre.items():
        assert eta[arm] == pytest.approx(c, abs=1e-6)  # exact: the tune curve is a parabola
    shift = report.transfer_check.table.set_index("arm")["shift_log2"]
    for arm, m in moved.items():
        assert shift[arm] == pytest.approx(m, abs=1e-6)
    # one seed per trial: exact shifts, but no seed noise measured, so no CI and not reliable
    check = report.transfer_check.table
    assert not check["reliable"].any()
    assert all(r.startswith("one seed per fitted LR") for r in check["reason"])
    nl = report.aspect_ratio.groups.set_index("arm")["nl_opt"]
    assert nl.to_numpy() == pytest.approx([8.0, 8.0], rel=0.05)
    head = report.to_dict()["headline"]
    assert {r["stage"] for r in head["eta_star"]} == {"tune"}
    assert {r["stage"] for r in head["transfer_shift"]} == {"tune + check"}
    assert {r["stage"] for r in head["aspect_ratio"]} == {"aspect_ratio"}
    text = report.format_text()
    assert "[from stage: transfer]" in text and "Headline" in text
    assert "(within 1%: " in text
    # the N:L range is the loss band asked for, and says which (it always said 1 %)
    wide = study_fit_report(df, bootstrap=0, within=0.05)
    assert {r["within"] for r in wide.to_dict()["headline"]["aspect_ratio"]} == {0.05}
    assert "(within 5%: " in wide.format_text() and "(within 1%: " not in wide.format_text()
    assert "Transfer drift" not in text  # the plain-sweep drift table is not a study's
    # an optimum that moved past the bracket gives a bound, never a "reliable" shift
    far = df.copy()
    sel = (far["arm"] == "gpt/sp") & (far["width"] == 64) & (far["depth"] == 3)
    far.loc[sel, "final_val_loss"] = [3 + 0.02 * (math.log2(lr) + 8 + 1.5) ** 2
                                      for lr in far.loc[sel, "lr"]]
    row = transfer_check(far, bootstrap=0).table.set_index("arm").loc["gpt/sp"]
    assert not row["reliable"] and "below the bracket" in row["reason"]




def test_optuna_drives_the_tune_stage_and_the_transfer_uses_its_eta(server):
    """An Optuna-driven tune stage completes, and the later stages are planned at its η*
    (the study used to hang: the dispatcher read the negative "trials left to ask" of a
    study whose later stages outnumber the Optuna budget as "some left")."""
    from hptransfer.analysis import optimal_lr
    from hptransfer.coordinator.optuna_search import fit_neighbours
    from hptransfer.coordinator.study import _round_lr

    url, _ = server
    spec = small_study("study-optuna")
    spec["search"] = {"method": "optuna", "sampler": "qmc", "pruner": "none", "n_trials": 6}
    spec["grid"]["lrs"] = [2.0**-11, 2.0**-1]  # the range Optuna samples from
    with Client(url) as c:
        first = c.submit(spec)
        assert first["stages"][0]["total"] == 6
        done = c.wait(first["id"], poll=0.3, timeout=300, progress=False)
        df = c.trials(first["id"])
    assert done["status"] == "completed", done
    assert [st["state"] for st in done["stages"]] == ["done"] * 3
    tune = df[df["stage"] == "tune"]
    assert tune["optuna_trial_number"].notna().sum() == 6
    assert list(df["stage"].drop_duplicates()) == ["tune", "transfer", "check"]
    # η* fitted here from the tune trials is the LR the later stages were planned at
    frame = tune.drop(columns=["stage"]).rename(columns={"id": "trial_id"})
    # on one neighbour each side, as a search's LRs are fitted (optuna_search.fit_neighbours)
    best = optimal_lr(frame, bootstrap=0, neighbours=fit_neighbours("optuna")).shapes.iloc[0]
    eta = _round_lr(float(best["lr_opt"]))
    assert done["study"]["hps"]["gpt/completep"]["lr"] == pytest.approx(eta, rel=1e-12)
    transfer = df[df["stage"] == "transfer"]
    assert len(transfer) == 1 and transfer["lr"].iloc[0] == pytest.approx(eta, rel=1e-12)
    check = df[df["stage"] == "check"]
    # the bracket η*·2^±1, and one LR an octave beyond its edge iff its best LR sat there
    ratios = sorted(check["lr"] / eta)
    extended = done["study"].get("check_extensions", {})
    assert extended in ({}, {"gpt/completep 32x2": 1}), extended
    expected = [0.5, 2.0] if not extended else (
        [0.25, 0.5, 2.0] if ratios[0] < 0.4 else [0.5, 2.0, 4.0])
    assert ratios == pytest.approx(expected, rel=1e-5)
    assert df["content_hash"].is_unique


def test_study_frontier_keeps_each_token_budget_of_a_shape_as_its_own_point():
    """Two budgets of one ladder shape are two frontier points (never averaged as repeats):
    the frontier is the lower envelope over budgets, and L(N, D) sees D vary at fixed N."""
    from hptransfer.analysis.study_report import study_fit_report

    rows = []

    def add(stage, w, d, lr, loss, flops=np.nan, tokens=np.nan, params=np.nan):
        rows.append(dict(trial_id=f"t{len(rows)}", arm="gpt/sp", width=w, depth=d, lr=lr,
                         sigma_base=0.02, seed=0, status="completed", final_val_loss=loss,
                         stage=stage, flops=flops, tokens=tokens, params_non_embedding=params,
                         params_embedding=0.0, parameterization="sp"))

    for k in range(-10, -4):
        add("tune", 32, 2, 2.0**k, 3 + 0.02 * (k + 8) ** 2)
    for i, w in enumerate((16, 24, 32, 40, 48)):
        add("transfer", w, 2, 2.0**-8, 2.5 - 0.1 * i, flops=1e9 * 4**i, tokens=5e4 * 2**i)
    # 24x2 at 4x the tokens: 4x the compute of its 5-TPP run, and lower loss than the 32x2
    # run of about the same compute: a frontier point of its own
    add("transfer", 24, 2, 2.0**-8, 2.15, flops=4e9 * 4, tokens=4 * 1e5)
    report = study_fit_report(pd.DataFrame(rows), bootstrap=0)
    pts = report.frontier.points
    at = pts[(pts["width"] == 24)].sort_values("tokens")
    assert at["loss"].tolist() == [2.4, 2.15] and at["tokens"].tolist() == [1e5, 4e5]
    assert bool(at["on_frontier"].iloc[1])
    assert not bool(pts[(pts["width"] == 32)]["on_frontier"].iloc[0])  # 2.3 at 1.6e10
    assert len(pts) == 6


def test_the_check_bracket_leaves_out_a_second_budget_of_its_shape():
    """The largest ladder shape may also be on the ladder at a second budget: that trial has
    the transferred LR but another loss, so it must not enter the bracket's parabola."""
    from hptransfer.analysis.staged import transfer_check

    rows = []

    def add(stage, lr, loss, tokens_per_param=5.0):
        rows.append(dict(trial_id=f"t{len(rows)}", arm="gpt/sp", width=64 if stage != "tune"
                         else 32, depth=2, lr=lr, sigma_base=0.02, seed=0, status="completed",
                         final_val_loss=loss, stage=stage, tokens_per_param=tokens_per_param))

    bowl_at = lambda centre: lambda k: 3 + 0.02 * (k - centre) ** 2  # noqa: E731
    for k in range(-10, -4):
        add("tune", 2.0**k, bowl_at(-8)(k))
    for k in (-9, -7):  # the bracket 2^-1, 2^+1 around η* = 2^-8; its optimum moved to -8.5
        add("check", 2.0**k, bowl_at(-8.5)(k))
    add("transfer", 2.0**-8, bowl_at(-8.5)(-8))
    shift = transfer_check(pd.DataFrame(rows), bootstrap=0).table["shift_log2"].iloc[0]
    assert shift == pytest.approx(-0.5, abs=1e-9)
    # the same shape at 20 tokens per parameter: far lower loss at η*, another budget
    add("transfer", 2.0**-8, 1.0, tokens_per_param=20.0)
    again = transfer_check(pd.DataFrame(rows), bootstrap=0).table["shift_log2"].iloc[0]
    assert again == pytest.approx(-0.5, abs=1e-9)


def test_the_shift_interval_is_the_normal_interval_of_a_difference_and_covers():
    """MOVER on two symmetric normal CIs is exactly the normal CI of their difference, and
    over repeated draws covers the true shift at the nominal rate, where the check's CI
    alone (the base's uncertainty left out) does not."""
    from hptransfer.analysis.staged import shift_interval

    z = 1.959963984540054
    low, high = shift_interval((0.5, 0.5 - z * 0.3, 0.5 + z * 0.3), (0.0, -z * 0.4, z * 0.4))
    assert (low, high) == pytest.approx((0.5 - z * 0.5, 0.5 + z * 0.5), abs=1e-12)
    assert all(math.isnan(v) for v in shift_interval((0.5, math.nan, math.nan), (0, -1, 1)))
    rng = np.random.default_rng(0)
    true_shift, sd = -0.4, 0.25
    c = -7.4 + sd * rng.standard_normal(20_000)
    b = -7.0 + sd * rng.standard_normal(20_000)
    mover = [shift_interval((ci, ci - z * sd, ci + z * sd), (bi, bi - z * sd, bi + z * sd))
             for ci, bi in zip(c, b, strict=True)]
    covered = np.mean([lo <= true_shift <= hi for lo, hi in mover])
    check_only = np.mean(np.abs(c - b - true_shift) <= z * sd)
    assert covered == pytest.approx(0.95, abs=0.01)
    assert check_only == pytest.approx(0.83, abs=0.015)  # P(|N(0, 2)| < 1.96)


def test_the_transfer_checks_shift_ci_counts_the_base_eta_uncertainty():
    from hptransfer.analysis.optimal_lr import optimal_lr
    from hptransfer.analysis.staged import transfer_check

    rng = np.random.default_rng(3)
    rows = []

    def add(stage, w, lr, loss, seed):
        rows.append(dict(trial_id=f"t{len(rows)}", arm="gpt/sp", width=w, depth=2, lr=lr,
                         sigma_base=0.02, seed=seed, status="completed", final_val_loss=loss,
                         stage=stage))

    def frame(base_noise):
        rows.clear()
        for seed in range(4):
            for k in range(-11, -4):
                add("tune", 32, 2.0**k, 3 + 0.02 * (k + 8) ** 2
                    + base_noise * rng.standard_normal(), seed)
            for k in (-10, -9, -7, -6):
                add("check", 64, 2.0**k, 3 + 0.02 * (k + 8.5) ** 2
                    + 0.004 * rng.standard_normal(), seed)
            add("transfer", 64, 2.0**-8, 3 + 0.02 * 0.25 + 0.004 * rng.standard_normal(), seed)
        return pd.DataFrame(rows)

    exact, noisy = frame(0.0), frame(0.004)
    for df in (exact, noisy):
        row = transfer_check(df, bootstrap=200).table.iloc[0]
        tune = optimal_lr(df[df["stage"] == "tune"], bootstrap=200).shapes.iloc[0]
        at = df[df["stage"].isin(("check", "transfer"))]
        check = optimal_lr(at, bootstrap=200).shapes.iloc[0]
        b, c = tune["log2_lr_opt"], check["log2_lr_opt"]
        assert row["shift_log2"] == pytest.approx(c - b)
        if df is exact:  # the same η* in every resample: the check's CI, moved by b
            assert tune["log2_ci_high"] - tune["log2_ci_low"] == pytest.approx(0, abs=1e-9)
            assert row["shift_ci_low"] == pytest.approx(check["log2_ci_low"] - b)
            assert row["shift_ci_high"] == pytest.approx(check["log2_ci_high"] - b)
        else:  # wider than the check's own CI on both sides, by the base's half-widths
            assert tune["log2_ci_high"] - tune["log2_ci_low"] > 0.01
            dofs = (check["eta_noise_dof"], tune["eta_noise_dof"])

            def half(widths, dofs=dofs):  # SEs in quadrature, Welch-Satterthwaite t
                se = [w / stats.t.ppf(0.975, d) for w, d in zip(widths, dofs, strict=True)]
                dof = sum(x**2 for x in se) ** 2 / sum(
                    x**4 / d for x, d in zip(se, dofs, strict=True))
                return stats.t.ppf(0.975, dof) * math.hypot(*se)

            assert row["shift_ci_low"] == pytest.approx(c - b - half(
                (c - check["log2_ci_low"], tune["log2_ci_high"] - b)))
            assert row["shift_ci_high"] == pytest.approx(c - b + half(
                (check["log2_ci_high"] - c, b - tune["log2_ci_low"])))
            assert row["shift_ci_low"] < check["log2_ci_low"] - b
            assert row["shift_ci_high"] > check["log2_ci_high"] - b
