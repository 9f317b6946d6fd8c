"""Seed noise: the spread of the loss between seeds of one point, and what it lets a fit claim.

A point (shape, LR) trained at S seeds gives S losses; their sample variance, pooled over the
points of a fit, is the loss noise another seed (or another host's kernels) would add. From it:

- η*'s CI (`vertex_ci`): the parabola's vertex -c1 / 2c2 is a ratio of two coefficients
  linear in the mean losses, so its exact interval under Gaussian noise is Fieller's (the
  vertices v whose c1 + 2 c2 v is within t·SE of 0), t with the pooled noise's degrees of
  freedom. It is unbounded when the curvature is within the noise (a flat bracket).
- whether the bracket is informative (`bracket_rise`): the losses on each side of the best
  LR must rise above it by more than the noise of that difference.
- both from the noise of the bracket's LRs paired by seed (`paired_sd`) where every LR of
  the bracket ran the same seeds: a seed fixes the init and the data order at every LR, so
  it moves a shape's whole curve up or down together, which moves neither the vertex nor a
  rise; only what is left after that shift is the vertex's noise.
- a floor for the compute fits' residual bootstraps (`log_noise_floor`): the frontier, the
  savings and N:L draw at least the measured seed noise, not only one curve's residuals.

One seed per point measures no noise: no CI, and a number without a CI is not reliable.
"""

from __future__ import annotations

import numpy as np

# the t distribution's inverse CDF from scipy.special: scipy.stats costs 0.65 s to import,
# paid by every process that imports the analysis (the coordinator's, each CLI call's)
from scipy.special import stdtrit

# the widest η* CI that counts as reliable, by default (the spec's analysis.eta_ci_log2)
from hptransfer.contracts.reliability import ETA_CI_LOG2  # noqa: F401  (re-exported)


