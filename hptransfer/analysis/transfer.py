"""Transfer drift: how far η* moves with width and with depth, per arm.

A slope of log2 η* against log2 width (or depth) near 0 means the tuned LR transfers; a
slope of -1 means η* halves every time the model doubles (what SP shows across width).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from hptransfer.jsonsafe import frame_records

from .errors import NotEnoughData
from .noise import t_quantile
from .optimal_lr import OptimalLRResult, optimal_lr
from .serialize import analysis_dict, with_none

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


def _within(codes: np.ndarray, values: np.ndarray, n_groups: int) -> np.ndarray:
    """Values minus their group mean."""
    counts = np.bincount(codes, minlength=n_groups)
    means = np.bincount(codes, weights=values, minlength=n_groups) / np.maximum(counts, 1)
    return values - means[codes]


def fit_slope(
    x: np.ndarray, y: np.ndarray, groups: np.ndarray | None = None, ci: float = 0.95
) -> SlopeFit:
    """Slope of y on x with one intercept per group (within-group OLS), CI from the t law.

    Groups with a single distinct x carry no slope information and are dropped, as are
    points whose x or y is not finite; a missing (NaN) group label is a group of its own.
    """
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    finite = np.isfinite(x) & np.isfinite(y)
    x, y = x[finite], y[finite]
    codes = (np.zeros(len(x), dtype=int) if groups is None
             else pd.factorize(np.asarray(groups)[finite], use_na_sentinel=False)[0])
    n_groups = int(codes.max()) + 1 if len(codes) else 0
    xt = _within(codes, x, n_groups)
    spread = np.bincount(codes, weights=xt**2, minlength=n_groups) > 1e-12
    keep = spread[codes]
    codes, xt, yt = codes[keep], xt[keep], _within(codes, y, n_groups)[keep]
    n, n_levels = len(xt), int(spread.sum())
    nan = float("nan")
    if n == 0:
        return SlopeFit(nan, nan, nan, nan, 0, 0, 0, np.array([]))
    sxx = float(np.sum(xt * xt))
    slope = float(np.sum(xt * yt)) / sxx
    resid = yt - slope * xt
    dof = n - n_levels - 1
    if dof <= 0:
        return SlopeFit(slope, nan, nan, nan, max(dof, 0), n, n_levels, resid)
    stderr = float(np.sqrt(np.sum(resid * resid) / dof / sxx))
    half = float(t_quantile(ci, dof)) * stderr
    return SlopeFit(slope, stderr, slope - half, slope + half, dof, n, n_levels, resid)


@dataclass
class TransferResult:
    """One row per (arm, sigma_base, axis) in `slopes`; per fixed level in `by_level`."""

    slopes: pd.DataFrame
    by_level: pd.DataFrame
    reason: NotEnoughData | None = None
    warnings: list[str] = field(default_factory=list)
    tolerance: float = 0.1
    ci_level: float = 0.95

    @property
    def reliable(self) -> bool:
        return self.reason is None and bool(self.slopes["reliable"].all())

    def to_frame(self) -> pd.DataFrame:
        return self.slopes.copy()

    def to_dict(self) -> dict[str, Any]:
        return analysis_dict(
            "transfer",
            self,
            tolerance_log2=self.tolerance,
            ci_level=self.ci_level,
            slopes=frame_records(self.slopes),
            by_level=frame_records(self.by_level),
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
    "arm",
    "sigma_base",
    "axis",
    "slope",
    "stderr",
    "ci_low",
    "ci_high",
    "dof",
    "n_shapes",
    "n_levels",
    "max_shift_log2",
    "total_shift_log2",
    "verdict",
    "reliable",
    "reason",
    "warnings",
    "inputs",
    "residuals",
    "trial_ids",
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

    x_all = np.log2(pts[axis].to_numpy(dtype=float))
    y_all = pts["log2_lr_opt"].to_numpy(dtype=float)
    level_all = pts[other].to_numpy()
    fit = fit_slope(x_all, y_all, level_all, ci)
    informative = pts[pts[other].isin(fixed.index[fixed >= 2]).to_numpy()]
    x = np.log2(informative[axis].to_numpy(dtype=float))
    y = informative["log2_lr_opt"].to_numpy(dtype=float)
    codes, uniques = pd.factorize(informative[other].to_numpy(), sort=True)
    k = len(uniques)
    xt, yt = _within(codes, x, k), _within(codes, y, k)
    level_slopes = np.bincount(codes, xt * yt, k) / np.bincount(codes, xt * xt, k)
    hi = np.full(k, -np.inf)
    lo = np.full(k, np.inf)
    np.maximum.at(hi, codes, y)
    np.minimum.at(lo, codes, y)
    counts = np.bincount(codes, minlength=k)
    for j, level in enumerate(uniques):
        levels.append(
            {
                **label,
                "axis": axis,
                "at": other,
                "level": level,
                "n_shapes": int(counts[j]),
                "slope": float(level_slopes[j]),
                "shift_log2": float(hi[j] - lo[j]),
            }
        )

    notes: list[str] = []
    unreliable = int((~informative["reliable"].to_numpy(dtype=bool)).sum())
    if unreliable:
        notes.append(
            f"{unreliable} of {len(informative)} η* values are unreliable (grid edge, "
            "clamped, concave or two basins): the slope may be biased toward 0"
        )
    if fit.dof <= 0:
        notes.append("no residual degrees of freedom: add shapes to get a confidence interval")
    inputs = [
        {axis: a, other: o, "log2_lr_opt": v, "reliable": bool(r), "residual": e}
        for a, o, v, r, e in zip(
            informative[axis].tolist(),
            informative[other].tolist(),
            y.tolist(),
            informative["reliable"].tolist(),
            fit.residuals.tolist(),
            strict=True,
        )
    ]
    ids = [i for lst in informative["trial_ids"] for i in lst]
    row.update(
        slope=fit.slope,
        stderr=fit.stderr,
        ci_low=fit.ci_low,
        ci_high=fit.ci_high,
        dof=fit.dof,
        n_shapes=fit.n_points,
        n_levels=fit.n_levels,
        max_shift_log2=float((hi - lo).max()),
        total_shift_log2=float(y_all.max() - y_all.min()),
        verdict=_verdict(fit, tolerance),
        reliable=bool(fit.dof > 0 and not unreliable),
        warnings=notes,
        inputs=inputs,
        residuals=fit.residuals.tolist(),
        trial_ids=ids,
    )
    return row, levels


def transfer_drift(
    data: pd.DataFrame | OptimalLRResult,
    *,
    ci: float = 0.95,
    tolerance: float = 0.1,
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
    slopes = with_none(slopes, ["reason", "verdict"])
    by_level = with_none(by_level, ["level"])
    return TransferResult(slopes, by_level, reason, warnings, tolerance, ci)
