"""Chinchilla approach 3: L(N, D) = E + A/N^α + B/D^β and the compute-optimal allocation.

The fit minimises a Huber loss (δ = 1e-3) on log loss, with the model written in
log-sum-exp form over θ = (a=log A, b=log B, e=log E, α, β), by L-BFGS-B. The start grid is the
Chinchilla one; every grid point is scored in one vectorised pass and only the best few are
refined, which finds the same optimum as refining all of them at a fraction of the cost.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from scipy.optimize import minimize
from scipy.special import expit, logit

from hptransfer.jsonsafe import frame_records, json_safe

from .errors import NotEnoughData
from .fit_result import (
    FitResult,
    exponent_ci_problem,
    fit_leverage,
    named_cis,
    studentize,
    studentized_bootstrap,
    studentized_log_cis,
    usable_points,
)
from .optimal_lr import OptimalLRResult, as_optimal
from .powerlaw import e_at_zero_problem
from .serialize import analysis_dict, with_none
from .stats import single_threaded
from .trials import Trials

_GRID_A = np.arange(0.0, 26.0, 5.0)
_GRID_E = np.arange(-1.0, 1.01, 0.5)
_GRID_EXP = np.arange(0.0, 2.01, 0.5)
_EXP_BOUNDS = (1e-3, 4.0)
PARAM_NAMES = ("E", "A", "B", "alpha", "beta")
# what the fit derives from its parameters, each with its CI: the exponents of N_opt and D_opt
# in C, and N_opt, D_opt at the largest compute the fit saw (`ChinchillaFit.compute_max`)
DERIVED_NAMES = ("n_exponent", "d_exponent", "n_opt_at_max", "d_opt_at_max")


def compute_max(n: np.ndarray, d: np.ndarray) -> float:
    """The largest training compute 6·N·D among the fitted points."""
    return float(np.max(6.0 * np.asarray(n) * np.asarray(d)))


def derived_quantities(
    A: Any, B: Any, alpha: Any, beta: Any, c_max: float
) -> dict[str, np.ndarray]:
    """DERIVED_NAMES of one fit or, given arrays, of each bootstrap refit (`c_max`: the fit's
    `compute_max`)."""
    alpha, beta = np.asarray(alpha, dtype=float), np.asarray(beta, dtype=float)
    n_opt, d_opt = compute_optimal_allocation(c_max, A=A, B=B, alpha=alpha, beta=beta)
    n_exponent = beta / (alpha + beta)
    return {"n_exponent": n_exponent, "d_exponent": 1.0 - n_exponent,
            "n_opt_at_max": n_opt, "d_opt_at_max": d_opt}


def derived_cis(
    estimates: dict[str, Any], refits: dict[str, np.ndarray], ratios: np.ndarray, level: float,
    c_max: float,
) -> dict[str, tuple[float, float]]:
    """CIs of DERIVED_NAMES, studentized like the parameters' (`studentized_log_cis`): N_opt on
    its log scale, the N exponent on its logit scale (it lies in (0, 1)). D_opt is C/6 over
    N_opt and the D exponent 1 minus the N exponent, so their CIs are those intervals mapped
    the same way: each pair is one quantity, with one interval."""
    with np.errstate(divide="ignore", invalid="ignore"):
        on_logit = studentize(logit(estimates["n_exponent"]), logit(refits["n_exponent"]), ratios)
    cis = named_cis({"n_exponent": expit(on_logit)}, level)
    cis |= studentized_log_cis({"n_opt_at_max": estimates["n_opt_at_max"]},
                               {"n_opt_at_max": refits["n_opt_at_max"]}, ratios, level)
    lo, hi = cis["n_exponent"]
    cis["d_exponent"] = (1.0 - hi, 1.0 - lo)
    lo, hi = cis["n_opt_at_max"]
    cis["d_opt_at_max"] = (c_max / 6.0 / hi, c_max / 6.0 / lo)
    return cis


def compute_optimal_allocation(
    compute: float | Sequence[float] | np.ndarray,
    *,
    A: float,
    B: float,
    alpha: float,
    beta: float,
) -> tuple[np.ndarray, np.ndarray]:
    """N_opt, D_opt minimising E + A/N^α + B/D^β subject to C = 6·N·D.

    G = (αA/(βB))^(1/(α+β)), N_opt = G·(C/6)^(β/(α+β)), D_opt = (C/6)^(α/(α+β))/G.
    """
    c6 = np.asarray(compute, dtype=float) / 6.0
    s = alpha + beta
    log_g = (np.log(alpha * A) - np.log(beta * B)) / s
    # A refit with α or A near 0 puts the optimum past float's range: inf (or 0) is its
    # value there, and the CIs take it as such, so numpy's overflow warning is noise.
    with np.errstate(over="ignore", under="ignore"):
        n_opt = np.exp(log_g + beta / s * np.log(c6))
        d_opt = np.exp(alpha / s * np.log(c6) - log_g)
    return n_opt, d_opt


@dataclass
class ChinchillaFit(FitResult):
    """A fitted L(N, D); NaN parameters with a `reason` when no fit was possible."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float
    n: np.ndarray
    d: np.ndarray
    loss: np.ndarray
    residuals: np.ndarray
    objective: float = float("nan")
    # the bootstrap refits' (E, A, B, α, β), as refitted (not studentized)
    boot_params: np.ndarray = field(default_factory=lambda: np.empty((0, 5)), kw_only=True)
    # scale / s* of each refit (`fit_result.student_ratios`): the CIs studentize the refits
    # with it; a quantity derived from `boot_params` is studentized with it likewise
    boot_ratio: np.ndarray = field(default_factory=lambda: np.empty(0), kw_only=True)

    @property
    def G(self) -> float:
        s = self.alpha + self.beta
        return float(np.exp((np.log(self.alpha * self.A) - np.log(self.beta * self.B)) / s))

    @property
    def n_exponent(self) -> float:
        """N_opt ∝ C^n_exponent."""
        return float(self.derived()["n_exponent"])

    @property
    def d_exponent(self) -> float:
        """D_opt ∝ C^d_exponent."""
        return float(self.derived()["d_exponent"])

    @property
    def compute_max(self) -> float:
        return compute_max(self.n, self.d)

    def derived(self) -> dict[str, np.ndarray]:
        """DERIVED_NAMES of this fit (its CIs are in `ci`, as the parameters' are)."""
        return derived_quantities(self.A, self.B, self.alpha, self.beta, self.compute_max)

    def predict(self, n: Any, d: Any) -> np.ndarray:
        n = np.asarray(n, dtype=float)
        d = np.asarray(d, dtype=float)
        return self.E + self.A / n**self.alpha + self.B / d**self.beta

    def compute_optimal(self, compute: Any) -> tuple[np.ndarray, np.ndarray]:
        return compute_optimal_allocation(
            compute, A=self.A, B=self.B, alpha=self.alpha, beta=self.beta
        )

    def to_dict(self) -> dict[str, Any]:
        ids = self.trial_ids or [[] for _ in self.n]
        return json_safe(
            {
                **{k: getattr(self, k) for k in PARAM_NAMES},
                "G": self.G if self.ok else None,
                "n_exponent": self.n_exponent if self.ok else None,
                "d_exponent": self.d_exponent if self.ok else None,
                "objective": self.objective,
                **self.ci_dict(),
                "n_points": int(self.n.size),
                "inputs": [
                    {"params": a, "tokens": b, "loss": c, "residual_log": r, "trial_ids": t}
                    for a, b, c, r, t in zip(
                        self.n, self.d, self.loss, self.residuals, ids, strict=True
                    )
                ],
                "n_bootstrap": int(len(self.boot_params)),
                **self.status_dict(),
            }
        )


