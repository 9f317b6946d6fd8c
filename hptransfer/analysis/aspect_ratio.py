"""Compute-optimal aspect ratio N:L (width over depth) at roughly fixed non-embedding params.

Following the CompleteP paper: for models of about equal size, loss (at the best LR) against
log(N/L) is fitted by a cubic; its minimum inside the tested range is the optimal N:L, and the
range whose predicted loss is within 1 % of that minimum says how flat the optimum is. A result
is `reliable` with 5+ aspect ratios, its minimum inside the range, its band ending inside it,
and a CI: the optimum refitted on the losses redrawn with the noise measured between seeds
(or the cubic's residual noise where that is larger). One seed per shape measures no seed
noise: no CI, not reliable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from hptransfer.contracts.sizes import MIN_ASPECT_RATIOS, SIZE_TOLERANCE, group_by_size
from hptransfer.jsonsafe import frame_records

from .errors import NotEnoughData
from .noise import ONE_SEED, pooled_sd
from .optimal_lr import OptimalLRResult, as_optimal
from .serialize import analysis_dict, with_none
from .stats import percentile_ci, snap_runs
from .trials import Trials

_BAND_GRID = 4001


@dataclass
class CubicOptimum:
    """Minimum of a cubic fit of loss against x = log(N/L) within the observed x range."""

    coefficients: np.ndarray
    x_center: float
    x_opt: float
    loss_opt: float
    x_low: float
    x_high: float
    edge: str | None
    band_clipped: bool
    residuals: np.ndarray


def fit_cubic_optimum(x: np.ndarray, loss: np.ndarray, within: float = 0.01) -> CubicOptimum:
    """Fit a cubic, take its argmin inside [min x, max x] and the band within `within`."""
    x = np.asarray(x, dtype=float)
    loss = np.asarray(loss, dtype=float)
    center = float(x.mean())
    coef = np.polyfit(x - center, loss, 3)
    lo, hi = float(x.min()), float(x.max())
    # The minimum inside a closed range is at an end or at a real critical point inside it.
    roots = np.roots(np.polyder(coef))
    real = roots[np.abs(roots.imag) < 1e-12].real + center
    candidates = np.r_[lo, hi, real[(real > lo) & (real < hi)]]
    values = np.polyval(coef, candidates - center)
    k = int(np.argmin(values))
    x_opt, loss_opt = float(candidates[k]), float(values[k])
    edge = "low" if k == 0 else "high" if k == 1 else None
    grid = np.linspace(lo, hi, _BAND_GRID)
    inside = np.polyval(coef, grid - center) <= loss_opt * (1.0 + within) + 1e-15
    # Keep the connected stretch of the band that contains the optimum.
    j = int(np.clip(np.searchsorted(grid, x_opt), 0, len(grid) - 1))
    out_left = np.flatnonzero(~inside[:j])
    out_right = np.flatnonzero(~inside[j:])
    left = int(out_left[-1]) + 1 if out_left.size else 0
    right = j + int(out_right[0]) - 1 if out_right.size else len(grid) - 1
    right = max(right, left)
    clipped = left == 0 or right == len(grid) - 1
    resid = loss - np.polyval(coef, x - center)
    return CubicOptimum(
        coef, center, x_opt, loss_opt, float(grid[left]), float(grid[right]), edge, clipped, resid
    )


@dataclass
class AspectRatioResult:
    """One row per (arm, size group) in `groups`; `points` lists every shape used."""

    groups: pd.DataFrame
    points: pd.DataFrame
    reason: NotEnoughData | None = None
    warnings: list[str] = field(default_factory=list)
    tolerance: float = SIZE_TOLERANCE
    within: float = 0.01
    ci_level: float = 0.95
    set_aside: list[str] = field(default_factory=list)  # shapes at another budget (warnings)

    @property
    def reliable(self) -> bool:
        return self.reason is None and bool(self.groups["reliable"].all())

    def to_frame(self) -> pd.DataFrame:
        return self.groups.copy()

    def to_dict(self) -> dict[str, Any]:
        return analysis_dict(
            "aspect_ratio",
            self,
            size_tolerance=self.tolerance,
            within=self.within,
            ci_level=self.ci_level,
            groups=frame_records(self.groups),
        )


_GROUP_COLUMNS = [
    "arm",
    "group",
    "params_median",
    "params_min",
    "params_max",
    "n_points",
    "nl_opt",
    "log_nl_opt",
    "loss_opt",
    "nl_within_low",
    "nl_within_high",
    "nl_ci_low",
    "nl_ci_high",
    "noise_sd",
    "edge",
    "reliable",
    "reason",
    "warnings",
    "coefficients",
    "residuals",
    "inputs",
]


_INPUT_FIELDS = ("width", "depth", "aspect", "params", "loss", "trial_ids")


def optimum_ci(x: np.ndarray, loss: np.ndarray, fit: CubicOptimum, n_seeds: np.ndarray,
               seed_sd: float, seed_dof: float, bootstrap: int, seed: int | None, ci: float,
               ) -> tuple[float, float, float]:
    """CI of the optimum's log N:L: the cubic refitted on the fitted losses plus Gaussian
    noise of sd max(seed_sd / sqrt(n_i), the residuals' scale), seed_sd redrawn from its
    scaled inverse chi² (`seed_dof` degrees of freedom) in each refit so its own
    uncertainty widens the interval as a t would; the optimum (inside the tested range)
    taken each time. Returns (low, high, noise sd used); NaN without a seed noise (one
    seed) or without resamples."""
    if not (np.isfinite(seed_sd) and seed_dof >= 1) or bootstrap <= 0:
        return float("nan"), float("nan"), float("nan")
    n = len(x)
    resid_var = float(np.sum(fit.residuals**2) / (n - 4)) if n > 4 else 0.0
    fitted = loss - fit.residuals
    rng = np.random.default_rng(seed)
    scale = np.sqrt(seed_dof / rng.chisquare(seed_dof, size=bootstrap))
    seed_var = (seed_sd * scale[:, None]) ** 2 / np.maximum(n_seeds, 1)[None, :]
    sd = np.sqrt(np.maximum(seed_var, resid_var))
    draws = fitted[None, :] + sd * rng.standard_normal((bootstrap, n))
    opts = np.array([fit_cubic_optimum(x, y, 0.0).x_opt for y in draws])
    lo, hi = percentile_ci(opts, ci)
    return float(lo), float(hi), float(np.sqrt(max(seed_sd**2 / np.median(n_seeds),
                                                     resid_var)))


def _group_row(arm: str, gid: int, pts: dict[str, np.ndarray], within: float,
               bootstrap: int = 0, seed: int | None = 0, ci: float = 0.95) -> dict[str, Any]:
    params = pts["params"].astype(float)
    row: dict[str, Any] = {
        "arm": arm,
        "group": gid,
        "params_median": float(np.median(params)),
        "params_min": float(params.min()),
        "params_max": float(params.max()),
        "n_points": len(params),
        "reliable": False,
        "reason": None,
        "warnings": [],
        "inputs": [
            dict(zip(_INPUT_FIELDS, values, strict=True))
            for values in zip(*(pts[f].tolist() for f in _INPUT_FIELDS), strict=True)
        ],
    }
    n_ratios = int(np.unique(np.round(pts["log_aspect"], 9)).size)
    if n_ratios < MIN_ASPECT_RATIOS:
        row["reason"] = NotEnoughData(
            f"the optimal N:L of arm {arm} at ~{row['params_median']:.3g} params",
            f"only {n_ratios} aspect ratios were run at this size (the cubic needs "
            f"{MIN_ASPECT_RATIOS})",
        ).message
        return row
    fit = fit_cubic_optimum(pts["log_aspect"], pts["loss"].astype(float), within)
    notes = []
    if fit.edge == "high" and int(pts["depth"][np.argmax(pts["log_aspect"])]) == 1:
        # no wider shape exists at this size: the advice to run one would be impossible
        notes.append(
            f"the optimum is at the widest shape tested (N:L={np.exp(fit.x_opt):.3g}), which "
            f"has depth 1: no wider shape exists at this size, so N:L >= "
            f"{np.exp(fit.x_low):.3g} is a bound, not a fitted optimum (a larger size may "
            "move the optimum inside the range)"
        )
    elif fit.edge is not None:
        side = "wider (larger N:L)" if fit.edge == "high" else "deeper (smaller N:L)"
        notes.append(
            f"the optimum is at the edge of the tested aspect ratios "
            f"(N:L={np.exp(fit.x_opt):.3g}): run {side} shapes"
        )
    if fit.band_clipped:
        # the headline quotes the band: one that runs into the grid's edge is a bound there,
        # not a measured band, so the result is not `reliable`
        notes.append(
            f"the within-{within:.0%} band reaches the tested range's edge, so the "
            "true band is wider: run shapes beyond it"
        )
    if n_ratios < 5:
        notes.append("4 aspect ratios for 4 cubic coefficients: the fit has no residual check")
    seed_sd, seed_dof = pooled_sd(pts["noise_sd"], pts["noise_dof"] + 1)
    lo, hi, noise = optimum_ci(pts["log_aspect"], pts["loss"].astype(float), fit,
                               pts["n_seeds"].astype(float), float(seed_sd), float(seed_dof),
                               bootstrap, seed, ci)
    if not np.isfinite(seed_sd):
        notes.append(ONE_SEED)
    elif bootstrap <= 0:
        notes.append("no CI of N:L: bootstrap is off")
    row.update(
        nl_ci_low=float(np.exp(lo)),
        nl_ci_high=float(np.exp(hi)),
        noise_sd=noise,
        nl_opt=float(np.exp(fit.x_opt)),
        log_nl_opt=fit.x_opt,
        loss_opt=fit.loss_opt,
        nl_within_low=float(np.exp(fit.x_low)),
        nl_within_high=float(np.exp(fit.x_high)),
        edge=fit.edge,
        reliable=(fit.edge is None and not fit.band_clipped and n_ratios >= 5
                  and bool(np.isfinite(lo) and np.isfinite(hi))),
        warnings=notes,
        coefficients=fit.coefficients.tolist(),
        residuals=fit.residuals.tolist(),
    )
    return row


def _one_budget_per_group(points: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """Within each (arm, size group), only the shapes at one budget (tokens per parameter,
    the one most shapes share; on a tie the smallest): a shape trained 4x longer has a lower
    loss at any N:L, so comparing across budgets moves N:L toward it. The rest are set aside,
    each group saying so."""
    tpp = points["tokens"].to_numpy(dtype=float) / points["params"].to_numpy(dtype=float)
    # budgets within 1 % of their neighbour are one (tokens are whole batches, so a budget is
    # rarely exact: trained to 20 tokens per parameter, shapes land anywhere in [20, 20.1])
    valid = np.isfinite(tpp) & (tpp > 0)
    group = points.groupby(["arm", "group"], sort=True).ngroup().to_numpy()
    by_tpp = snap_runs(np.log(tpp[valid]), group[valid], np.log(1.01))
    # a budget in steps or tokens trains every shape the same tokens, whose tokens per
    # parameter then differ as their sizes do (within the group's ±tolerance): one budget
    # too. Shapes share a budget where either matches, transitively.
    by_tokens = snap_runs(np.log(points["tokens"].to_numpy(dtype=float)[valid]),
                          group[valid], np.log(1.01))
    label = np.full(len(tpp), np.nan)
    label[valid] = _linked(group[valid], by_tpp, by_tokens)
    points = points.assign(budget=label, tpp=tpp)
    keep = np.ones(len(points), dtype=bool)
    notes = []
    for (arm, _), grp in points.groupby(["arm", "group"], sort=True):
        budgets = grp["budget"].dropna()
        if budgets.nunique() < 2:
            continue
        counts = budgets.value_counts()
        tied = counts.index[counts.to_numpy() == counts.max()]
        chosen = min(tied, key=lambda b: grp["tpp"][grp["budget"] == b].min())  # the smallest
        out = grp.index[grp["budget"].to_numpy() != chosen]
        keep[points.index.get_indexer(out)] = False
        shown = grp["tpp"][grp["budget"] == chosen].iloc[0]
        notes.append(
            f"arm {arm}, size ~{grp['params'].median():.3g} params: shapes at "
            f"{budgets.nunique()} token budgets; compared at {shown:.3g} tokens per parameter "
            f"only ({len(out)} set aside)")
    return points[keep].drop(columns=["budget", "tpp"]), notes


def _linked(*keys: np.ndarray) -> np.ndarray:
    """A label per row: rows equal in any of `keys` after the first (which every link must
    share too) get one label, transitively (union-find)."""
    n = len(keys[0])
    parent = list(range(n))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for key in keys[1:]:
        first: dict[tuple, int] = {}
        for i, k in enumerate(zip(keys[0], key, strict=True)):
            j = first.setdefault(k, i)
            parent[root(i)] = root(j)
    return np.array([root(i) for i in range(n)], dtype=float)


def optimal_aspect_ratio(
    data: pd.DataFrame | Trials | OptimalLRResult,
    *,
    tolerance: float = SIZE_TOLERANCE,
    within: float = 0.01,
    bootstrap: int = 200,
    seed: int | None = 0,
    ci: float = 0.95,
) -> AspectRatioResult:
    """Per arm and per size group (params within ±tolerance of the median): the optimal N:L,
    with its CI (`bootstrap` refits with the seed noise, `optimum_ci`; level `ci`)."""
    opt = as_optimal(data, needs=("params_non_embedding",))
    warnings = list(opt.warnings)
    best = opt.best_points()
    params = best["params_non_embedding"].to_numpy(dtype=float)
    best = best[np.isfinite(params) & (params > 0)]
    points = pd.DataFrame(
        {
            "arm": best["arm"].to_numpy(),
            "width": best["width"].to_numpy(),
            "depth": best["depth"].to_numpy(),
            "params": best["params_non_embedding"].to_numpy(),
            "loss": best["best_loss"].to_numpy(),
            "trial_ids": best["best_trial_ids"].to_numpy(),
            "tokens": best["tokens"].to_numpy(dtype=float),
            "noise_sd": best["noise_sd"].to_numpy(dtype=float),
            "noise_dof": best["noise_dof"].to_numpy(dtype=float),
            "n_seeds": best["n_seeds"].to_numpy(dtype=float),
        }
    )
    # Label size groups per arm (each budget of a shape is its own point until compared).
    group = np.zeros(len(points), dtype=int)
    arm_codes, _ = pd.factorize(points["arm"].to_numpy(), sort=True)
    for k in np.unique(arm_codes):
        idx = np.flatnonzero(arm_codes == k)
        group[idx] = group_by_size(points["params"].to_numpy()[idx], tolerance)
    points["group"] = group
    points, set_aside = _one_budget_per_group(points)
    warnings.extend(set_aside)
    # Other extra shape keys can repeat a (width, depth) at one budget: keep its best loss.
    points = points.sort_values("loss", kind="stable").drop_duplicates(["arm", "width", "depth"])
    points = points.reset_index(drop=True)
    points["aspect"] = points["width"].to_numpy(dtype=float) / points["depth"].to_numpy(float)
    points["log_aspect"] = np.log(points["aspect"].to_numpy(dtype=float))
    # Walk the (arm, group)-sorted points slice by slice.
    arm_codes, arm_names = pd.factorize(points["arm"].to_numpy(), sort=True)
    group = points["group"].to_numpy()
    order = np.lexsort((points["aspect"].to_numpy(), group, arm_codes))
    points = points.iloc[order].reset_index(drop=True)
    arrays = {c: points[c].to_numpy() for c in points.columns}
    key = np.stack([arm_codes[order], group[order]], axis=1)
    bounds = np.flatnonzero(np.r_[True, (key[1:] != key[:-1]).any(axis=1), True])
    if points.empty:
        bounds = bounds[:1]
    rows = []
    skipped = 0
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        if hi - lo < 2:
            skipped += 1
            continue
        sub = {c: v[lo:hi] for c, v in arrays.items()}
        rows.append(_group_row(str(sub["arm"][0]), int(sub["group"][0]), sub, within,
                               bootstrap, None if seed is None else seed + len(rows), ci))
    if skipped:
        warnings.append(f"{skipped} sizes had a single shape and were skipped")
    groups = pd.DataFrame(rows, columns=_GROUP_COLUMNS)
    groups["reliable"] = groups["reliable"].astype(bool)
    groups = with_none(groups, ["reason", "edge"])
    reason = None
    if groups.empty or groups["reason"].notna().all():
        because = (
            f"no arm has {MIN_ASPECT_RATIOS} or more aspect ratios at one size (within "
            f"±{tolerance:.0%} non-embedding params)"
        )
        if points.empty:
            because = "no shape has a completed run with a recorded params_non_embedding"
        reason = NotEnoughData("the compute-optimal N:L", because)
    return AspectRatioResult(groups, points, reason, warnings, tolerance, within, ci,
                             set_aside)
