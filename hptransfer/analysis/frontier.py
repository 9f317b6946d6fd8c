"""Compute-efficient frontier of loss vs training FLOPs per arm, with a power-law fit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from hptransfer.jsonsafe import frame_records

from .errors import NotEnoughData
from .noise import ONE_SEED, log_noise_floor
from .optimal_lr import OptimalLRResult, as_optimal
from .powerlaw import PARAM_NAMES, PowerLawFit, fit_power_law
from .powerlaw_shared import fit_power_laws_shared_e
from .serialize import analysis_dict, with_none
from .trials import Trials


def frontier_mask(
    compute: np.ndarray, loss: np.ndarray, groups: np.ndarray | None = None
) -> np.ndarray:
    """True for points with a lower loss than every cheaper point of the same group."""
    compute = np.asarray(compute, dtype=float)
    loss = np.asarray(loss, dtype=float)
    g = np.zeros(len(compute), dtype=int) if groups is None else pd.factorize(groups)[0]
    order = np.lexsort((loss, compute, g))
    g_s, l_s = g[order], loss[order]
    running = pd.Series(l_s).groupby(g_s).cummin().to_numpy()
    first = np.r_[True, g_s[1:] != g_s[:-1]]
    before = np.where(first, np.inf, np.r_[np.inf, running[:-1]])
    mask = np.empty(len(order), dtype=bool)
    mask[order] = l_s < before
    return mask


@dataclass
class FrontierResult:
    """Per-arm power-law fits on the frontier; `points` holds every shape's best point."""

    points: pd.DataFrame
    fits: dict[str, PowerLawFit]
    reasons: dict[str, NotEnoughData] = field(default_factory=dict)
    reason: NotEnoughData | None = None
    warnings: list[str] = field(default_factory=list)
    # shapes without a completed run, left out (also in `warnings`)
    left_out: list[str] = field(default_factory=list)

    @property
    def reliable(self) -> bool:
        return self.reason is None and all(f.reliable for f in self.fits.values())

    def to_frame(self) -> pd.DataFrame:
        rows = []
        for arm in sorted(set(self.fits) | set(self.reasons)):
            fit = self.fits.get(arm)
            pts = self.points[self.points["arm"] == arm]
            row: dict[str, Any] = {
                "arm": arm,
                "n_points": len(pts),
                "n_frontier": int(pts["on_frontier"].sum()),
            }
            if fit is not None and fit.ok:
                lo, hi = fit.loss_range
                clo, chi = fit.compute_range
                row.update(E=fit.E, A=fit.A, b=fit.b)
                for name in PARAM_NAMES:
                    ci = fit.ci.get(name, (np.nan, np.nan))
                    row[f"{name}_ci_low"], row[f"{name}_ci_high"] = ci
                row.update(loss_min=lo, loss_max=hi, compute_min=clo, compute_max=chi,
                           seed_noise_log=fit.seed_noise)
                row.update(fit.status_row())
            else:
                reason = self.reasons.get(arm) or (fit.reason if fit is not None else None)
                row.update(
                    reliable=False,
                    reason=str(reason) if reason else None,
                    warnings=list(fit.warnings) if fit is not None else [],
                )
            rows.append(row)
        columns = [
            "arm",
            "n_points",
            "n_frontier",
            *PARAM_NAMES,
            *(f"{k}_ci_{s}" for k in PARAM_NAMES for s in ("low", "high")),
            "loss_min",
            "loss_max",
            "compute_min",
            "compute_max",
            "seed_noise_log",
            "reliable",
            "reason",
            "warnings",
        ]
        return with_none(pd.DataFrame(rows, columns=columns), ["reason"])

    def to_dict(self) -> dict[str, Any]:
        return analysis_dict(
            "frontier",
            self,
            fits={arm: fit.to_dict() for arm, fit in self.fits.items()},
            reasons=self.reasons,
            points=frame_records(self.points),
        )


