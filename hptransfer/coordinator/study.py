"""The study planner: given a study's spec, its state and the finished trials so far, the
next step — the next stage's trials, a stop with its reason, or done.

Pure: reads the spec and a results frame (`Store.results_frame`, with its `stage` column),
calls the analysis package's fits, never Ray or the database. The dispatcher records what
it returns in one transaction (`Store.plan_stage`), so planning is restart-safe: planning the
same inputs again gives the same trials with the same content hashes.

Rounds: round 0 is the tune stage (the sweep's own grid, stored at submit); a tune round
whose η* of some arm sits at an edge of the LR range adds LRs beyond that edge (up to
`stages.tune.extend` times); once every arm has a reliable η*, ONE round plans every later
stage (transfer, check, aspect_ratio: they all depend on the tune stage only), each trial
tagged with its stage and planned in stage order, so they lease in that order. After them,
a check bracket whose best LR sits at its edge adds LRs beyond that edge (up to
`stages.check.extend` rounds), so a transfer that moved η* further than the bracket spans is
measured rather than bounded.

Targets (coordinator/targets.py): a stage with a `target` not yet met adds rounds of trials
(seeds, or an LR near η*), each with its `reason`, until it is met or its `max_extra_trials`
are spent: the tune target before the later stages are planned (they transfer the refined
η*), the check and transfer targets after the check's edge extensions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pandas as pd

from hptransfer.analysis import optimal_lr
from hptransfer.analysis.staged import transfer_check
from hptransfer.contracts.status import StageState, SweepStatus, TrialStatus
from hptransfer.spec import SweepSpec
from hptransfer.spec.stages import STAGE_ORDER
from hptransfer.spec.trial import MAX_LR

from . import targets
from .optuna_search import fit_neighbours
from .plan import PlannedTrial, ShapeKey, trial_at

TUNE = "tune"
StepKind = Literal["plan", "stop", "done"]


@dataclass
class StudyStep:
    kind: StepKind
    state: dict[str, Any]
    trials: list[PlannedTrial] = field(default_factory=list)
    reason: str | None = None  # why the study stops (kind == "stop")


def initial_state(spec: SweepSpec, n_tune: int) -> dict[str, Any]:
    """The state stored with a new study: round 0 is the tune stage (its own grid)."""
    return {
        "round": 0,
        "stages": [{"name": TUNE, "round": 0, "n_trials": n_tune}],
        "hps": {},
        "extensions": {},
        "done": False,
        "stop_reason": None,
    }


def stage_names(spec: SweepSpec) -> list[str]:
    return spec.stages.enabled() if spec.stages is not None else []


def expected_trials(spec: SweepSpec, stage: str) -> int:
    """Trials a later stage will plan (without grid-edge extensions): for progress bars."""
    st = spec.stages
    if st is None or stage == TUNE:
        return 0
    n_seeds, n_arms = len(spec.grid.seeds), len(spec.arms)
    n = sum(len(st.lr_offsets(stage, shape)) for shape in st.shapes_of(stage))
    return n * n_arms * n_seeds


def next_step(spec: SweepSpec, state: dict[str, Any], frame: pd.DataFrame) -> StudyStep:
    """What the study does now that every trial planned so far has finished."""
    if spec.stages is None:
        raise ValueError("not a study: the spec has no stages section")
    state = _copy(state)
    planned = {s["name"] for s in state["stages"]}
    if planned - {TUNE}:  # the later stages were planned (and have all finished)
        return _after_later_stages(spec, state, frame)
    tune = frame[frame["stage"] == TUNE] if "stage" in frame else frame.iloc[:0]
    decisions, extend, stops = _tune_decisions(spec, state, tune)
    if stops and targets.has_target(spec, TUNE):
        # a fit the noise made unsound (two basins, a vertex outside): seeds, not a stop,
        # while the target has trials left to add (with any arm's edge extension)
        extra = targets.tune_round(spec, state, tune)
        if extra:
            state["round"] += 1
            for arm, lrs in extend.items():
                state["extensions"][arm] = state["extensions"].get(arm, 0) + 1
                extra += _tune_trials(spec, arm, lrs)
            return _target_step(state, extra)
    if stops:
        reason = "tune stage gave no η* to transfer: " + "; ".join(stops)
        state.update(stop_reason=reason, round=state["round"] + 1)
        return StudyStep("stop", state, reason=reason)
    state["round"] += 1
    if extend:
        trials = []
        for arm, lrs in extend.items():
            state["extensions"][arm] = state["extensions"].get(arm, 0) + 1
            trials += _tune_trials(spec, arm, lrs)
        state["stages"].append({"name": TUNE, "round": state["round"], "n_trials": len(trials),
                                "extends": {a: [float(x) for x in v] for a, v in extend.items()}})
        return StudyStep("plan", state, trials)
    if targets.has_target(spec, TUNE):  # η* not yet as sure as asked: seeds or LRs first
        extra = targets.tune_round(spec, state, tune)
        if extra:
            return _target_step(state, extra)
    state["hps"] = decisions
    trials = []
    for stage in stage_names(spec)[1:]:
        stage_trials = _stage_trials(spec, stage, decisions)
        state["stages"].append({"name": stage, "round": state["round"],
                                "n_trials": len(stage_trials)})
        trials += stage_trials
    if not trials:  # a study with only a tune stage
        state["done"] = True
        return StudyStep("done", state)
    return StudyStep("plan", state, trials)


def study_progress(
    spec: SweepSpec, state: dict[str, Any], counts: dict[str | None, dict[str, int]],
    sweep_status: str | None = None,
) -> list[dict[str, Any]]:
    """One entry per stage, in order: planned or not, trial counts, done/total, progress.

    `counts` is `Store.stage_counts` (stage -> status -> n). A stage not planned yet counts
    the trials it is expected to plan, so a study's total does not jump at each stage. Once
    the sweep has ended without completing (`sweep_status` cancelled, failed, stopped), a
    stage it cut short is `cancelled` and one it never planned `skipped`: none waits."""
    planned = {s["name"] for s in state.get("stages", [])}
    ended = sweep_status is not None and SweepStatus(sweep_status).is_stopped()
    out = []
    for name in stage_names(spec):
        c = {k: v for k, v in counts.get(name, {}).items() if v}
        n = sum(c.values())
        done = sum(v for k, v in c.items() if TrialStatus(k).is_finished())
        is_planned = name in planned
        total = n if is_planned else expected_trials(spec, name)
        if name == TUNE and spec.search.method == "optuna":
            total = max(n, _optuna_tune_total(spec))
        out.append({
            "stage": name,
            "planned": is_planned,
            "counts": c,
            "done": done,
            "total": total,
            "progress": done / total if total else 0.0,
            "state": (StageState.STOPPED if state.get("stop_reason") and name == TUNE else
                      StageState.CANCELLED if ended and is_planned
                      and c.get(TrialStatus.CANCELLED) else
                      StageState.DONE if is_planned and total and done >= total else
                      StageState.SKIPPED if ended and not is_planned else
                      StageState.CANCELLED if ended else
                      StageState.RUNNING if is_planned else StageState.WAITING),
        })
    return out


def _optuna_tune_total(spec: SweepSpec) -> int:
    g = spec.grid
    return (len(spec.arms) * len(g.widths) * len(g.depths) * len(g.sigma_bases)
            * len(g.seeds) * (spec.search.n_trials or 0))


# ---------------------------------------------------------------- tune


def _tune_decisions(
    spec: SweepSpec, state: dict[str, Any], tune: pd.DataFrame
) -> tuple[dict[str, dict[str, float]], dict[str, list[float]], list[str]]:
    """Per arm: the transferred HPs, or LRs to add beyond the grid edge, or why it stops."""
    assert spec.stages is not None
    opt = (optimal_lr(tune, bootstrap=0, neighbours=fit_neighbours(spec.search.method))
           if len(tune) else None)
    decisions: dict[str, dict[str, float]] = {}
    extend: dict[str, list[float]] = {}
    stops: list[str] = []
    for arm in (a.name for a in spec.arms):
        rows = tune[tune["arm"] == arm]
        if not (rows["status"] == TrialStatus.COMPLETED).any():
            stops.append(f"arm {arm}: no tune trial completed; " + _why_none(rows))
            continue
        assert opt is not None
        shapes = opt.shapes[opt.shapes["arm"] == arm]
        shapes = shapes[np.isfinite(shapes["best_loss"].to_numpy(dtype=float))]
        best = shapes.sort_values("best_loss", kind="stable").iloc[0]  # best σ
        edge = best["edge"]
        if isinstance(edge, str):
            used = state["extensions"].get(arm, 0)
            beyond = _beyond_edge(spec, rows, edge) if used < spec.stages.tune.extend else []
            if beyond:
                extend[arm] = beyond
                continue
            if used < spec.stages.tune.extend:  # nothing beyond: the next LRs pass MAX_LR
                stops.append(f"arm {arm}: the best LR {best['best_lr']:.4g} is at the high "
                             f"edge of the LR range, and the LRs beyond it exceed {MAX_LR:g}, "
                             "the most a trial takes; check the model, data and budget")
                continue
            fix = ("raise search.n_trials or stages.tune.extend" if spec.search.method ==
                   "optuna" else "widen grid.lrs or raise stages.tune.extend")
            stops.append(
                f"arm {arm}: the best LR {best['best_lr']:.4g} is at the {edge} edge of the "
                f"LRs tried after {used} extension(s); {fix}")
            continue
        # the fit's own soundness: a η* without a CI (one seed) is not `reliable`, but it
        # is still the study's best estimate to transfer
        if not bool(best["sound"]):
            why = best["reason"] or "; ".join(best["warnings"] or []) or "the fit is unreliable"
            stops.append(f"arm {arm}: no reliable η* at the base shape ({why})")
            continue
        unstable = _mostly_diverged(opt.curves, best)
        if unstable:
            stops.append(f"arm {arm}: {unstable}")
            continue
        decisions[arm] = {"lr": _round_lr(float(best["lr_opt"])),
                          "sigma_base": float(best["sigma_base"]),
                          "best_grid_lr": float(best["best_lr"]),
                          "loss": float(best["best_loss"])}
    return decisions, extend, stops


def _why_none(rows: pd.DataFrame) -> str:
    """Why an arm's tune trials gave nothing to fit, and the fix that follows from it."""
    counts = rows["status"].value_counts()
    said = ", ".join(f"{n} {status}" for status, n in counts.items())
    if counts.get(TrialStatus.DIVERGED, 0) >= len(rows) / 2:
        return f"{said}; lower the LR range (grid.lrs)"
    return (f"{said}; see the trials' errors (hpt trials SWEEP_ID --status failed): the LR "
            "range is not the cause")


