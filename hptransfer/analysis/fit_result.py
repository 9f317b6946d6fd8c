"""The skeleton the curve fits (power law, Chinchilla) share: their status and uncertainty
fields, the cleaning of their input points and the bootstrap of their parameters."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import NotEnoughData
from .stats import percentile_ci

# An exponent whose bootstrap CI spans more than this factor is not determined by the data.
MAX_EXPONENT_CI_FACTOR = 3.0


def exponent_ci_problem(name: str, ci: dict[str, tuple[float, float]]) -> str | None:
    """Why an exponent's CI makes a fit unreliable (None when it does not): the same rule for
    the power law's b and Chinchilla's α and β."""
    if name in ci and ci[name][0] > 0 and ci[name][1] / ci[name][0] > MAX_EXPONENT_CI_FACTOR:
        return (f"the exponent {name}'s CI spans more than a factor "
                f"{MAX_EXPONENT_CI_FACTOR:g}")
    return None


# kw_only: these defaulted fields sit after each fit's own required, positional fields.
@dataclass(kw_only=True)
class FitResult:
    """What every fit carries besides its parameters; `reason` is set when no fit was possible."""

    trial_ids: list[list[str]] = field(default_factory=list)
    ci: dict[str, tuple[float, float]] = field(default_factory=dict)
    ci_level: float = 0.95
    reliable: bool = False
    warnings: list[str] = field(default_factory=list)
    reason: NotEnoughData | None = None

    @property
    def ok(self) -> bool:
        return self.reason is None

    def ci_dict(self) -> dict[str, Any]:
        """The `ci` and `ci_level` entries of `to_dict`."""
        return {"ci": {k: list(v) for k, v in self.ci.items()}, "ci_level": self.ci_level}

    def status_dict(self) -> dict[str, Any]:
        """The closing `reliable`, `warnings` and `reason` entries of `to_dict`."""
        return {"reliable": self.reliable, "warnings": self.warnings, "reason": self.reason}

    def status_row(self) -> dict[str, Any]:
        """The `reliable`, `reason` and `warnings` cells of a `to_frame` row."""
        return {
            "reliable": self.reliable,
            "reason": str(self.reason) if self.reason else None,
            "warnings": list(self.warnings),
        }


def usable_points(
    columns: Sequence[Sequence[float] | np.ndarray],
    trial_ids: Sequence[Sequence[str]] | None,
) -> tuple[list[np.ndarray], list[list[str]], list[str]]:
    """The points whose every column is finite and positive: (columns, trial ids, warnings)."""
    arrays = [np.asarray(c, dtype=float) for c in columns]
    ids = [list(t) for t in trial_ids] if trial_ids is not None else [[] for _ in arrays[0]]
    good = np.ones(arrays[0].shape, dtype=bool)
    for a in arrays:
        good &= np.isfinite(a) & (a > 0)
    warnings: list[str] = []
    if not good.all():
        warnings.append(f"ignored {int((~good).sum())} points with missing/non-positive values")
    ids = [t for t, g in zip(ids, good, strict=True) if g]
    return [a[good] for a in arrays], ids, warnings


# Modified residuals divide by sqrt(1 - h); a point the fit passes through (h -> 1) has a
# residual of ~0 whose inflation would be noise, so h is capped here (at most a factor 10).
MAX_LEVERAGE = 0.99


def hat_values(jac: np.ndarray, active_mask: np.ndarray | None = None) -> np.ndarray:
    """Diagonal of the hat matrix J (J^T J)^+ J^T of a least-squares fit linearised at its
    solution: how much each point's fitted value follows its own response. Parameters held at
    a bound (`active_mask` != 0, as `least_squares` reports it) are not free, so their columns
    are left out."""
    j = np.asarray(jac, dtype=float)
    if active_mask is not None:
        j = j[:, np.asarray(active_mask) == 0]
    if j.size == 0:
        return np.zeros(j.shape[0])
    u, s, _ = np.linalg.svd(j, full_matrices=False)
    rank = s > s.max() * max(j.shape) * np.finfo(float).eps
    return np.clip((u[:, rank] ** 2).sum(axis=1), 0.0, 1.0)


def fit_leverage(result: Any) -> np.ndarray:
    """`hat_values` of a scipy `least_squares` result. Its `jac` is documented as the
    Jacobian whose J^T J is the Gauss-Newton Hessian of the (robust) cost, so it already
    carries the robust loss's weights: a down-weighted point gets little leverage. Those
    weights follow the residuals, which biases the modified residuals' scale a little (alone,
    they narrowed the shared-E savings CI); `studentize` divides that bias out (s / s*, both
    computed alike), and unweighted hat values measured the same coverage with it."""
    return hat_values(result.jac, getattr(result, "active_mask", None))


def modified_residuals(
    residuals: np.ndarray, n_params: int, leverage: np.ndarray | None = None
) -> np.ndarray:
    """The residuals `residual_bootstrap` draws from, put back on the scale of the noise.

    Fitting p parameters shrinks residual i to a variance of sigma^2 (1 - h_i): with the hat
    values `leverage`, each is divided by sqrt(1 - h_i) (Davison & Hinkley 1997, alg. 6.3),
    so the points that pin the curve's ends (h ~ 0.8 with 7 points and 3 parameters), whose
    residuals the fit shrank most, get theirs back; without them, all are multiplied by the
    average sqrt(n / (n - p)). Then centred on their median (the fits are robust)."""
    r = np.asarray(residuals, dtype=float)
    if leverage is not None:
        r = r / np.sqrt(1.0 - np.minimum(np.asarray(leverage, dtype=float), MAX_LEVERAGE))
    elif r.size > n_params:
        r = r * np.sqrt(r.size / (r.size - n_params))
    return r - np.median(r)


def residual_scale(
    residuals: np.ndarray, n_params: int, leverage: np.ndarray | None = None
) -> float:
    """Root mean square of `modified_residuals`: the noise scale a fit's residuals estimate,
    and the scale of the noise `residual_bootstrap` redraws from them."""
    return float(np.sqrt(np.mean(modified_residuals(residuals, n_params, leverage) ** 2)))


def residual_bootstrap(
    fitted: np.ndarray, residuals: np.ndarray, n_params: int, n_resamples: int,
    seed: int | None, refit: Callable[[np.ndarray], np.ndarray],
    leverage: np.ndarray | None = None, pool: np.ndarray | None = None, floor: float = 0.0,
) -> np.ndarray:
    """`refit` (responses -> parameters, NaN when it failed) on `n_resamples` redraws of the
    responses, fitted + resampled residuals; shape (n_resamples, n_params).

    `floor`: the noise measured between seeds at the points (`noise.log_noise_floor`): when
    the residuals' root mean square is below it, they are scaled up to it (a curve of a few
    points can pass closer to them than the seeds' spread says another run would land).

    A study's shapes and budgets are chosen, not sampled, so this keeps them and redraws only
    the noise (the residual bootstrap for a fixed design). Resampling the points instead
    also resamples the design: with 6-8 points per arm, a draw that misses the largest shapes
    or repeats one point far off the curve refits the exponent on much less information, and
    the CI mostly measures which points were drawn. The residuals drawn are
    `modified_residuals` (pass the fit's hat values as `leverage`); with `pool` (a mask) only
    those residuals are drawn from, still one per point (see `drawn_residuals`). Calibration
    against known laws is tested in tests/test_bootstrap.py."""
    if n_resamples <= 0:
        return np.empty((0, n_params))
    r = drawn_residuals(residuals, n_params, leverage, pool)
    rms = float(np.sqrt(np.mean(r**2))) if r.size else 0.0
    if floor > rms:
        r = r * (floor / rms) if rms > 0 else np.array([-floor, floor])
    rng = np.random.default_rng(seed)
    draws = rng.choice(r, size=(n_resamples, np.size(fitted)))
    return np.array([refit(fitted + d) for d in draws]).reshape(-1, n_params)


def drawn_residuals(
    residuals: np.ndarray, n_params: int, leverage: np.ndarray | None = None,
    pool: np.ndarray | None = None,
) -> np.ndarray:
    """The `modified_residuals` `residual_bootstrap` draws from: of the points in `pool` only,
    when it names at least two (all points otherwise).

    A fit with a near-L1 loss (Chinchilla's Huber, δ = 1e-3 against noise of 1-2 %) passes
    through about one point per parameter: their residuals are ~0 by construction, not noise.
    Drawn along with the others they put a lump of mass at 0 (a third of the draws with 15
    points and 5 parameters) and the refits follow the estimate too closely: the Chinchilla
    CIs covered 0.85 at a nominal 95 %, studentized or not. Drawn only from the residuals
    outside the loss's quadratic zone (`pool`), which measure the noise: 0.94
    (tests/test_bootstrap.py). Pass `leverage` with `pool`: without it the global factor of
    `modified_residuals` would count the pool, not the fit's points."""
    r = np.asarray(residuals, dtype=float)
    h = None if leverage is None else np.asarray(leverage, dtype=float)
    if pool is not None and np.count_nonzero(pool) >= 2:
        keep = np.asarray(pool, dtype=bool)
        r, h = r[keep], None if h is None else h[keep]
    return modified_residuals(r, n_params, h)


def studentized_bootstrap(
    fitted: np.ndarray, residuals: np.ndarray, n_params: int, n_resamples: int,
    seed: int | None, solve: Callable[[np.ndarray], Any],
    params: Callable[[Any], np.ndarray], leverage: np.ndarray, pool: np.ndarray | None = None,
    floor: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """`residual_bootstrap` of a scipy `least_squares` fit whose refits are to be studentized:
    (refit parameters, shape (n_resamples, n_params); `student_ratios` of the refits).
    `solve` refits the redrawn responses, `params` reads a result's parameters; each refit's
    own noise scale comes from its residuals (`fun`, model - data: the sign does not matter)
    and its own hat values, as the fit's from `residuals` and `leverage` (all points: `pool`
    only limits the residuals drawn, see `residual_bootstrap`). With a seed-noise `floor`,
    the fit's and each refit's scale are at least the floor: where the seeds' noise
    dominates, it is known from many degrees of freedom and the refits are not widened by
    their few residuals' own uncertainty."""
    def refit(y_star: np.ndarray) -> np.ndarray:
        r = solve(y_star)
        if not r.success:
            return np.full(n_params + 1, np.nan)
        return np.r_[params(r), residual_scale(r.fun, n_params, fit_leverage(r))]

    out = residual_bootstrap(fitted, residuals, n_params + 1, n_resamples, seed, refit,
                             leverage=leverage, pool=pool, floor=floor)
    scale = max(residual_scale(residuals, n_params, leverage), floor)
    return out[:, :n_params], student_ratios(scale, np.maximum(out[:, n_params], floor))


def student_ratios(scale: float, refit_scales: np.ndarray) -> np.ndarray:
    """scale / s* for each refit's own `residual_scale` s*, the factor `studentize` applies.
    A refit with no residual spread cannot be studentized: NaN (skipped by the percentiles,
    like a failed refit), unless the fit has none either (exact data: factor 1)."""
    s_star = np.asarray(refit_scales, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(s_star > 0, scale / s_star, np.nan if scale > 0 else 1.0)


def studentize(estimate: Any, refits: np.ndarray, ratios: np.ndarray) -> np.ndarray:
    """estimate + (refit - estimate) * ratio: refits of one quantity, studentized (bootstrap-t),
    so their percentiles give estimate + s * quantiles of (refit - estimate) / s*. `ratios`
    (`student_ratios`) broadcasts against `refits` (one per refit, along the first axis).

    Plain refits treat the noise scale as known: a fit's error is sigma * Z, but its interval
    has only the scale its few residuals estimate, so the percentile interval is a z-interval
    where a t-interval with n - p degrees of freedom is due (7 points and 3 parameters per arm:
    measured 0.87-0.89 for b's 95 % CI, 0.92 for the savings'). Each refit also estimates its
    own noise scale s* from its residuals, so (refit - estimate) / s* carries that uncertainty
    as (estimate - truth) / s does (Davison & Hinkley 1997, sections 5.2.1 and 6.3). Apply it
    to each quantity of interest on a scale where it is near linear in the noise (a log
    compute, a log exponent), not to a nonlinear fit's parameter vector: scaling a step along
    a curved ridge (E and b trade off) leaves the ridge. An infinite refit (a loss never
    reached) stays infinite."""
    est = np.asarray(estimate, dtype=float)
    with np.errstate(invalid="ignore"):
        return est + (np.asarray(refits, dtype=float) - est) * ratios


def studentized_log_cis(
    estimates: dict[str, float], refits: dict[str, np.ndarray], ratios: np.ndarray, level: float
) -> dict[str, tuple[float, float]]:
    """`named_cis` of positive quantities from their refits, each studentized (`studentize`,
    with `student_ratios`) on its log scale, where a refit's error is near linear in the
    noise; the CIs of the power law's E, A, b and of Chinchilla's E, A, B, α, β."""
    with np.errstate(divide="ignore", invalid="ignore"):
        samples = {name: np.exp(studentize(np.log(estimates[name]), np.log(values), ratios))
                   for name, values in refits.items()}
    return named_cis(samples, level)


def named_cis(samples: dict[str, np.ndarray], level: float) -> dict[str, tuple[float, float]]:
    """Percentile interval of each named parameter's bootstrap samples (none without samples)."""
    out: dict[str, tuple[float, float]] = {}
    for name, values in samples.items():
        if len(values):
            lo, hi = percentile_ci(values, level)
            out[name] = (float(lo), float(hi))
    return out
