"""Transfer drift: how far η* moves with width and with depth, per arm.

A slope of log2 η* against log2 width (or depth) near 0 means the tuned LR transfers; a
slope of -1 means η* halves every time the model doubles (what SP shows across width).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from scipy import stats

from .errors import NotEnoughData
from .optimal_lr import OptimalLRResult, optimal_lr
from .serialize import frame_records, json_safe

AXES: tuple[str, ...] = ("width", "depth")


@dataclass
class SlopeFit:
    """OLS slope of log2 η* on log2(axis), with the other axis as fixed effects."""

    slope: float
    stderr: float
    ci_low: float
    ci_high: float
    dof: int
    n_points: int
    n_levels: int
    residuals: np.ndarray


def fit_slope(
    x: np.ndarray, y: np.ndarray, groups: np.ndarray | None = None, ci: float = 0.95
) -> SlopeFit:
    """Slope of y on x with one intercept per group (within-group OLS), CI from the t law.

    Groups with a single distinct x carry no slope information and are dropped.
    """
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    g = np.zeros(len(x), dtype=int) if groups is None else pd.factorize(groups)[0]
    frame = pd.DataFrame({"x": x, "y": y, "g": g})
    spread = frame.groupby("g")["x"].transform("nunique").to_numpy()
    frame = frame[spread >= 2]
    n = len(frame)
    n_levels = int(frame["g"].nunique())
    nan = float("nan")
    if n == 0:
        return SlopeFit(nan, nan, nan, nan, 0, 0, 0, np.array([]))
    xt = (frame["x"] - frame.groupby("g")["x"].transform("mean")).to_numpy()
    yt = (frame["y"] - frame.groupby("g")["y"].transform("mean")).to_numpy()
    sxx = float(xt @ xt)
    slope = float(xt @ yt) / sxx
    resid = yt - slope * xt
    dof = n - n_levels - 1
    if dof <= 0:
        return SlopeFit(slope, nan, nan, nan, max(dof, 0), n, n_levels, resid)
    stderr = float(np.sqrt((resid @ resid) / dof / sxx))
    half = float(stats.t.ppf(0.5 + ci / 2.0, dof)) * stderr
    return SlopeFit(slope, stderr, slope - half, slope + half, dof, n, n_levels, resid)


@dataclass
class TransferResult:
    """One row per (arm, sigma_base, axis) in `slopes`; per fixed level in `by_level`."""

    slopes: pd.DataFrame
    by_level: pd.DataFrame
    reason: NotEnoughData | None = None
    warnings: list[str] = field(default_factory=list)
    tolerance: float = 0.2
    ci_level: float = 0.95

    @property
    def reliable(self) -> bool:
        return self.reason is None and bool(self.slopes["reliable"].all())

    def to_frame(self) -> pd.DataFrame:
        return self.slopes.copy()

    def to_dict(self) -> dict[str, Any]:
        return json_safe(
            {
                "analysis": "transfer",
                "reliable": self.reliable,
                "reason": self.reason,
                "warnings": self.warnings,
                "tolerance_log2": self.tolerance,
                "ci_level": self.ci_level,
                "slopes": frame_records(self.slopes),
                "by_level": frame_records(self.by_level),
            }
        )


def _verdict(fit: SlopeFit, tolerance: float) -> str:
    if not np.isfinite(fit.ci_low):
        return "inconclusive"
    if -tolerance <= fit.ci_low and fit.ci_high <= tolerance:
        return "transfers"
    if fit.ci_high < 0 or fit.ci_low > 0:
        return "drifts"
    return "inconclusive"


_SLOPE_COLUMNS = [
    "arm", "sigma_base", "axis", "slope", "stderr", "ci_low", "ci_high", "dof", "n_shapes",
    "n_levels", "max_shift_log2", "total_shift_log2", "verdict", "reliable", "reason",
    "warnings", "inputs", "residuals", "trial_ids",
]
_LEVEL_COLUMNS = ["arm", "sigma_base", "axis", "at", "level", "n_shapes", "slope", "shift_log2"]


def _axis_row(
    pts: pd.DataFrame, label: dict[str, Any], axis: str, ci: float, tolerance: float
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    other = "depth" if axis == "width" else "width"
    what = f"{axis} transfer of {', '.join(f'{k}={v}' for k, v in label.items())}"
    row: dict[str, Any] = {**label, "axis": axis, "n_shapes": len(pts), "warnings": []}
    levels: list[dict[str, Any]] = []
    values = np.unique(pts[axis].to_numpy())
    fixed = pts.groupby(other)[axis].nunique()
    reason = None
    if len(pts) == 0:
        reason = NotEnoughData(what, "no shape has a fitted η*")
    elif len(values) < 2:
        reason = NotEnoughData(what, f"only one {axis} ({values[0]}) has a fitted η*")
    elif not (fixed >= 2).any():
        reason = NotEnoughData(what, f"no single {other} was run at two or more {axis}s")
    row["reason"] = None if reason is None else reason.message
    if reason is not None:
        row.update(reliable=False, verdict="inconclusive", inputs=[], residuals=[], trial_ids=[])
        return row, levels

    x = np.log2(pts[axis].to_numpy(dtype=float))
    y = pts["log2_lr_opt"].to_numpy(dtype=float)
    fit = fit_slope(x, y, pts[other].to_numpy(), ci)
    informative = pts[pts[other].isin(fixed.index[fixed >= 2])]
    shifts = informative.groupby(other)["log2_lr_opt"].agg(lambda s: s.max() - s.min())
    for level, sub in informative.groupby(other):
        xs = np.log2(sub[axis].to_numpy(dtype=float))
        level_slope = np.polyfit(xs, sub["log2_lr_opt"].to_numpy(), 1)[0]
        levels.append({**label, "axis": axis, "at": other, "level": level,
                       "n_shapes": len(sub), "slope": float(level_slope),
                       "shift_log2": float(shifts[level])})

    notes: list[str] = []
    unreliable = int((~informative["reliable"].to_numpy(dtype=bool)).sum())
    if unreliable:
        notes.append(f"{unreliable} of {len(informative)} η* values are unreliable (grid edge, "
                     "clamped or concave): the slope may be biased toward 0")
    if fit.dof <= 0:
        notes.append("no residual degrees of freedom: add shapes to get a confidence interval")
    inputs = informative[[axis, other, "log2_lr_opt", "reliable"]].copy()
    inputs["residual"] = fit.residuals
    ids = [i for lst in informative["trial_ids"] for i in lst]
    row.update(
        slope=fit.slope, stderr=fit.stderr, ci_low=fit.ci_low, ci_high=fit.ci_high, dof=fit.dof,
        n_shapes=fit.n_points, n_levels=fit.n_levels, max_shift_log2=float(shifts.max()),
        total_shift_log2=float(y.max() - y.min()), verdict=_verdict(fit, tolerance),
        reliable=bool(fit.dof > 0 and not unreliable), warnings=notes,
        inputs=inputs.to_dict("records"), residuals=fit.residuals.tolist(), trial_ids=ids,
    )
    return row, levels


def transfer_drift(
    data: pd.DataFrame | OptimalLRResult,
    *,
    ci: float = 0.95,
    tolerance: float = 0.2,
    reliable_only: bool = False,
) -> TransferResult:
    """Slopes of log2 η* vs log2 width (depth as fixed effects) and vs log2 depth, per arm.

    `tolerance` (log2 units per doubling) decides the verdict: "transfers" when the whole CI is
    inside ±tolerance, "drifts" when the CI excludes 0, otherwise "inconclusive".
    """
    opt = data if isinstance(data, OptimalLRResult) else optimal_lr(data, bootstrap=0)
    warnings = list(opt.warnings)
    group_keys = [k for k in opt.keys if k not in AXES]
    shapes = opt.shapes
    usable = shapes[np.isfinite(shapes["log2_lr_opt"].to_numpy(dtype=float))]
    if reliable_only:
        usable = usable[usable["reliable"].to_numpy(dtype=bool)]
    rows: list[dict[str, Any]] = []
    levels: list[dict[str, Any]] = []
    reason = None
    if opt.reason is not None:
        reason = NotEnoughData("transfer drift", f"there is no fitted η* ({opt.reason.because})")
    elif usable.empty:
        reason = NotEnoughData("transfer drift", "no shape has a reliable fitted η*")
    else:
        for key, group in usable.groupby(group_keys, sort=True, dropna=False):
            label = dict(zip(group_keys, key if isinstance(key, tuple) else (key,), strict=True))
            for axis in AXES:
                row, lv = _axis_row(group, label, axis, ci, tolerance)
                rows.append(row)
                levels.extend(lv)
    slopes = pd.DataFrame(rows, columns=[*group_keys, *_SLOPE_COLUMNS[2:]])
    if rows and slopes["reason"].notna().all():
        reason = NotEnoughData("transfer drift", "; ".join(slopes["reason"].astype(str)))
    by_level = pd.DataFrame(levels, columns=[*group_keys, *_LEVEL_COLUMNS[2:]])
    slopes["reliable"] = slopes["reliable"].astype(bool)
    return TransferResult(slopes, by_level, reason, warnings, tolerance, ci)