def _mostly_diverged(curves: pd.DataFrame, best: pd.Series) -> str | None:
    """Why η* cannot be transferred when the best LR diverged in most of its runs (its
    mean loss is that of its survivors only, and η* sits at the edge of stability); None
    when it did not."""
    at = curves[(curves["arm"] == best["arm"]) & (curves["sigma_base"] == best["sigma_base"])
                & (curves["width"] == best["width"]) & (curves["depth"] == best["depth"])
                & np.isclose(curves["lr"], best["best_lr"])]
    if at.empty:
        return None
    done, diverged = int(at["n_completed"].iloc[0]), int(at["n_diverged"].iloc[0])
    if diverged <= done:
        return None
    return (f"the best LR {best['best_lr']:.4g} diverged in {diverged} of its "
            f"{done + diverged} runs: its loss is that of its survivors, and η* would sit at "
            "the edge of stability; add seeds, or lower the top of grid.lrs")


def _round_lr(lr: float) -> float:
    # 1e-6 octave: exact enough, and identical on every machine for reuse by content hash
    return 2.0 ** round(math.log2(lr), 6)


def _beyond_edge(spec: SweepSpec, rows: pd.DataFrame, edge: str) -> list[float]:
    assert spec.stages is not None
    log2 = np.log2(np.sort(rows["lr"].unique().astype(float)))
    if spec.search.method == "optuna":
        # sampled LRs are irregular (the refinement is half a slice): step by one slice of
        # the first batch, as a grid steps by its own spacing
        low, high = spec.grid.lr_bounds()
        step = (math.log2(high) - math.log2(low)) / max(1, spec.search.startup_count())
    else:
        step = float(np.min(np.diff(log2))) if log2.size > 1 else 1.0
    n = spec.stages.tune.extend_lrs
    if edge == "low":
        return [float(2.0 ** round(log2[0] - k * step, 12)) for k in range(1, n + 1)]
    return _trainable([float(2.0 ** round(log2[-1] + k * step, 12)) for k in range(1, n + 1)])


