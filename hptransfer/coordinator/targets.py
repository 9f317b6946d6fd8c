"""Stage targets: the trials a study adds, round by round, until a stage's headline is as
sure as its `target` asks or the next trial would exceed its `max_extra_trials` or its
`max_extra_flops` (their training FLOPs as pricing counts them: `SweepSpec.trial_flops`).

Pure, like the planner that calls it (coordinator/study.py): reads the spec, the study
state and the results frame, never Ray or the database. What it adds is recorded with the
state (each target's ledger: spent, rounds, each item met or not and why) in ONE
transaction (`Store.plan_stage`), so a coordinator killed mid-extension resumes from the
stored trials and ledger: nothing added twice, nothing lost.

What to add, per headline number that misses its target (`analysis.targets` says whether):

- one seed per LR (no noise measured), a bracket flat within the noise, or a CI wider than
  asked with η* between LRs close together: more seeds at the LRs the parabola is fitted
  on, as many as the CI's width says are needed (its half-width shrinks as 1/sqrt(seeds)),
  at most doubling them per round;
- a well-curved bowl whose η* sits in a gap between tried LRs wider than twice the target
  and than an octave:
  one LR in the middle of that gap, at the seeds of the best LR (the parabola through
  points far apart is a guess about the bowl between them);
- the shift at a check shape: those trials at the check shape, or at the base shape when
  the base's η* is the wider part of the shift's CI;
- savings whose CI straddles 0: a seed more on the ladder of both arms compared.

Each added trial carries `reason`: the target, the number that missed it, what was added.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd

from hptransfer.analysis import optimal_lr
from hptransfer.analysis.frontier import loss_compute_frontier
from hptransfer.analysis.staged import by_budget, param_of, study_savings, transfer_check
from hptransfer.analysis.targets import TargetCheck, eta_check, savings_check, shift_check
from hptransfer.contracts.status import TrialStatus
from hptransfer.spec import SweepSpec
from hptransfer.spec.trial import MAX_LR, MAX_SEED

from .optuna_search import fit_neighbours
from .plan import PlannedTrial, ShapeKey, trial_at

TARGET_FIELDS = {"tune": "eta_ci_log2", "transfer": "savings_excludes_zero",
                 "check": "shift_ci_log2"}
SAVINGS_BOOTSTRAP = 200  # the savings CI the planner reads (fixed seed: deterministic)


@dataclass
class _Group:
    """Trials for one headline number, most useful first, and why they are added."""

    reason: str
    trials: list[PlannedTrial]


def ledger(spec: SweepSpec, state: dict[str, Any], stage: str) -> dict[str, Any]:
    """The stage target's record in the study state (created on first use)."""
    assert spec.stages is not None
    section = getattr(spec.stages, stage)
    targets = state.setdefault("targets", {})
    return targets.setdefault(stage, {
        "stage": stage, "target": TARGET_FIELDS[stage],
        "value": getattr(section.target, TARGET_FIELDS[stage]),
        "max_extra_trials": spec.stages.extra_cap(stage),
        "max_extra_flops": spec.stages.extra_flops_cap(stage),
        "spent": 0, "spent_flops": 0.0, "rounds": 0, "items": [], "final": False,
        "outcome": None, "stopped_by": None})


def has_target(spec: SweepSpec, stage: str) -> bool:
    section = getattr(spec.stages, stage, None) if spec.stages is not None else None
    return section is not None and getattr(section, "target", None) is not None


# ---------------------------------------------------------------- per stage


def tune_round(spec: SweepSpec, state: dict[str, Any], tune: pd.DataFrame
               ) -> list[PlannedTrial]:
    """The trials the tune target adds this round (none: met, capped, or nothing helps;
    its ledger then says which)."""
    book = ledger(spec, state, "tune")
    if book["final"]:
        return []
    width = float(book["value"])
    opt = optimal_lr(tune, bootstrap=0, neighbours=fit_neighbours(spec.search.method),
                     max_ci_log2=width)
    checks, groups = [], []
    for arm in (a.name for a in spec.arms):
        best = _best_row(opt.shapes, arm)
        if best is None:
            continue
        check = eta_check(best, width)
        checks.append(check)
        if not check.met:
            rows = _arm_rows(tune, arm, best["sigma_base"])
            group = _refine(spec, best, rows, width, "tune", None,
                            f"η* of {arm} at the base shape", check)
            if group is not None:
                groups.append(group)
    return _spend(spec, book, checks, groups)


def _arm_rows(frame: pd.DataFrame, arm: str, sigma_base: float) -> pd.DataFrame:
    """The rows of one arm at one σ (the trials a fitted η* came from)."""
    return frame[(frame["arm"] == arm) & np.isclose(frame["sigma_base"], sigma_base)]


