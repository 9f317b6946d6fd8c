"""Fits of a staged study ("tune small, train large"), each from the stage it belongs to.

The trial frame carries a `stage` column (tune, transfer, check, aspect_ratio):

- η* per arm at the base shape            from tune
- transfer check: shift of η* (log2)      from tune (η* transferred) + the check bracket at
                                          its shape(s) (the ladder's trial there is its centre)
- loss-vs-compute frontier, FLOP savings  from the transfer ladder (each arm at its own
                                          transferred HPs, untuned)
- compute-optimal N:L                     from aspect_ratio
- Chinchilla L(N, D)                      from transfer + aspect_ratio

`STAGE_SOURCES` says which stage each analysis of the report came from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from .errors import NotEnoughData
from .noise import ETA_CI_LOG2, t_quantile
from .optimal_lr import OptimalLRResult, optimal_lr, per_budget
from .savings import SavingsResult, compare_fits, flop_savings
from .serialize import analysis_dict, with_none
from .trials import CORE_COLUMNS, MUP_LABELS, SP_LABELS, prepare_trials

STAGE_SOURCES: dict[str, str] = {
    "optimal_lr": "tune",
    "transfer_check": "tune + check",
    "frontier": "transfer",
    "savings": "transfer",
    "aspect_ratio": "aspect_ratio",
    "chinchilla": "transfer + aspect_ratio",
}


def is_study_frame(df: pd.DataFrame) -> bool:
    return "stage" in df.columns and bool(df["stage"].notna().any())


@dataclass
class TransferCheckResult:
    """Per arm and check shape: η* transferred from the base shape, η* measured by the
    bracket there, and the shift log2(η*_check / η*_transferred) (0 = the LR transferred)."""

    table: pd.DataFrame
    reason: NotEnoughData | None = None
    warnings: list[str] = field(default_factory=list)
    # loss vs LR at each check shape (arm, width, depth, lr, mean_loss, n_completed, ...)
    curves: pd.DataFrame = field(default_factory=pd.DataFrame)
    # the two fits the shift is the difference of, and the trials of the check's fit (a
    # study target reads them to see which side to add trials to)
    base_fit: OptimalLRResult | None = None
    check_fit: OptimalLRResult | None = None
    check_trials: pd.DataFrame = field(default_factory=pd.DataFrame)

    @property
    def reliable(self) -> bool:
        return self.reason is None and bool(self.table["reliable"].all())

    def to_frame(self) -> pd.DataFrame:
        return self.table.copy()

    def to_dict(self) -> dict[str, Any]:
        return analysis_dict("transfer_check", self, rows=self.table, curves=self.curves)


_CHECK_COLUMNS = [
    "arm", "width", "depth", "base_width", "base_depth", "lr_transferred", "lr_check",
    "shift_log2", "shift_ci_low", "shift_ci_high", "shift_ci_half", "n_lrs", "edge",
    "reliable", "reason", "warnings",
]


def shift_interval(check: tuple[float, float, float], base: tuple[float, float, float],
                   dofs: tuple[float, float] | None = None,
                   ci: float = 0.95) -> tuple[float, float]:
    """CI of check - base from the (estimate, low, high) CIs of two independent estimates
    (log2 η* at the check shape and at the base shape): the method of variance estimates
    recovery (MOVER; Zou & Donner 2008), each side's half-widths added in quadrature, the
    base's upper half-width to the lower side. NaN when either CI is unknown; an unbounded
    side (±inf: a curvature within the noise) stays unbounded.

    With `dofs` (each CI's t degrees of freedom, level `ci`) the half-widths are turned back
    into standard errors and their sum is scaled by the t of the Welch-Satterthwaite degrees
    of freedom: two t intervals of 5 dof each added as they are cover about 0.985 at 95 %."""
    c, c_lo, c_hi = check
    b, b_lo, b_hi = base
    if any(math.isnan(v) for v in (*check, *base)) or not math.isfinite(c - b):
        return math.nan, math.nan
    shift = c - b
    down = (max(c - c_lo, 0.0), max(b_hi - b, 0.0))
    up = (max(c_hi - c, 0.0), max(b - b_lo, 0.0))
    if dofs is None or not all(math.isfinite(d) and d >= 1 for d in dofs):
        return shift - math.hypot(*down), shift + math.hypot(*up)
    t = [float(t_quantile(ci, d)) for d in dofs]

    def half(widths: tuple[float, float]) -> float:
        se = [w / ti for w, ti in zip(widths, t, strict=True)]
        if not all(math.isfinite(x) for x in se):
            return math.inf
        var = se[0] ** 2 + se[1] ** 2
        if var == 0:
            return 0.0
        dof = var**2 / sum(x**4 / d for x, d in zip(se, dofs, strict=True))
        return float(t_quantile(ci, dof)) * math.sqrt(var)

    return shift - half(down), shift + half(up)


def transfer_check(
    df: pd.DataFrame, *, bootstrap: int = 200, seed: int | None = 0, ci: float = 0.95,
    base_fit: OptimalLRResult | None = None, neighbours: int = 2,
    max_ci_log2: float = ETA_CI_LOG2,
) -> TransferCheckResult:
    """The transfer check of a study frame (stages tune, transfer, check). The shift's CI
    counts both η*s' uncertainty: `base_fit`, η* of the tune stage with its CI
    (`optimal_lr` of the tune trials at the same bootstrap and ci, on `neighbours` LRs each
    side of the best, as the study transferred it), is fitted when not given. A shift is
    reliable when both η*s are (each informative: see `optimal_lr`) and its own CI's
    half-width is at most `max_ci_log2` octaves."""
    what = "the transfer check"
    tune = df[df["stage"] == "tune"]
    checked = df[df["stage"] == "check"]
    if tune.empty or checked.empty:
        because = "the study has no tune trials" if tune.empty else "no check stage has run"
        return TransferCheckResult(pd.DataFrame(columns=_CHECK_COLUMNS),
                                   NotEnoughData(what, because))
    shapes = checked[["arm", "width", "depth"]].drop_duplicates()
    at = df.merge(shapes, on=["arm", "width", "depth"])
    at = at[at["stage"].isin(("transfer", "check"))]
    if "tokens_per_param" in at:
        # the check trains at the sweep's budget: a ladder shape's second budget (the same
        # LR, another loss) is not a point of the bracket
        budget = set(checked["tokens_per_param"].fillna(-1.0))
        at = at[at["tokens_per_param"].fillna(-1.0).isin(budget)]
    # a ladder trial and a check trial of the same LR and seed (a target may add both) are
    # one run, reused by content hash: one point of the bracket, not two
    same = [c for c in ("arm", "width", "depth", "lr", "seed", "sigma_base",
                        "tokens_per_param") if c in at]
    if "seed" in at:
        at = at.drop_duplicates(subset=same)
    if base_fit is None:
        base_fit = optimal_lr(tune, bootstrap=bootstrap, seed=seed, ci=ci,
                              neighbours=neighbours, max_ci_log2=max_ci_log2)
    base = base_fit.shapes
    check_fit = optimal_lr(at, bootstrap=bootstrap, seed=seed, ci=ci, max_ci_log2=max_ci_log2)
    check = check_fit.shapes
    rows = []
    for _, c in check.iterrows():
        b = base[base["arm"] == c["arm"]]
        b = b[np.isfinite(b["best_loss"].to_numpy(dtype=float))].sort_values("best_loss")
        row: dict[str, Any] = {k: c[k] for k in ("arm", "width", "depth")}
        row.update(n_lrs=int(c["n_lrs"]), edge=c["edge"], warnings=list(c["warnings"] or []))
        if b.empty:
            row.update(reliable=False, reason=f"arm {c['arm']} has no η* at the base shape")
            rows.append(row)
            continue
        b0 = b.iloc[0]
        lr_t = float(b0["lr_opt"])
        row.update(base_width=int(b0["width"]), base_depth=int(b0["depth"]), lr_transferred=lr_t)
        lr_c = float(c["lr_opt"])
        if math.isfinite(lr_c):
            at_check = (math.log2(lr_c), float(c["log2_ci_low"]), float(c["log2_ci_high"]))
            at_base = (math.log2(lr_t), float(b0["log2_ci_low"]), float(b0["log2_ci_high"]))
            low, high = shift_interval(at_check, at_base,
                                       (float(c["eta_noise_dof"]), float(b0["eta_noise_dof"])), ci)
            row.update(lr_check=lr_c, shift_log2=at_check[0] - at_base[0],
                       shift_ci_low=low, shift_ci_high=high, shift_ci_half=(high - low) / 2)
            if not math.isnan(at_check[1]) and math.isnan(at_base[1]):
                row["warnings"].append("η* at the base shape has no CI (one seed per LR): "
                                       "the shift has none either")
        reason = c["reason"]
        if isinstance(c["edge"], str):
            side = "below" if c["edge"] == "low" else "above"
            reason = (f"the optimum lies {side} the bracket: η* moved more than the bracket "
                      f"spans (the shift is a bound, not an estimate); widen "
                      "stages.check.log2_offsets or raise stages.check.extend")
        if not bool(b0["reliable"]) and reason is None:
            why = b0["reason"] if isinstance(b0["reason"], str) else "; ".join(
                b0["warnings"] or []) or "its fit is not sound"
            reason = f"η* at the base shape is not reliable ({why})"
        if reason is None and bool(c["reliable"]):
            reason = _shift_ci_problem(row.get("shift_ci_low", math.nan),
                                       row.get("shift_ci_high", math.nan), ci, max_ci_log2)
        row["reliable"] = bool(c["reliable"]) and bool(b0["reliable"]) and reason is None
        row["reason"] = reason
        rows.append(row)
    table = with_none(pd.DataFrame(rows, columns=_CHECK_COLUMNS), ["reason", "edge"])
    table["reliable"] = table["reliable"].astype(bool)
    curves = check_fit.curves[["arm", "width", "depth", "lr", "mean_loss", "n_completed",
                               "n_diverged"]]
    return TransferCheckResult(table, curves=curves, base_fit=base_fit, check_fit=check_fit,
                               check_trials=at)


def _shift_ci_problem(low: float, high: float, ci: float, max_ci_log2: float) -> str | None:
    """Why a shift's CI (both η*s reliable) does not make it reliable (None when it does)."""
    if math.isnan(low) or math.isnan(high):
        return "the shift has no CI"
    half = (high - low) / 2
    if half > max_ci_log2:
        return (f"the shift's {ci:.0%} CI [{low:+.2f}, {high:+.2f}] is ±{half:.2f} octave, "
                f"wider than the ±{max_ci_log2:g} asked (analysis.eta_ci_log2): the base's "
                "and the check's CIs add; add seeds")
    return None


def by_budget(frame: pd.DataFrame, *needs: str) -> OptimalLRResult:
    """`optimal_lr.per_budget` of a stage's frame, which must hold `needs` and tokens."""
    return per_budget(prepare_trials(frame, (*CORE_COLUMNS, *needs, "tokens")))


def param_of(frame: pd.DataFrame) -> dict[str, str]:
    if "parameterization" not in frame:
        return {}
    pairs = frame[["arm", "parameterization"]].drop_duplicates()
    return {str(a): str(p).lower() for a, p in pairs.itertuples(index=False)}


def study_savings(frontier: Any, reference_arm: str | None, arms_param: dict[str, str],
                  n_grid: int, ci: float) -> SavingsResult:
    """Every arm over the reference (default: SP, without one µP), plus every other arm over
    µP (the paper's headline, CompleteP over µP), keyed `arm` and `arm|reference`."""
    sp = [a for a, p in arms_param.items() if p in SP_LABELS]
    mup = [a for a, p in arms_param.items() if p in MUP_LABELS]
    if reference_arm is None:
        # a study without SP still reports CompleteP over µP, not µP over CompleteP
        reference_arm = next((arms[0] for arms in (sp, mup) if len(arms) == 1), None)
    result = flop_savings(frontier, reference_arm, n_grid=n_grid, ci=ci)
    if len(mup) == 1 and mup[0] != result.reference and mup[0] in frontier.fits:
        for arm, fit in frontier.fits.items():
            if arm in (mup[0], result.reference):
                continue
            result.comparisons[f"{arm}|{mup[0]}"] = compare_fits(
                fit, frontier.fits[mup[0]], arm=arm, reference=mup[0], n_grid=n_grid, ci=ci)
    return result