def _trainable(lrs: list[float]) -> list[float]:
    """The LRs a trial accepts (at most MAX_LR): an extension or offset past it is left out
    rather than planned as a trial that cannot validate."""
    return [lr for lr in lrs if lr <= MAX_LR]


def _tune_trials(spec: SweepSpec, arm: str, lrs: list[float]) -> list[PlannedTrial]:
    f = spec.fixed
    return [
        trial_at(spec, ShapeKey(arm, f.base_width, f.base_depth, sigma, seed), lr)
        for sigma in spec.grid.sigma_bases for lr in lrs for seed in spec.grid.seeds
    ]


# ---------------------------------------------------------------- later stages


def _stage_trials(
    spec: SweepSpec, stage: str, hps: dict[str, dict[str, float]]
) -> list[PlannedTrial]:
    assert spec.stages is not None and stage in STAGE_ORDER
    st = spec.stages
    out = []
    for arm in (a.name for a in spec.arms):
        lr, sigma = hps[arm]["lr"], hps[arm]["sigma_base"]
        for shape in st.shapes_of(stage):
            lrs = _trainable([_round_lr(lr * 2.0**o) for o in st.lr_offsets(stage, shape)])
            for shape_lr in lrs:
                for seed in spec.grid.seeds:
                    key = ShapeKey(arm, shape.width, shape.depth, sigma, seed)
                    out.append(trial_at(spec, key, shape_lr, stage,
                                        st.tokens_per_param(stage, shape)))
    return out


