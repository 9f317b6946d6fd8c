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

    @property
    def reliable(self) -> bool:
        return self.reason is None and bool(self.table["reliable"].all())

    def to_frame(self) -> pd.DataFrame:
        return self.table.copy()

    def to_dict(self) -> dict[str, Any]:
        return analysis_dict("transfer_check", self, rows=self.table, curves=self.curves)


_CHECK_COLUMNS = [
    "arm", "width", "depth", "base_width", "base_depth", "lr_transferred", "lr_check",
    "shift_log2", "shift_ci_low", "shift_ci_high", "n_lrs", "edge", "reliable", "reason",
    "warnings",
]


def shift_interval(check: tuple[float, float, float],
                   base: tuple[float, float, float]) -> tuple[float, float]:
    """CI of check - base from the (estimate, low, high) CIs of two independent estimates
    (log2 η* at the check shape and at the base shape): the method of variance estimates
    recovery (MOVER; Zou & Donner 2008), each side's half-widths added in quadrature, the
    base's upper half-width to the lower side. NaN when either CI is unknown."""
    c, c_lo, c_hi = check
    b, b_lo, b_hi = base
    if not all(math.isfinite(v) for v in (*check, *base)):
        return math.nan, math.nan
    shift = c - b
    low = shift - math.hypot(max(c - c_lo, 0.0), max(b_hi - b, 0.0))
    high = shift + math.hypot(max(c_hi - c, 0.0), max(b - b_lo, 0.0))
    return low, high


def transfer_check(
    df: pd.DataFrame, *, bootstrap: int = 200, seed: int | None = 0, ci: float = 0.95,
    base_fit: OptimalLRResult | None = None, neighbours: int = 2,
) -> TransferCheckResult:
    """The transfer check of a study frame (stages tune, transfer, check). The shift's CI
    counts both η*s' uncertainty: `base_fit`, η* of the tune stage with its CI
    (`optimal_lr` of the tune trials at the same bootstrap and ci, on `neighbours` LRs each
    side of the best, as the study transferred it), is fitted when not given."""
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
    if base_fit is None:
        base_fit = optimal_lr(tune, bootstrap=bootstrap, seed=seed, ci=ci,
                              neighbours=neighbours)
    base = base_fit.shapes
    check_fit = optimal_lr(at, bootstrap=bootstrap, seed=seed, ci=ci)
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
            low, high = shift_interval(at_check, at_base)
            row.update(lr_check=lr_c, shift_log2=at_check[0] - at_base[0],
                       shift_ci_low=low, shift_ci_high=high)
            if math.isfinite(at_check[1]) and not math.isfinite(at_base[1]):
                row["warnings"].append("η* at the base shape has no CI (one seed per LR, "
                                       "or bootstrap off): the shift has none either")
        reason = c["reason"]
        if isinstance(c["edge"], str):
            side = "below" if c["edge"] == "low" else "above"
            reason = (f"the optimum lies {side} the bracket: η* moved more than the bracket "
                      f"spans (the shift is a bound, not an estimate); widen "
                      "stages.check.log2_offsets or raise stages.check.extend")
        row["reliable"] = bool(c["reliable"]) and bool(b0["reliable"]) and reason is None
        if not bool(b0["reliable"]) and reason is None:
            reason = "η* at the base shape is not reliable"
        row["reason"] = reason
        rows.append(row)
    table = with_none(pd.DataFrame(rows, columns=_CHECK_COLUMNS), ["reason", "edge"])
    table["reliable"] = table["reliable"].astype(bool)
    curves = check_fit.curves[["arm", "width", "depth", "lr", "mean_loss", "n_completed",
                               "n_diverged"]]
    return TransferCheckResult(table, curves=curves)


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