def loss_compute_frontier(
    data: pd.DataFrame | Trials | OptimalLRResult,
    *,
    bootstrap: int = 200,
    seed: int | None = 0,
    ci: float = 0.95,
    f_scale: float = 0.01,
    shared_asymptote: bool = False,
) -> FrontierResult:
    """Per arm: each shape at its best LR gives (flops, loss); fit L(C) on the frontier.

    `shared_asymptote`: fit all arms jointly with one irreducible loss E (per-arm A, b; see
    `powerlaw_shared`), for arms trained and scored on the same data and tokenizer.

    The bootstrap draws at least the loss noise measured between seeds at the points
    (pooled per arm, or over all arms with a shared E; `noise.log_noise_floor`); with one
    seed per point that noise is not measured, and no fit is `reliable`."""
    opt = as_optimal(data, needs=("flops",))
    warnings = list(opt.warnings)
    best = opt.best_points()
    point_keys = [k for k in opt.keys if k != "sigma_base"]
    left_out = _shapes_left_out(opt.shapes, best, point_keys)
    warnings += left_out
    points = best[[*point_keys, "sigma_base", "best_lr", "flops", "best_loss", "best_trial_ids"]]
    points = points.rename(columns={"best_loss": "loss", "best_trial_ids": "trial_ids"})
    flops = points["flops"].to_numpy(dtype=float)
    has_flops = np.isfinite(flops) & (flops > 0)
    fits: dict[str, PowerLawFit] = {}
    reasons: dict[str, NotEnoughData] = {}
    for arm in sorted(opt.shapes["arm"].unique().tolist()):
        if not has_flops[points["arm"].to_numpy() == arm].any():
            reasons[arm] = NotEnoughData(
                f"the loss-vs-compute fit of arm {arm}",
                "no shape has a completed run with a recorded flops value",
            )
    points = points[has_flops].reset_index(drop=True)
    points["on_frontier"] = frontier_mask(
        points["flops"].to_numpy(), points["loss"].to_numpy(), points["arm"].to_numpy()
    )
    points["residual_log"] = np.nan
    noise = _seed_noise(best[has_flops], shared_asymptote)
    fronts = {str(arm): pts[pts["on_frontier"]]
              for arm, pts in points.groupby("arm", sort=True)}
    if shared_asymptote:
        fits.update(fit_power_laws_shared_e(
            {arm: (f["flops"].to_numpy(), f["loss"].to_numpy()) for arm, f in fronts.items()},
            bootstrap=bootstrap, seed=seed, ci=ci, f_scale=f_scale,
            trial_ids={arm: f["trial_ids"].tolist() for arm, f in fronts.items()},
            seed_noise=noise.get("", float("nan")),
        ))
    else:
        for i, (arm, front) in enumerate(fronts.items()):
            fits[arm] = fit_power_law(
                front["flops"].to_numpy(),
                front["loss"].to_numpy(),
                bootstrap=bootstrap,
                seed=None if seed is None else seed + i,
                ci=ci,
                f_scale=f_scale,
                trial_ids=front["trial_ids"].tolist(),
                what=f"the loss-vs-compute fit of arm {arm}",
                seed_noise=noise.get(arm, float("nan")),
            )
    for arm, front in fronts.items():
        if fits[arm].ok:
            points.loc[front.index, "residual_log"] = fits[arm].residuals
            if not np.isfinite(fits[arm].seed_noise):
                fits[arm].reliable = False
                fits[arm].warnings.append(ONE_SEED)
        else:
            reasons[arm] = fits[arm].reason  # type: ignore[assignment]
    reason = None
    if opt.reason is not None and points.empty:
        reason = NotEnoughData("the loss-vs-compute frontier", opt.reason.because)
    elif not any(f.ok for f in fits.values()):
        because = "; ".join(r.message for r in reasons.values()) or "no shape has a best point"
        reason = NotEnoughData("the loss-vs-compute frontier", because)
    return FrontierResult(points, fits, reasons, reason, warnings, left_out)


def _seed_noise(best: pd.DataFrame, shared: bool) -> dict[str, float]:
    """The points' loss noise between seeds on the log scale, per arm (key "": all arms,
    for a fit with one E); NaN where no point has 2 seeds."""
    def floor(rows: pd.DataFrame) -> float:
        return log_noise_floor(rows["noise_sd"].to_numpy(dtype=float),
                               rows["noise_dof"].to_numpy(dtype=float),
                               rows["n_seeds"].to_numpy(dtype=float),
                               rows["best_loss"].to_numpy(dtype=float))[0]

    if shared:
        return {"": floor(best)}
    return {str(arm): floor(rows) for arm, rows in best.groupby("arm", sort=True)}


def _shapes_left_out(shapes: pd.DataFrame, best: pd.DataFrame, keys: list[str]) -> list[str]:
    """A warning per shape with no completed run (all diverged or failed): the frontier
    leaves it out, and where a ladder shape diverged at an arm's transferred LR, that arm's
    frontier (and its savings) rest on the shapes it could train."""
    if shapes.empty:
        return []
    have = set(best[keys].itertuples(index=False, name=None))
    out = []
    for key, grp in shapes.groupby(keys, sort=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        if key in have:
            continue
        where = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in zip(keys, key, strict=True))
        diverged = int(grp["n_diverged"].sum()) if "n_diverged" in grp else 0
        out.append(f"{where}: no completed run ({diverged} diverged); left out of the "
                   "loss-vs-compute frontier")
    return out