def later_round(spec: SweepSpec, state: dict[str, Any], frame: pd.DataFrame
                ) -> list[PlannedTrial]:
    """The trials the check and transfer targets add this round, together."""
    out: list[PlannedTrial] = []
    if has_target(spec, "check"):
        out += _check_round(spec, state, frame)
    if has_target(spec, "transfer"):
        out += _transfer_round(spec, state, frame)
    return out


def _check_round(spec: SweepSpec, state: dict[str, Any], frame: pd.DataFrame
                 ) -> list[PlannedTrial]:
    book = ledger(spec, state, "check")
    if book["final"]:
        return []
    width = float(book["value"])
    result = transfer_check(frame, bootstrap=0, neighbours=fit_neighbours(spec.search.method),
                            max_ci_log2=width)
    if result.base_fit is None or result.check_fit is None:
        return _spend(spec, book, [], [], why=str(result.reason or "no check fit"))
    tune = frame[frame["stage"] == "tune"]
    at = result.check_trials
    checks, groups = [], []
    side_width = width / math.sqrt(2.0)  # the shift's CI adds two about equal halves
    for row in result.table.to_dict("records"):
        check = shift_check(row, width)
        checks.append(check)
        if check.met or isinstance(row.get("edge"), str):
            continue  # a bound: no seed moves η* back inside the bracket
        base = _best_row(result.base_fit.shapes, row["arm"])
        shapes = result.check_fit.shapes
        mine = shapes[(shapes["arm"] == row["arm"]) & (shapes["width"] == row["width"])
                      & (shapes["depth"] == row["depth"])]
        if base is None or mine.empty:
            continue
        here = mine.iloc[0]
        shape = f"{row['arm']} {int(row['width'])}x{int(row['depth'])}"
        if _spread(base, side_width) > _spread(here, side_width):
            rows = _arm_rows(tune, row["arm"], base["sigma_base"])
            group = _refine(spec, base, rows, side_width, "tune", None,
                            f"shift at {shape}, its base η* the wider part", check)
        else:
            rows = at[(at["arm"] == row["arm"]) & (at["width"] == row["width"])
                      & (at["depth"] == row["depth"])]
            group = _refine(spec, here, rows, side_width, "check", None,
                            f"shift at {shape}", check)
        if group is not None:
            groups.append(group)
    return _spend(spec, book, checks, groups)


def _transfer_round(spec: SweepSpec, state: dict[str, Any], frame: pd.DataFrame
                    ) -> list[PlannedTrial]:
    book = ledger(spec, state, "transfer")
    if book["final"]:
        return []
    ladder = frame[frame["stage"] == "transfer"]
    try:
        frontier = loss_compute_frontier(
            by_budget(ladder.drop(columns=["stage"]), "flops"), bootstrap=SAVINGS_BOOTSTRAP,
            seed=0, shared_asymptote=True)
        savings = study_savings(frontier, None, param_of(frame), 20, 0.95)
    except Exception as exc:  # too few ladder points for a frontier: seeds cannot help
        return _spend(spec, book, [], [], why=f"no savings to test ({type(exc).__name__}: {exc})")
    checks, need = [], {}
    for comp in savings.comparisons.values():
        head = comp.headline()
        check = savings_check(head)
        checks.append(check)
        if check.met or head.get("savings") is None:
            continue  # met, or no savings at all (no common loss range): seeds cannot help
        for arm in (comp.arm, comp.reference):
            k = _seeds_for_savings(ladder, arm, head)
            if k > need.get(arm, (0, None))[0]:
                need[arm] = (k, check)
    groups = [_ladder_seeds(spec, state, ladder, arm, k, check)
              for arm in (a.name for a in spec.arms) if arm in need
              for k, check in [need[arm]]]
    return _spend(spec, book, checks, [g for g in groups if g.trials])


# ---------------------------------------------------------------- what to add


def _best_row(shapes: pd.DataFrame, arm: str) -> pd.Series | None:
    """The arm's fitted shape at its best σ (lowest loss), as the planner transfers it."""
    rows = shapes[(shapes["arm"] == arm)
                  & np.isfinite(shapes["best_loss"].to_numpy(dtype=float))]
    return None if rows.empty else rows.sort_values("best_loss", kind="stable").iloc[0]


def _spread(row: pd.Series, width: float) -> float:
    """How far a fit is from its share of a shift's target: its CI half-width, infinite
    without a CI or with a flat bracket."""
    half = float(row["ci_half_log2"])
    if float(row["eta_noise_dof"]) < 1 or not float(row["bracket_rise"]) > float(
            row["bracket_noise"]) or not math.isfinite(half):
        return math.inf
    return half / width


