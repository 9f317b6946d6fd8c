"""Robust fit of loss against compute, L(C) = E + A * C^(-b), and its inverse C(L)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import least_squares

from hptransfer.jsonsafe import json_safe

from .errors import NotEnoughData
from .fit_result import (
    FitResult,
    exponent_ci_problem,
    fit_leverage,
    studentize,
    studentized_bootstrap,
    studentized_log_cis,
    usable_points,
)
from .stats import single_threaded

# Parameters are p = (log E, log A', log b) with A' = A * C0^(-b): logs keep E, A, b positive
# and C0 (the geometric mean of the compute) keeps A' of order one for the optimiser.
_N_E_PROFILE = 48
_LOG_B_BOUNDS = (np.log(1e-4), np.log(5.0))
_LOG_E_RANGE = 20.0  # E is searched in [min loss * e^-20, min loss]
# "E at its lower bound": an asymptote under 0.1 % of the lowest observed loss cannot be told
# from 0 by the data (where in [e^-20, 1e-3] x min loss the optimiser stops is noise), so any
# such fit is flagged, whichever value it stopped at. The upper side: E within 0.1 % of the
# lowest loss means the curve has not bent.
E_ZERO_FRACTION = 1e-3
# b at its bound: within 10 % of either end of [1e-4, 5].
_B_BOUND_TOLERANCE = np.log(1.1)


PARAM_NAMES = ("E", "A", "b")


@dataclass
class PowerLawFit(FitResult):
    """L(C) = E + A * C^(-b) fitted on (compute, loss) points; None-like NaNs if no fit."""

    E: float
    A: float
    b: float
    c_scale: float
    compute: np.ndarray
    loss: np.ndarray
    residuals: np.ndarray
    boot_params: np.ndarray = field(default_factory=lambda: np.empty((0, 3)), kw_only=True)
    # scale / s* of each refit (`fit_result.student_ratios`): the savings' refits are
    # studentized with it; empty (a fit built by hand): the refits are used as they are
    boot_ratio: np.ndarray = field(default_factory=lambda: np.empty(0), kw_only=True)
    # the arms fitted jointly with this one under one E (see powerlaw_shared); empty if alone
    shared_asymptote: list[str] = field(default_factory=list, kw_only=True)
    # the loss noise between seeds the bootstrap drew at least (log scale, `noise.py`); NaN:
    # not measured (one seed per point), 0: not given (a fit of bare arrays)
    seed_noise: float = field(default=0.0, kw_only=True)

    @property
    def loss_range(self) -> tuple[float, float]:
        if self.loss.size == 0:
            return (float("nan"), float("nan"))
        return (float(self.loss.min()), float(self.loss.max()))

    @property
    def compute_range(self) -> tuple[float, float]:
        if self.compute.size == 0:
            return (float("nan"), float("nan"))
        return (float(self.compute.min()), float(self.compute.max()))

    def predict(self, compute: float | Sequence[float] | np.ndarray) -> np.ndarray:
        c = np.asarray(compute, dtype=float)
        return self.E + self.A * c ** (-self.b)

    def compute_for_loss(self, loss: float | Sequence[float] | np.ndarray) -> np.ndarray:
        """Inverse of the fit; NaN where the loss is at or below the asymptote E."""
        return _invert(
            np.asarray(loss, dtype=float),
            self.E,
            self.A * self.c_scale**-self.b,
            self.b,
            self.c_scale,
        )

    def boot_compute_for_loss(self, loss: np.ndarray) -> np.ndarray:
        """Inverse under each bootstrap refit; shape (n_boot, len(loss)). +inf where a
        refit's asymptote lies at or above the loss (it never reaches it: the compute is
        unbounded, and ranks as such in a percentile); NaN only for a failed refit. With
        `boot_ratio`, studentized (`fit_result.studentize`) on the log compute."""
        p = self.boot_params
        if p.size == 0:
            return np.empty((0, np.size(loss)))
        loss = np.asarray(loss, dtype=float)[None, :]
        compute = _invert(loss, p[:, :1], p[:, 1:2], p[:, 2:3], self.c_scale)
        unreachable = np.isfinite(p).all(axis=1, keepdims=True) & (loss <= p[:, :1])
        compute = np.where(unreachable, np.inf, compute)
        if len(self.boot_ratio) != len(p):
            return compute
        # studentized on the log compute, where a refit's error is near linear in the noise
        log_hat = np.log(self.compute_for_loss(loss[0]))
        with np.errstate(divide="ignore", invalid="ignore"):
            stud = np.exp(studentize(log_hat, np.log(compute), self.boot_ratio[:, None]))
        return np.where(np.isfinite(log_hat), stud, compute)

    def to_dict(self) -> dict[str, Any]:
        return json_safe(
            {
                "E": self.E,
                "A": self.A,
                "b": self.b,
                **self.ci_dict(),
                "n_points": int(self.compute.size),
                "loss_range": list(self.loss_range),
                "compute_range": list(self.compute_range),
                "inputs": [
                    {"compute": c, "loss": v, "residual_log": r, "trial_ids": ids}
                    for c, v, r, ids in zip(
                        self.compute,
                        self.loss,
                        self.residuals,
                        self.trial_ids or [[] for _ in self.compute],
                        strict=True,
                    )
                ],
                "n_bootstrap": int(len(self.boot_params)),
                "shared_asymptote": list(self.shared_asymptote),
                "seed_noise_log": self.seed_noise,
                **self.status_dict(),
            }
        )


def studentized_cis(
    E: float, A: float, b: float, boot: np.ndarray, c_scale: float, ratios: np.ndarray,
    ci: float,
) -> dict[str, tuple[float, float]]:
    """CIs of E, A and b from refits (columns E, A' = A * c_scale^-b, b), each studentized
    (`fit_result.studentize`) on its own log scale."""
    a_orig = boot[:, 1] * c_scale ** boot[:, 2]
    return studentized_log_cis(
        {"E": E, "A": A, "b": b}, {"E": boot[:, 0], "A": a_orig, "b": boot[:, 2]}, ratios, ci)


def _floor(seed_noise: float) -> float:
    """The bootstrap's noise floor: the seed noise where measured, else none."""
    return seed_noise if np.isfinite(seed_noise) and seed_noise > 0 else 0.0


def _invert(loss: np.ndarray, e: Any, a_scaled: Any, b: Any, c_scale: float) -> np.ndarray:
    with np.errstate(all="ignore"):
        excess = loss - e
        c = c_scale * (excess / a_scaled) ** (-1.0 / b)
    return np.where(excess > 0, c, np.nan)


def _model(p: np.ndarray, x: np.ndarray) -> np.ndarray:
    return np.logaddexp(p[0], p[1] - np.exp(p[2]) * x)


def _solve(x: np.ndarray, y: np.ndarray, p0: np.ndarray, bounds: tuple, f_scale: float) -> Any:
    def residual(p: np.ndarray) -> np.ndarray:
        return _model(p, x) - y

    def jac(p: np.ndarray) -> np.ndarray:
        f = _model(p, x)
        b = np.exp(p[2])
        w_e = np.exp(p[0] - f)
        w_a = np.exp(p[1] - b * x - f)
        return np.column_stack([w_e, w_a, -w_a * x * b])

    p0 = np.clip(p0, bounds[0] + 1e-9, bounds[1] - 1e-9)
    return least_squares(
        residual,
        p0,
        jac=jac,
        bounds=bounds,
        loss="soft_l1",
        f_scale=f_scale,
        x_scale="jac",
        max_nfev=2000,
    )


def profile_over_e(
    x: np.ndarray, logy: np.ndarray, e: np.ndarray, f_scale: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each asymptote in `e` the model is linear in log space, log(L - E) = log A' - b*x:
    its OLS (log A', b) and robust cost, all E at once. Seeds the nonlinear fits."""
    z = np.log(np.exp(logy)[None, :] - e[:, None])
    xc = x - x.mean()
    b = np.clip(-((z - z.mean(axis=1, keepdims=True)) @ xc) / (xc @ xc), 1e-4, 5.0)
    a = z.mean(axis=1) + b * x.mean()
    r = np.logaddexp(np.log(e)[:, None], a[:, None] - b[:, None] * x[None, :]) - logy[None, :]
    cost = np.sum(np.sqrt(1.0 + (r / f_scale) ** 2) - 1.0, axis=1)
    return a, b, cost


def e_profile_grid(y_min: float) -> np.ndarray:
    """The asymptotes a profile tries: from 0.1 % to 99.9 % below the lowest loss."""
    return y_min * (1.0 - np.geomspace(1e-3, 0.999, _N_E_PROFILE))


def _starts(x: np.ndarray, logy: np.ndarray, f_scale: float, keep: int = 2) -> list[np.ndarray]:
    """Best starting points: the E values of the profile with the lowest robust cost."""
    e = e_profile_grid(float(np.exp(logy.min())))
    a, b, cost = profile_over_e(x, logy, e, f_scale)
    return [np.array([np.log(e[i]), a[i], np.log(b[i])]) for i in np.argsort(cost)[:keep]]


def _nan_fit(
    compute: np.ndarray,
    loss: np.ndarray,
    ids: list[list[str]],
    reason: NotEnoughData,
    warnings: list[str],
) -> PowerLawFit:
    nan = float("nan")
    return PowerLawFit(
        nan,
        nan,
        nan,
        nan,
        compute,
        loss,
        np.full(loss.shape, np.nan),
        trial_ids=ids,
        reliable=False,
        warnings=warnings,
        reason=reason,
    )


def e_at_zero_problem(E: float, min_loss: float) -> str | None:
    """Why an asymptote E is not identified (None when it is): the same rule for the power
    law and Chinchilla, whatever value under E_ZERO_FRACTION the optimiser stopped at."""
    if E < E_ZERO_FRACTION * min_loss:
        return (f"E is driven to 0 (E={E:.3g}, under {E_ZERO_FRACTION:.1%} of the lowest "
                "loss): the irreducible loss is not identified by this data")
    return None


def bound_problems(E: float, b: float, min_loss: float) -> list[str]:
    """Why a fit's E or b sits at (or too near) its bound: the same rule for every arm."""
    out = []
    at_zero = e_at_zero_problem(E, min_loss)
    if at_zero:
        out.append(at_zero)
    if E >= (1.0 - E_ZERO_FRACTION) * min_loss:
        out.append("E reached the lowest observed loss: the curve has not bent yet")
    log_b = np.log(b)
    if (log_b <= _LOG_B_BOUNDS[0] + _B_BOUND_TOLERANCE
            or log_b >= _LOG_B_BOUNDS[1] - _B_BOUND_TOLERANCE):
        out.append(f"the exponent b={b:.3g} sits at its bound")
    return out


def fit_problems(
    c: np.ndarray, y: np.ndarray, E: float, b: float, ci_map: dict[str, tuple[float, float]]
) -> list[str]:
    """Why one arm's L(C) fit is not `reliable` (empty when it is): the same rules for a fit
    of its own and for an arm of a fit with a shared asymptote."""
    problems: list[str] = []
    n = len(c)
    if n < 5:
        problems.append(f"only {n} points for 3 parameters: the fit is barely determined")
    span = np.log10(c.max() / c.min())
    if span < 1.0:
        problems.append(f"compute spans only {span:.2f} decades; E and b trade off")
    problems += bound_problems(E, b, float(y.min()))
    wide = exponent_ci_problem("b", ci_map)
    if wide:
        problems.append(wide)
    return problems


@single_threaded
def fit_power_law(
    compute: Sequence[float] | np.ndarray,
    loss: Sequence[float] | np.ndarray,
    *,
    bootstrap: int = 200,
    seed: int | None = 0,
    ci: float = 0.95,
    f_scale: float = 0.01,
    trial_ids: Sequence[Sequence[str]] | None = None,
    what: str = "the loss-vs-compute fit",
    seed_noise: float = 0.0,
) -> PowerLawFit:
    """Fit L = E + A*C^(-b) with a soft-L1 loss on log residuals from a grid of starts.

    `f_scale` is the log-residual size (about a relative error) beyond which points count
    linearly, so a few bad runs do not drag the fit. The CI refits `bootstrap` residual
    resamples (`fit_result.residual_bootstrap`), studentized (`fit_result.studentize`),
    drawing at least `seed_noise` (the points' loss noise between seeds, on the log scale).
    """
    (c, y), ids, warnings = usable_points((compute, loss), trial_ids)
    if np.unique(c).size < 3:
        because = f"it needs 3 distinct compute values and has {np.unique(c).size}"
        return _nan_fit(c, y, ids, NotEnoughData(what, because), warnings)

    c_scale = float(np.exp(np.mean(np.log(c))))
    x = np.log(c / c_scale)
    logy = np.log(y)
    e_hi = np.log(y.min())
    bounds = (
        np.array([e_hi - _LOG_E_RANGE, -50.0, _LOG_B_BOUNDS[0]]),
        np.array([e_hi, 50.0, _LOG_B_BOUNDS[1]]),
    )
    best = min(
        (_solve(x, logy, p0, bounds, f_scale) for p0 in _starts(x, logy, f_scale)),
        key=lambda r: r.cost,
    )
    p = best.x
    E, a_scaled, b = float(np.exp(p[0])), float(np.exp(p[1])), float(np.exp(p[2]))
    A = a_scaled * c_scale**b
    residuals = logy - _model(p, x)

    boot, ratios = studentized_bootstrap(
        logy - residuals, residuals, 3, bootstrap, seed,
        lambda logy_star: _solve(x, logy_star, p, bounds, f_scale), lambda r: np.exp(r.x),
        fit_leverage(best), floor=_floor(seed_noise))
    ci_map = studentized_cis(E, A, b, boot, c_scale, ratios, ci)

    problems = fit_problems(c, y, E, b, ci_map)
    return PowerLawFit(
        E,
        A,
        b,
        c_scale,
        c,
        y,
        residuals,
        trial_ids=ids,
        ci=ci_map,
        ci_level=ci,
        reliable=not problems,
        warnings=warnings + problems,
        boot_params=boot,
        boot_ratio=ratios,
        seed_noise=seed_noise,
    )