class _Objective:
    """Huber(δ) of log residuals, divided by δ² so L-BFGS-B sees values of order one.

    Works in centred coordinates a' = a - α·mean(log N), b' = b - β·mean(log D), which makes the
    Hessian far better conditioned than raw (a, α) with log N around 20.
    """

    def __init__(self, n: np.ndarray, d: np.ndarray, loss: np.ndarray, delta: float) -> None:
        self.n, self.d = n, d
        self.log_n, self.log_d = np.log(n), np.log(d)
        self.mean_n, self.mean_d = float(self.log_n.mean()), float(self.log_d.mean())
        self.u, self.v = self.log_n - self.mean_n, self.log_d - self.mean_d
        self.log_loss = np.log(loss)
        self.delta = delta

    def _lse_and_weights(self, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """log(E + A/N^α + B/D^β) per point, and each term's share, for θ' of shape (..., 5)."""
        a, b, e, al, be = (theta[..., i, None] for i in range(5))
        terms = np.stack(np.broadcast_arrays(a - al * self.u, b - be * self.v, e), axis=-2)
        # Hand-written log-sum-exp: scipy's is several times slower on these small arrays.
        top = terms.max(axis=-2, keepdims=True)
        ex = np.exp(terms - top)
        total = ex.sum(axis=-2, keepdims=True)
        return (top + np.log(total))[..., 0, :], ex / total

    def _huber(self, r: np.ndarray) -> np.ndarray:
        d = self.delta
        ar = np.abs(r)
        return np.where(ar <= d, 0.5 * r * r, d * (ar - 0.5 * d)).sum(axis=-1) / d**2

    def value(self, theta: np.ndarray) -> np.ndarray:
        lse, _ = self._lse_and_weights(theta)
        return self._huber(lse - self.log_loss)

    def residuals_and_jacobian(self, theta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The log residuals (model - data) at one θ' and their Jacobian in θ', shape (n, 5):
        the least-squares view of the fit that its leverage needs (L-BFGS-B gives none)."""
        lse, w = self._lse_and_weights(theta)
        w1, w2, w3 = w
        jac = np.column_stack([w1, w2, w3, -w1 * self.u, -w2 * self.v])
        return lse - self.log_loss, jac

    def value_and_grad(self, theta: np.ndarray) -> tuple[float, np.ndarray]:
        """Objective and gradient for one θ'; written out flat because L-BFGS-B calls it a lot."""
        a, b, e, al, be = theta
        t1 = a - al * self.u
        t2 = b - be * self.v
        top = np.maximum(np.maximum(t1, t2), e)
        e1, e2, e3 = np.exp(t1 - top), np.exp(t2 - top), np.exp(e - top)
        total = e1 + e2 + e3
        r = top + np.log(total) - self.log_loss
        psi = np.clip(r, -self.delta, self.delta) / (self.delta**2 * total)
        g1, g2 = psi * e1, psi * e2
        grad = np.array(
            [g1.sum(), g2.sum(), (psi * e3).sum(), -(g1 * self.u).sum(), -(g2 * self.v).sum()]
        )
        return float(self._huber(r)), grad

    def to_centred(self, a: Any, b: Any, e: Any, alpha: Any, beta: Any) -> np.ndarray:
        return np.stack(
            np.broadcast_arrays(a - alpha * self.mean_n, b - beta * self.mean_d, e, alpha, beta),
            axis=-1,
        ).astype(float)

    def from_centred(self, theta: np.ndarray) -> np.ndarray:
        """θ' -> (E, A, B, α, β)."""
        a, b, e, al, be = (theta[..., i] for i in range(5))
        return np.stack(
            [np.exp(e), np.exp(a + al * self.mean_n), np.exp(b + be * self.mean_d), al, be], axis=-1
        )


# Bounds on θ' = (a', b', e, α, β); exponents stay positive so the terms stay decreasing.
_BOUNDS = [(-60.0, 60.0), (-60.0, 60.0), (-10.0, 10.0), _EXP_BOUNDS, _EXP_BOUNDS]
_LO = np.array([b[0] for b in _BOUNDS])
_HI = np.array([b[1] for b in _BOUNDS])


@dataclass
class _LeastSquaresView:
    """An L-BFGS-B optimum as `fit_result.studentized_bootstrap` and `fit_leverage` read a
    scipy `least_squares` result: parameters (E, A, B, α, β), log residuals and their
    Jacobian, the parameters held at a bound."""

    x: np.ndarray
    fun: np.ndarray
    jac: np.ndarray
    active_mask: np.ndarray
    success: bool


def _least_squares_view(obj: _Objective, result: Any) -> _LeastSquaresView:
    """The Jacobian is the plain one of the log residuals, not weighted by the Huber loss:
    with δ = 1e-3 nearly every residual is in Huber's linear part, whose weights (δ/|r|)
    would follow the noise rather than the design."""
    theta = result.x
    fun, jac = obj.residuals_and_jacobian(theta)
    at_bound = (theta <= _LO) | (theta >= _HI)  # L-BFGS-B projects onto the bounds exactly
    # "ABNORMAL" line-search exits at machine precision still sit at the optimum.
    return _LeastSquaresView(obj.from_centred(theta), fun, jac, at_bound.astype(int),
                             bool(np.isfinite(result.fun)))


def _refine(obj: _Objective, theta0: np.ndarray) -> Any:
    return minimize(
        obj.value_and_grad,
        np.clip(theta0, _LO, _HI),
        jac=True,
        method="L-BFGS-B",
        bounds=_BOUNDS,
        options={"maxiter": 5000, "ftol": 1e-12, "gtol": 1e-10},
    )


def _nan_fit(n: np.ndarray, d: np.ndarray, loss: np.ndarray, ids: list[list[str]],
             reason: NotEnoughData, warnings: list[str]) -> ChinchillaFit:
    nan = float("nan")
    return ChinchillaFit(nan, nan, nan, nan, nan, n, d, loss, np.full(loss.shape, np.nan),
                         trial_ids=ids, warnings=warnings, reason=reason)


@single_threaded
def fit_chinchilla(
    n: Sequence[float] | np.ndarray,
    d: Sequence[float] | np.ndarray,
    loss: Sequence[float] | np.ndarray,
    *,
    delta: float = 1e-3,
    bootstrap: int = 0,
    seed: int | None = 0,
    ci: float = 0.95,
    top_k: int = 3,
    trial_ids: Sequence[Sequence[str]] | None = None,
    what: str = "the Chinchilla fit",
) -> ChinchillaFit:
    """Fit L(N, D) = E + A/N^α + B/D^β (N params, D tokens) by Huber on log loss.

    `top_k` grid starts with the lowest objective are refined by L-BFGS-B and the best kept.
    The CI refits `bootstrap` residual resamples, refining from the full-data optimum: the
    leverage-adjusted residuals of the points outside Huber's quadratic zone are redrawn
    (`fit_result.drawn_residuals`) and each refit is studentized by its own noise scale on
    the log of each parameter (`fit_result.studentized_bootstrap`, `studentized_log_cis`),
    as the power-law fits' are.
    """
    (n_arr, d_arr, y), ids, warnings = usable_points((n, d, loss), trial_ids)
    because = _cannot_fit(n_arr, d_arr, y)
    if because is not None:
        return _nan_fit(n_arr, d_arr, y, ids, NotEnoughData(what, because), warnings)

    obj = _Objective(n_arr, d_arr, y, delta)
    runs = _refined_starts(obj, top_k)
    best = min(runs, key=lambda r: r.fun)
    E, A, B, alpha, beta = (float(v) for v in obj.from_centred(best.x))
    fitted = np.log(E + A / n_arr**alpha + B / d_arr**beta)
    residuals = np.log(y) - fitted
    boot, ratios, ci_map = _bootstrap_cis(obj, best, (E, A, B, alpha, beta), fitted, residuals,
                                          bootstrap, seed, ci)
    problems = _fit_problems(n_arr, d_arr, y, E, alpha, beta, ci_map)
    agree = sum(r.fun <= best.fun * (1 + 1e-6) + 1e-12 for r in runs)
    if agree < 2 and len(runs) > 1:
        warnings.append("only one start reached the best objective; the optimum may be local")
    return ChinchillaFit(
        E, A, B, alpha, beta, n_arr, d_arr, y, residuals, float(best.fun), trial_ids=ids,
        ci=ci_map, ci_level=ci, reliable=not problems, warnings=warnings + problems,
        boot_params=boot, boot_ratio=ratios,
    )


def _cannot_fit(n: np.ndarray, d: np.ndarray, y: np.ndarray) -> str | None:
    """Why these points cannot fix the 5 parameters (None when they can)."""
    if len(y) < 6:
        return f"it has {len(y)} points and needs at least 6 for 5 parameters"
    if np.unique(n).size < 2 or np.unique(d).size < 2:
        return "it needs at least two model sizes and two token counts"
    if np.std(np.log(d / n)) < 0.05:
        return (
            "tokens per parameter is the same for every run (D ∝ N), so A/N^α and "
            "B/D^β cannot be told apart; run some sizes at other token budgets"
        )
    return None


def _refined_starts(obj: _Objective, top_k: int) -> list[Any]:
    """Score the whole start grid in one pass, then refine the `top_k` best starts."""
    grid = np.array(list(itertools.product(_GRID_A, _GRID_A, _GRID_E, _GRID_EXP, _GRID_EXP)))
    starts = obj.to_centred(grid[:, 0], grid[:, 1], grid[:, 2], grid[:, 3], grid[:, 4])
    scores = np.concatenate([obj.value(chunk) for chunk in np.array_split(starts, 10)])
    return [_refine(obj, starts[i]) for i in np.argsort(scores)[:top_k]]


def _bootstrap_cis(
    obj: _Objective, best: Any, params: tuple[float, ...], fitted: np.ndarray,
    residuals: np.ndarray, bootstrap: int, seed: int | None, ci: float,
) -> tuple[np.ndarray, np.ndarray, dict[str, tuple[float, float]]]:
    """The refits' parameters, their noise-scale ratios, and the CIs of the parameters and
    of DERIVED_NAMES (those only with refits). `params`: the fit's (E, A, B, alpha, beta)."""
    theta = best.x
    _, A, B, alpha, beta = params

    def solve(log_y_star: np.ndarray) -> _LeastSquaresView:
        sub = _Objective(obj.n, obj.d, np.exp(log_y_star), obj.delta)
        # same design, so the same centring: start at the full fit
        return _least_squares_view(sub, _refine(sub, theta))

    # the points in Huber's quadratic zone are the ones the near-L1 fit passes through: their
    # ~0 residuals are not drawn (fit_result.drawn_residuals)
    boot, ratios = studentized_bootstrap(
        fitted, residuals, 5, bootstrap, seed, solve, lambda r: r.x,
        fit_leverage(_least_squares_view(obj, best)), pool=np.abs(residuals) > obj.delta)
    ci_map = studentized_log_cis(
        dict(zip(PARAM_NAMES, params, strict=True)),
        {name: boot[:, k] for k, name in enumerate(PARAM_NAMES)}, ratios, ci)
    if len(boot):
        c_max = compute_max(obj.n, obj.d)
        ci_map |= derived_cis(derived_quantities(A, B, alpha, beta, c_max),
                              derived_quantities(*boot[:, 1:].T, c_max), ratios, ci, c_max)
    return boot, ratios, ci_map


def _fit_problems(
    n: np.ndarray, d: np.ndarray, y: np.ndarray, E: float, alpha: float, beta: float,
    ci_map: dict[str, tuple[float, float]],
) -> list[str]:
    """Why the fit is not reliable (empty when it is)."""
    problems: list[str] = []
    if len(y) < 10:
        problems.append(f"only {len(y)} points for 5 parameters")
    for name, arr in (("params", n), ("tokens", d)):
        span = np.log10(arr.max() / arr.min())
        if span < 1.0:
            problems.append(f"{name} span only {span:.2f} decades; exponents are poorly fixed")
    for name, value in (("alpha", alpha), ("beta", beta)):
        if value <= _EXP_BOUNDS[0] * 1.01 or value >= _EXP_BOUNDS[1] * 0.99:
            problems.append(f"{name}={value:.3g} sits at its bound")
        wide = exponent_ci_problem(name, ci_map)
        if wide:
            problems.append(wide)
    # the power law's rule (its bound, e^-10, included)
    at_zero = e_at_zero_problem(E, float(y.min()))
    if at_zero:
        problems.append(at_zero)
    return problems


@dataclass
class ChinchillaResult:
    """Per-arm Chinchilla fits."""

    fits: dict[str, ChinchillaFit]
    reason: NotEnoughData | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def reliable(self) -> bool:
        return self.reason is None and all(f.reliable for f in self.fits.values())

    def to_frame(self) -> pd.DataFrame:
        rows = []
        for arm, fit in sorted(self.fits.items()):
            row: dict[str, Any] = {"arm": arm, "n_points": int(fit.n.size)}
            if fit.ok:
                row.update({k: getattr(fit, k) for k in PARAM_NAMES})
                row.update({k: float(v) for k, v in fit.derived().items()},
                           G=fit.G, compute_max=fit.compute_max)
                for k in (*PARAM_NAMES, *DERIVED_NAMES):
                    row[f"{k}_ci_low"], row[f"{k}_ci_high"] = fit.ci.get(k, (np.nan, np.nan))
            row.update(fit.status_row())
            rows.append(row)
        columns = [
            "arm", "n_points", *PARAM_NAMES,
            *(f"{k}_ci_{s}" for k in PARAM_NAMES for s in ("low", "high")), "G", "compute_max",
            *(c for k in DERIVED_NAMES for c in (k, f"{k}_ci_low", f"{k}_ci_high")),
            "reliable", "reason", "warnings",
        ]
        return with_none(pd.DataFrame(rows, columns=columns), ["reason"])

    def to_dict(self) -> dict[str, Any]:
        return analysis_dict(
            "chinchilla",
            self,
            fits={arm: fit.to_dict() for arm, fit in self.fits.items()},
            table=frame_records(self.to_frame()),
        )


def chinchilla_fit(
    data: pd.DataFrame | Trials | OptimalLRResult,
    *,
    bootstrap: int = 0,
    seed: int | None = 0,
    ci: float = 0.95,
    delta: float = 1e-3,
) -> ChinchillaResult:
    """Per arm: fit L(N, D) on each shape's best point (N non-embedding params, D tokens)."""
    opt = as_optimal(data, needs=("params_non_embedding", "tokens"))
    warnings = list(opt.warnings)
    best = opt.best_points()
    fits: dict[str, ChinchillaFit] = {}
    for i, arm in enumerate(sorted(opt.shapes["arm"].unique().tolist())):
        pts = best[best["arm"] == arm]
        fits[str(arm)] = fit_chinchilla(
            pts["params_non_embedding"].to_numpy(),
            pts["tokens"].to_numpy(),
            pts["best_loss"].to_numpy(),
            delta=delta,
            bootstrap=bootstrap,
            seed=None if seed is None else seed + i,
            ci=ci,
            trial_ids=pts["best_trial_ids"].tolist(),
            what=f"the Chinchilla fit of arm {arm}",
        )
    reason = None
    if not any(f.ok for f in fits.values()):
        because = "; ".join(str(f.reason) for f in fits.values()) or "there are no trials"
        if opt.reason is not None and not fits:
            because = opt.reason.because
        reason = NotEnoughData("the Chinchilla fit", because)
    return ChinchillaResult(fits, reason, warnings)
