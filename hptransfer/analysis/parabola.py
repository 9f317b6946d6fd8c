"""The η* fit: a quadratic in log2(lr) around the best LR of a loss-vs-LR curve.

`fit_parabolas` fits many curves at once (one per row of padded matrices, as `optimal_lr`
and its bootstrap need); `fit_lr_parabola` fits one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .basins import rival_basins
from .errors import AnalysisError


@dataclass
class ParabolaFits:
    """Quadratic fits y = yb + c0 + c1*dx + c2*dx^2 with dx = x - x_best, one per row."""

    best: np.ndarray
    has_data: np.ndarray
    fit_ok: np.ndarray
    n_fit: np.ndarray
    window: np.ndarray
    x_best: np.ndarray
    y_best: np.ndarray
    coef: np.ndarray
    log2_opt: np.ndarray
    loss_opt: np.ndarray
    concave: np.ndarray
    clamped: np.ndarray
    residuals: np.ndarray


def fit_parabolas(x: np.ndarray, y: np.ndarray, neighbours: int) -> ParabolaFits:
    """Fit every row of (x, y) at once; x is sorted per row, NaN y marks a missing point."""
    valid = np.isfinite(y)
    has_data = valid.any(axis=1)
    best = np.argmin(np.where(valid, y, np.inf), axis=1)
    rows = np.arange(len(y))
    # Neighbours are counted among LRs that have a loss, so a diverged LR in between is skipped.
    rank = np.cumsum(valid, axis=1) - 1
    distance = np.abs(rank - rank[rows, best][:, None])
    window = valid & (distance <= neighbours)
    # With neighbours=1 a best LR at the edge has one neighbour: take the next one too, so
    # the quadratic has its 3 points (neighbours >= 2 always has them when 3 LRs have data).
    short = (window.sum(axis=1) < 3)[:, None]
    window |= short & valid & (distance <= neighbours + 1)
    n_fit = window.sum(axis=1)
    x_best, y_best = x[rows, best], y[rows, best]
    # Centring on the best point keeps the 3x3 normal equations well conditioned.
    dx = np.where(window, x - x_best[:, None], 0.0)
    dy = np.where(window, y - y_best[:, None], 0.0)
    w = window.astype(float)
    s = [np.sum(w * dx**k, axis=1) for k in range(5)]
    t = [np.sum(w * dx**k * dy, axis=1) for k in range(3)]
    normal = np.stack(
        [
            np.stack([s[0], s[1], s[2]], -1),
            np.stack([s[1], s[2], s[3]], -1),
            np.stack([s[2], s[3], s[4]], -1),
        ],
        axis=1,
    )
    rhs = np.stack(t, axis=-1)
    # a quadratic needs 3 distinct LRs (x sorted per row: equal ones are neighbours)
    repeats = (np.diff(np.sort(np.where(window, x, np.nan), axis=1), axis=1) == 0).sum(axis=1)
    fit_ok = has_data & (n_fit - repeats >= 3)
    normal[~fit_ok] = np.eye(3)
    rhs[~fit_ok] = 0.0
    coef = np.linalg.solve(normal, rhs[..., None])[..., 0]
    c0, c1, c2 = coef[:, 0], coef[:, 1], coef[:, 2]

    concave = fit_ok & ~(c2 > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        vertex = np.where(concave | ~fit_ok, 0.0, -c1 / (2.0 * c2))
    lo = np.where(window, dx, np.inf).min(axis=1)
    hi = np.where(window, dx, -np.inf).max(axis=1)
    # A vertex outside the fitted points is an extrapolation: keep it inside and flag it.
    clamped = fit_ok & ~concave & ((vertex < lo - 1e-12) | (vertex > hi + 1e-12))
    vertex = np.where(clamped, np.clip(vertex, lo, hi), vertex)
    log2_opt = np.where(fit_ok, x_best + vertex, np.nan)
    loss_opt = np.where(fit_ok, y_best + c0 + c1 * vertex + c2 * vertex**2, np.nan)
    fitted = c0[:, None] + c1[:, None] * dx + c2[:, None] * dx**2
    residuals = np.where(window & fit_ok[:, None], dy - fitted, np.nan)
    return ParabolaFits(
        best=best,
        has_data=has_data,
        fit_ok=fit_ok,
        n_fit=n_fit,
        window=window,
        x_best=x_best,
        y_best=y_best,
        coef=coef,
        log2_opt=log2_opt,
        loss_opt=loss_opt,
        concave=concave,
        clamped=clamped,
        residuals=residuals,
    )


def fit_lr_parabola(
    lrs: Sequence[float] | np.ndarray, losses: Sequence[float] | np.ndarray, neighbours: int = 2
) -> dict[str, Any]:
    """Fit one LR curve (mean loss per LR; NaN = diverged). Returns η*, flags and coefficients,
    and `rival_lr`, the lowest rival basin's LR (basins.py; NaN when none), which makes η* a
    guess as `optimal_lr` says. Raises AnalysisError for LRs that are not positive and
    finite (no log2)."""
    lr = np.asarray(lrs, dtype=float)
    y = np.asarray(losses, dtype=float)
    if lr.shape != y.shape or lr.ndim != 1:
        raise AnalysisError(f"lrs and losses must be two lists of one length, got shapes "
                            f"{lr.shape} and {y.shape}")
    bad = lr[~(np.isfinite(lr) & (lr > 0))]
    if bad.size:
        raise AnalysisError(f"every lr must be positive and finite, got {bad[:5].tolist()}")
    values, counts = np.unique(lr, return_counts=True)
    if (counts > 1).any():
        raise AnalysisError(f"each lr once, with its mean loss: lr {values[counts > 1][0]:g} "
                            f"appears {counts.max()} times")
    x = np.log2(lr)
    order = np.argsort(x)
    fits = fit_parabolas(x[order][None, :], y[order][None, :], neighbours)
    rivals = rival_basins(x[order], y[order])
    return {
        "lr_opt": float(2.0 ** fits.log2_opt[0]),
        "log2_lr_opt": float(fits.log2_opt[0]),
        "loss_opt": float(fits.loss_opt[0]),
        "best_lr": float(2.0 ** fits.x_best[0]) if fits.has_data[0] else float("nan"),
        "fit_ok": bool(fits.fit_ok[0]),
        "concave": bool(fits.concave[0]),
        "clamped": bool(fits.clamped[0]),
        "n_fit_points": int(fits.n_fit[0]),
        "curvature": float(fits.coef[0, 2]),
        "rival_lr": float(lr[order][rivals[0]]) if rivals else float("nan"),
    }