# ---------------------------------------------------------------- check extensions


def _after_later_stages(spec: SweepSpec, state: dict[str, Any],
                        frame: pd.DataFrame) -> StudyStep:
    """Extend a check bracket whose best LR is at its edge, or finish the study."""
    state["round"] += 1
    extend = _check_extensions(spec, state, frame)
    if not extend:
        extra = targets.later_round(spec, state, frame)  # targets not met yet, cap left
        if extra:
            return _target_step(state, extra)
        state["done"] = True
        return StudyStep("done", state)
    counts = state.setdefault("check_extensions", {})
    trials = []
    for (arm, width, depth), lrs in extend.items():
        label = _check_label(arm, width, depth)
        counts[label] = counts.get(label, 0) + 1
        sigma = state["hps"][arm]["sigma_base"]
        trials += [trial_at(spec, ShapeKey(arm, width, depth, sigma, seed), lr, "check")
                   for lr in lrs for seed in spec.grid.seeds]
    state["stages"].append({"name": "check", "round": state["round"], "n_trials": len(trials),
                            "extends": {_check_label(*k): v for k, v in extend.items()}})
    return StudyStep("plan", state, trials)


def _target_step(state: dict[str, Any], trials: list[PlannedTrial]) -> StudyStep:
    """A round of trials added for stage targets (each trial's `reason` says why)."""
    for stage in dict.fromkeys(p.stage for p in trials):
        state["stages"].append({"name": stage, "round": state["round"], "target": True,
                                "n_trials": sum(p.stage == stage for p in trials)})
    return StudyStep("plan", state, trials)


def _check_label(arm: str, width: int, depth: int) -> str:
    """A checked shape's key in the study state (JSON keys are strings)."""
    return f"{arm} {width}x{depth}"


def _check_extensions(spec: SweepSpec, state: dict[str, Any],
                      frame: pd.DataFrame) -> dict[tuple[str, int, int], list[float]]:
    """Per (arm, check shape) whose bracket optimum is at an edge, with extension rounds
    left: the LRs beyond that edge. The edge is the transfer check's own (the report's)."""
    check = spec.stages.check if spec.stages is not None else None
    if check is None or check.extend == 0 or "stage" not in frame:
        return {}
    result = transfer_check(frame, bootstrap=0, neighbours=fit_neighbours(spec.search.method))
    curves = result.curves  # the bracket's points, as the check fitted them
    used = state.get("check_extensions", {})
    out: dict[tuple[str, int, int], list[float]] = {}
    for row in result.table.itertuples():
        label = _check_label(row.arm, row.width, row.depth)
        if not isinstance(row.edge, str) or used.get(label, 0) >= check.extend:
            continue
        at = curves[(curves["arm"] == row.arm) & (curves["width"] == row.width)
                    & (curves["depth"] == row.depth)]
        log2 = np.log2(at["lr"].to_numpy(dtype=float))
        sign, start = (-1, log2.min()) if row.edge == "low" else (1, log2.max())
        lrs = _trainable([_round_lr(2.0 ** (start + sign * k * check.step()))
                          for k in range(1, check.extend_lrs + 1)])
        if lrs:  # none above MAX_LR: the check reports its shift as a bound
            out[(row.arm, int(row.width), int(row.depth))] = lrs
    return out


def _copy(state: dict[str, Any]) -> dict[str, Any]:
    import copy

    return copy.deepcopy(state)