def _more(n: int, ratio: float) -> int:
    """Seeds to add to `n` to shrink a half-width `ratio` times the target to it (SE goes
    as 1/sqrt(seeds)): at least 1, at most n (doubling) per round."""
    if not math.isfinite(ratio):
        return n
    return int(min(max(math.ceil(n * ratio**2) - n, 1), n))


def _refine(spec: SweepSpec, row: pd.Series, rows: pd.DataFrame, width: float, stage: str,
            tokens_per_param: float | None, what: str, check: TargetCheck) -> _Group | None:
    """Trials that narrow one η* fit (`row`, fitted on `rows`): an LR in the gap η* sits in
    when the bowl is well curved and the gap is wider than 2·width, else more seeds at its
    fitted LRs. None when the fit has no LRs to add to, or is unsound on fewer than three
    LRs (seeds cannot make a parabola of them)."""
    if isinstance(row["edge"], str):
        return None  # η* beyond the LRs tried: the edge extensions' job, not seeds'
    arm, w, d = str(row["arm"]), int(row["width"]), int(row["depth"])
    sigma, v = float(row["sigma_base"]), float(row["log2_lr_opt"])
    half, dof = float(row["ci_half_log2"]), float(row["eta_noise_dof"])
    rise, noise = float(row["bracket_rise"]), float(row["bracket_noise"])
    done = rows[rows["status"] == TrialStatus.COMPLETED]
    fit_lrs = sorted(float(x) for x in (row["fit_lrs"] or []))
    if not bool(row["sound"]):  # two basins, a concave or clamped fit: the noise decides
        if done["lr"].nunique() < 3:
            return None  # a parabola needs three LRs: seeds at fewer cannot make it sound
        near = sorted(done["lr"].unique().astype(float),
                      key=lambda lr: (abs(math.log2(lr / float(row["best_lr"]))), lr))
        fit_lrs = sorted(fit_lrs or near[:5])
        dof = rise = noise = math.nan  # more seeds, as many again
    if not fit_lrs:
        return None

    def at(seed: int, lr: float) -> PlannedTrial:
        return trial_at(spec, ShapeKey(arm, w, d, sigma, seed), lr, stage, tokens_per_param)

    tried = np.log2(np.sort(done["lr"].unique().astype(float)))
    below, above = tried[tried <= v], tried[tried > v]
    if dof >= 1 and rise > noise and below.size and above.size and math.isfinite(v):
        low, high = float(below.max()), float(above.min())
        mid = round((low + high) / 2, 6)
        # LRs within an octave show a bowl's shape well enough (and a point between them
        # narrows the fitted window, so widens the CI): only a wider gap gets its middle
        # (nor one tried before: a gap LR that diverged or failed is not tried again)
        attempted = np.log2(rows["lr"].unique().astype(float))
        if (high - low > max(2 * width, 1.0)
                and not np.isclose(attempted, mid, atol=1e-6).any()):
            best = done[np.isclose(done["lr"], float(row["best_lr"]))]
            seeds = sorted(set(best["seed"].astype(int))) or sorted(
                set(done["seed"].astype(int)))
            return _Group(f"{what}: {check.why}; η* lies between LRs 2^{low:.2f} and "
                          f"2^{high:.2f}, {high - low:.2g} octaves apart: LR 2^{mid:.2f} "
                          f"added at {len(seeds)} seed(s)",
                          [at(s, 2.0**mid) for s in seeds])
    n = max(1, int(row["n_seeds"]))
    if dof < 1:  # the noise is not measured: a second seed measures it
        k = 1
    elif math.isnan(dof):
        k = n
    elif not rise > noise:  # the noise dominates the bracket's rise
        k = _more(n, noise / rise) if rise > 0 else n
    else:  # a curved bowl, η* between LRs close enough: the CI is noise-wide
        k = _more(n, half / width)
    seeds = _new_seeds(rows["seed"], k)
    lrs = sorted(fit_lrs, key=lambda lr: (abs(math.log2(lr) - v), lr))
    return _Group(f"{what}: {check.why}: +{k} seed(s) {seeds} at its {len(lrs)} fitted LRs",
                  [at(s, lr) for s in seeds for lr in lrs])


def _new_seeds(used: Iterable[int], k: int) -> list[int]:
    """`k` seeds none of `used`: the next ones above the largest, or the smallest free ones
    where those would pass MAX_SEED (a spec may start its seeds anywhere below it)."""
    taken = {int(seed) for seed in used}
    top = max(taken, default=-1)
    if top + k <= MAX_SEED:
        return list(range(top + 1, top + 1 + k))
    free = (seed for seed in range(MAX_SEED + 1) if seed not in taken)
    return [next(free) for _ in range(k)]