def pooled_sd(std: np.ndarray, n: np.ndarray, mask: np.ndarray | None = None,
              axis: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """Pooled within-point standard deviation over `axis` (sample stds `std` of `n` seeds
    each; points with fewer than 2 seeds, or outside `mask`, add nothing) and its degrees of
    freedom sum(n - 1). NaN where no point has 2 seeds."""
    n = np.asarray(n, dtype=float)
    dof_i = np.where(n >= 2, n - 1.0, 0.0)
    if mask is not None:
        dof_i = np.where(mask, dof_i, 0.0)
    var = np.where(dof_i > 0, np.nan_to_num(np.asarray(std, dtype=float)) ** 2, 0.0)
    dof = dof_i.sum(axis=axis)
    with np.errstate(invalid="ignore", divide="ignore"):
        sd = np.sqrt((dof_i * var).sum(axis=axis) / dof)
    return np.where(dof > 0, sd, np.nan), dof


def paired_sd(loss: np.ndarray, col: np.ndarray, seed: np.ndarray, group: np.ndarray,
              n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Per group (a shape's bracket): the noise of its LRs when they all ran the same seeds
    (each run: its loss, its LR's column `col`, its `seed` and its `group`): the residual
    standard deviation of the additive model loss = LR effect + seed effect, from the
    LR x seed table's interaction, and its degrees of freedom (L - 1)(S - 1). (NaN, 0) for a
    group unless every LR has each seed exactly once, with L >= 2 LRs and S >= 2 seeds: the
    caller then pools the seeds' spread per LR (`pooled_sd`), which holds whatever the seeds
    share."""
    group = np.asarray(group, dtype=np.int64)
    if group.size == 0:
        return np.full(n_groups, np.nan), np.zeros(n_groups)
    _, cell = np.unique(np.stack([group, np.asarray(col, dtype=float)]), axis=1,
                        return_inverse=True)
    _, block = np.unique(np.stack([group, np.asarray(seed, dtype=float)]), axis=1,
                         return_inverse=True)
    cell, block = cell.ravel(), block.ravel()

    def distinct(index: np.ndarray) -> np.ndarray:  # per group, how many values it holds
        return np.bincount(group[np.unique(index, axis=-1, return_index=True)[1]],
                           minlength=n_groups)

    n_runs = np.bincount(group, minlength=n_groups)
    n_l, n_s = distinct(cell), distinct(block)
    # every (LR, seed) pair once: no seed missing at an LR, none run twice
    table = ((distinct(np.stack([cell, block])) == n_runs) & (n_runs == n_l * n_s)
             & (n_l >= 2) & (n_s >= 2))
    loss = np.asarray(loss, dtype=float)

    def mean_by(index: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return (np.bincount(index, weights=loss) / np.bincount(index))[index]

    resid = loss - mean_by(cell) - mean_by(block) + mean_by(group)
    dof = np.where(table, (n_l - 1.0) * (n_s - 1.0), 0.0)
    ss = np.bincount(group, weights=resid**2, minlength=n_groups)
    with np.errstate(invalid="ignore", divide="ignore"):
        sd = np.where(table, np.sqrt(ss / dof), np.nan)
    return sd, dof


def t_quantile(ci: float, dof: np.ndarray) -> np.ndarray:
    """Two-sided t quantile for level `ci` (NaN where dof < 1)."""
    dof = np.asarray(dof, dtype=float)
    return np.where(dof >= 1, stdtrit(np.maximum(dof, 1.0), 0.5 + ci / 2.0), np.nan)


def coefficient_cov(dx: np.ndarray, window: np.ndarray, var: np.ndarray) -> np.ndarray:
    """Covariance of the OLS coefficients (c0, c1, c2) of a quadratic in dx fitted on the
    `window` points of each row, when point i's response has variance var[i] (its mean of
    n_i seeds: s²/n_i): (X'X)^-1 X' diag(var) X (X'X)^-1. Shape (rows, 3, 3)."""
    w = window.astype(float)
    X = np.stack([w, w * dx, w * dx**2], axis=-1)  # (rows, cols, 3), zero outside the window
    M = np.einsum("rci,rcj->rij", X, X)
    B = np.einsum("rci,rc,rcj->rij", X, np.where(window, var, 0.0), X)
    singular = np.abs(np.linalg.det(M)) < 1e-300
    M[singular] = np.eye(3)
    inv = np.linalg.inv(M)
    cov = inv @ B @ inv
    cov[singular] = np.nan
    return cov


def vertex_ci(c1: np.ndarray, c2: np.ndarray, cov: np.ndarray, t: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray]:
    """Fieller's interval for v = -c1 / (2 c2): the v with (c1 + 2 c2 v)² <= t² Var(c1 + 2 c2 v).
    (low, high) relative to the fit's centre; (-inf, inf) when c2 is not t·SE above 0 (the
    curvature is within the noise, so any vertex fits); NaN where t or cov is NaN."""
    v11, v12, v22 = cov[:, 1, 1], cov[:, 1, 2], cov[:, 2, 2]
    a = 4.0 * (c2**2 - t**2 * v22)
    b = 4.0 * (c1 * c2 - t**2 * v12)
    c = c1**2 - t**2 * v11
    with np.errstate(invalid="ignore", divide="ignore"):
        root = np.sqrt(np.maximum(b**2 - 4.0 * a * c, 0.0))
        lo = (-b - root) / (2.0 * a)
        hi = (-b + root) / (2.0 * a)
    bounded = a > 0
    lo = np.where(bounded, lo, -np.inf)
    hi = np.where(bounded, hi, np.inf)
    unknown = ~np.isfinite(t) | ~np.isfinite(v11) | ~np.isfinite(v22) | ~np.isfinite(c2)
    return np.where(unknown, np.nan, lo), np.where(unknown, np.nan, hi)


def bracket_rise(x: np.ndarray, means: np.ndarray, n_ok: np.ndarray, window: np.ndarray,
                 best: np.ndarray, sd: np.ndarray, t: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: how far the window's losses rise above the best LR's on its lower side
    and on its upper side (the highest mean on each side minus the best's), the smaller of
    the two rises, the noise that rise must exceed (t·sd·sqrt(1/n_best + 1/n_side), of that
    side) and whether both sides rise by more than their noise. A side with no LR has no
    rise (-inf)."""
    rows = np.arange(len(x))
    x_best = x[rows, best][:, None]
    y_best = means[rows, best][:, None]
    n_best = n_ok[rows, best][:, None]
    rise = np.full(len(x), np.inf)
    noise = np.full(len(x), np.nan)
    ok = np.ones(len(x), dtype=bool)
    for side in (x < x_best, x > x_best):
        inside = window & side & np.isfinite(means)
        up = np.where(inside, means - y_best, -np.inf)
        col = np.argmax(up, axis=1)
        r = up[rows, col]
        with np.errstate(invalid="ignore", divide="ignore"):
            thr = t * sd * np.sqrt(1.0 / n_best[:, 0] + 1.0 / np.maximum(n_ok[rows, col], 1))
        ok &= r > thr
        smaller = r < rise
        noise = np.where(smaller, thr, noise)
        rise = np.where(smaller, r, rise)
    return rise, noise, ok & np.isfinite(noise)


def log_noise_floor(sd: np.ndarray, dof: np.ndarray, n: np.ndarray, loss: np.ndarray
                    ) -> tuple[float, int]:
    """The seed noise of a fit's points on the log-loss scale the compute fits work on:
    the noise pooled over the points (each `sd` with `dof` degrees of freedom), divided by
    sqrt(n) seeds and the loss at each point, as a root mean square; and its degrees of
    freedom. (NaN, 0) when no point has 2 seeds."""
    sd, dof = np.asarray(sd, dtype=float), np.asarray(dof, dtype=float)
    good = np.isfinite(sd) & (dof > 0)
    total = float(dof[good].sum())
    if total <= 0:
        return float("nan"), 0
    pooled = float(np.sqrt(np.sum(dof[good] * sd[good] ** 2) / total))
    n, loss = np.asarray(n, dtype=float), np.asarray(loss, dtype=float)
    use = np.isfinite(loss) & (loss > 0) & (n >= 1)
    if not use.any():
        return float("nan"), 0
    per_point = pooled / (np.sqrt(n[use]) * loss[use])
    return float(np.sqrt(np.mean(per_point**2))), int(total)


ONE_SEED = ("one seed per point: the loss noise between seeds is not measured, so there is "
            "no CI that holds it; run 2+ seeds")