def _seeds_for_savings(ladder: pd.DataFrame, arm: str, head: dict[str, Any]) -> int:
    """Seeds to add to `arm`'s ladder so the savings CI would clear 0 (1/sqrt(seeds))."""
    done = ladder[(ladder["arm"] == arm) & (ladder["status"] == TrialStatus.COMPLETED)]
    n = int(done.groupby(["width", "depth", "lr"])["seed"].nunique().min()) if len(done) else 1
    lo, hi, est = (float(head.get(k) if head.get(k) is not None else math.nan)
                   for k in ("ci_low", "ci_high", "savings"))
    if n < 2 or not (math.isfinite(lo) and math.isfinite(hi)) or est == 0:
        return 1 if n < 2 else n
    return _more(n, (hi - lo) / 2 / abs(est))


def _ladder_seeds(spec: SweepSpec, state: dict[str, Any], ladder: pd.DataFrame, arm: str,
                  k: int, check: TargetCheck) -> _Group:
    """`k` new seeds of every ladder shape (each of its budgets) of `arm`, at its
    transferred HPs."""
    assert spec.stages is not None and spec.stages.transfer is not None
    st = spec.stages
    hps = state["hps"][arm]
    seeds = _new_seeds(ladder[ladder["arm"] == arm]["seed"], k)
    # the transferred LR as the ladder was planned at (rounded already); past MAX_LR the
    # ladder was left out, and so are its seeds
    lr = [float(hps["lr"])] if float(hps["lr"]) <= MAX_LR else []
    trials = [trial_at(spec, ShapeKey(arm, s.width, s.depth, hps["sigma_base"], seed), x,
                       "transfer", st.tokens_per_param("transfer", s))
              for seed in seeds for s in st.transfer.shapes for x in lr]
    return _Group(f"savings {check.item}: {check.why}; +{k} seed(s) {seeds} on {arm}'s "
                  f"{len(st.transfer.shapes)} ladder shapes", trials)


def _spend(spec: SweepSpec, book: dict[str, Any], checks: list[TargetCheck],
           groups: list[_Group], why: str | None = None) -> list[PlannedTrial]:
    """Record this round's verdicts in the ledger and return the trials it may add: the
    groups' trials taken in turn (each number gets some before any gets all) until the
    next would exceed a cap (the trials left, or the FLOPs left: `SweepSpec.trial_flops`,
    pricing's count); each trial tagged with its group's reason. Met, a cap reached, or
    none to add: final, the ledger saying which (`stopped_by`: the cap's field)."""
    book["items"] = [c.to_dict() for c in checks]
    left = int(book["max_extra_trials"]) - int(book["spent"])
    flop_cap = book.get("max_extra_flops")  # absent in a ledger stored before FLOP caps
    spent_flops = float(book.get("spent_flops") or 0.0)
    if checks and all(c.met for c in checks):
        book.update(final=True, outcome="met")
        return []
    if left <= 0:
        book.update(final=True, outcome=f"cap spent ({book['spent']} extra trials)",
                    stopped_by="max_extra_trials")
        return []
    todo = [g for g in groups if g.trials]
    if not todo:
        book.update(final=True, outcome=why or "no trial can bring it closer (a bound, or "
                    "an unsound fit: see the items)")
        return []
    round_no = int(book["rounds"]) + 1
    picked: list[tuple[int, int, PlannedTrial]] = []
    seen: set[tuple[str | None, str]] = set()
    blocked: float | None = None  # the FLOPs of the first trial the FLOP cap kept out
    for j in range(max(len(g.trials) for g in todo)):
        for i, g in enumerate(todo):
            if j >= len(g.trials) or len(picked) >= left or blocked is not None:
                continue
            p = g.trials[j]
            if (p.stage, p.content_hash) in seen:
                continue
            cost = spec.trial_flops(p.trial)
            if flop_cap is not None and spent_flops + cost > float(flop_cap):
                blocked = cost  # it would exceed the FLOP cap: no more this round
                continue
            seen.add((p.stage, p.content_hash))
            spent_flops += cost
            reason = (f"target stages.{book['stage']}.{book['target']} round {round_no}: "
                      f"{g.reason}")
            picked.append((i, j, replace(p, reason=reason[:2000])))
    if not picked:  # the FLOP cap keeps out even the first trial
        book.update(final=True, stopped_by="max_extra_flops",
                    outcome=f"FLOP cap spent ({book['spent']} extra trials, "
                            f"{spent_flops:.3g} of {float(flop_cap):.3g} FLOPs; the next "
                            f"trial would take {blocked or 0:.3g})")
        return []
    picked.sort(key=lambda t: (t[0], t[1]))  # each group's trials together, in its order
    book["spent"] = int(book["spent"]) + len(picked)
    book["spent_flops"] = spent_flops
    book["rounds"] = round_no
    return [p for _, _, p in picked]
