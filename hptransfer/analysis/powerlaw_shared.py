"""L_k(C) = E + A_k * C^(-b_k) fitted jointly over arms: one irreducible loss E, per-arm A, b.

Arms of one study train on the same corpus with the same tokenizer and are scored on the same
validation tokens, so the loss no model can go below (the data's entropy under that
tokenizer) is the same for all of them; only how fast each approaches it differs. Sharing E
removes the E-b trade-off that leaves a 3-parameter fit per arm undetermined over a few
decades of compute (E driven to 0, exponent CIs spanning a factor > 3). The bootstrap redraws
the residuals of all arms' points together and refits jointly, so the i-th refits of two arms
are one joint draw.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from scipy.optimize import least_squares

from .errors import NotEnoughData
from .fit_result import fit_leverage, studentized_bootstrap, usable_points
from .powerlaw import (
    _LOG_B_BOUNDS,
    _LOG_E_RANGE,
    PowerLawFit,
    _floor,
    _nan_fit,
    e_profile_grid,
    fit_problems,
    profile_over_e,
    studentized_cis,
)
from .stats import single_threaded

Points = tuple[Sequence[float] | np.ndarray, Sequence[float] | np.ndarray]


def _unpack(p: np.ndarray, k: int) -> tuple[float, np.ndarray, np.ndarray]:
    """(log E, log A'_k, b_k) from p = (log E, log A'_1, log b_1, ..., log A'_K, log b_K)."""
    return p[0], p[1::2][:k], np.exp(p[2::2][:k])


def _solve(xs: list[np.ndarray], ys: list[np.ndarray], p0: np.ndarray, bounds: tuple,
           f_scale: float) -> Any:
    k = len(xs)
    arm = np.concatenate([np.full(len(x), i) for i, x in enumerate(xs)])
    x = np.concatenate(xs)
    y = np.concatenate(ys)
    rows = np.arange(len(x))

    def model(p: np.ndarray) -> np.ndarray:
        e, a, b = _unpack(p, k)
        return np.logaddexp(e, a[arm] - b[arm] * x)

    def residual(p: np.ndarray) -> np.ndarray:
        return model(p) - y

    def jac(p: np.ndarray) -> np.ndarray:
        e, a, b = _unpack(p, k)
        f = model(p)
        w_a = np.exp(a[arm] - b[arm] * x - f)
        out = np.zeros((len(x), 1 + 2 * k))
        out[:, 0] = np.exp(e - f)
        out[rows, 1 + 2 * arm] = w_a
        out[rows, 2 + 2 * arm] = -w_a * x * b[arm]
        return out

    p0 = np.clip(p0, bounds[0] + 1e-9, bounds[1] - 1e-9)
    return least_squares(residual, p0, jac=jac, bounds=bounds, loss="soft_l1",
                         f_scale=f_scale, x_scale="jac", max_nfev=4000)


def _starts(xs: list[np.ndarray], ys: list[np.ndarray], f_scale: float,
            keep: int = 2) -> list[np.ndarray]:
    """The shared E values whose per-arm log-linear fits have the lowest total robust cost."""
    e = e_profile_grid(float(np.exp(min(y.min() for y in ys))))
    profiles = [profile_over_e(x, y, e, f_scale) for x, y in zip(xs, ys, strict=True)]
    cost = sum(prof[2] for prof in profiles)
    starts = []
    for i in np.argsort(cost)[:keep]:
        p = [np.log(e[i])]
        for a, b, _ in profiles:
            p += [a[i], np.log(b[i])]
        starts.append(np.array(p))
    return starts


@single_threaded
def fit_power_laws_shared_e(
    points: Mapping[str, Points],
    *,
    bootstrap: int = 200,
    seed: int | None = 0,
    ci: float = 0.95,
    f_scale: float = 0.01,
    trial_ids: Mapping[str, Sequence[Sequence[str]]] | None = None,
    what: str = "the loss-vs-compute fit of arm {arm}",
    seed_noise: float = 0.0,
) -> dict[str, PowerLawFit]:
    """One `PowerLawFit` per arm of `points` (arm -> (compute, loss)), all with the same E.

    Arms with fewer than 3 distinct compute values get no fit (a reason) and do not enter the
    joint fit. Each arm's `reliable` follows the same rules as `fit_power_law`'s
    (`fit_problems`), with that arm's points and its bootstrap CI of b. `seed_noise`: the
    points' loss noise between seeds (log scale), the least noise the bootstrap draws."""
    fits: dict[str, PowerLawFit] = {}
    clean: dict[str, tuple[np.ndarray, np.ndarray, list[list[str]], list[str]]] = {}
    for arm, (compute, loss) in points.items():
        ids_in = (trial_ids or {}).get(arm)
        (c, y), ids, warnings = usable_points((compute, loss), ids_in)
        if np.unique(c).size < 3:
            because = f"it needs 3 distinct compute values and has {np.unique(c).size}"
            fits[arm] = _nan_fit(c, y, ids, NotEnoughData(what.format(arm=arm), because),
                                 warnings)
        else:
            clean[arm] = (c, y, ids, warnings)
    if not clean:
        return fits
    arms = list(clean)
    k = len(arms)
    all_c = np.concatenate([clean[a][0] for a in arms])
    c_scale = float(np.exp(np.mean(np.log(all_c))))
    xs = [np.log(clean[a][0] / c_scale) for a in arms]
    ys = [np.log(clean[a][1]) for a in arms]
    e_hi = float(min(y.min() for y in ys))
    lo = np.r_[e_hi - _LOG_E_RANGE, np.tile([-50.0, _LOG_B_BOUNDS[0]], k)]
    hi = np.r_[e_hi, np.tile([50.0, _LOG_B_BOUNDS[1]], k)]
    bounds = (lo, hi)
    best = min((_solve(xs, ys, p0, bounds, f_scale) for p0 in _starts(xs, ys, f_scale)),
               key=lambda r: r.cost)
    p = best.x
    e, a, b = _unpack(p, k)

    # one residual bootstrap over all arms' points (one loss metric, one noise): the i-th
    # refits of two arms come from one joint redraw
    sizes = np.cumsum([len(x) for x in xs])[:-1]
    y_all = np.concatenate(ys)
    fitted = np.concatenate([np.logaddexp(e, a[i] - b[i] * x) for i, x in enumerate(xs)])

    # one joint refit, one noise scale: every arm's refit i is studentized by the same ratio
    boot, ratios = studentized_bootstrap(
        fitted, y_all - fitted, 1 + 2 * k, bootstrap, seed,
        lambda y_star: _solve(xs, np.split(y_star, sizes), p, bounds, f_scale),
        lambda r: r.x, fit_leverage(best), floor=_floor(seed_noise))
    arm_residuals = np.split(y_all - fitted, sizes)
    E = float(np.exp(e))
    for i, arm in enumerate(arms):
        c, y, ids, warnings = clean[arm]
        b_i, a_scaled = float(b[i]), float(np.exp(a[i]))
        residuals = arm_residuals[i]
        arm_boot = np.column_stack([np.exp(boot[:, 0]), np.exp(boot[:, 1 + 2 * i]),
                                    np.exp(boot[:, 2 + 2 * i])])
        A_i = a_scaled * c_scale**b_i
        ci_map = studentized_cis(E, A_i, b_i, arm_boot, c_scale, ratios, ci)
        problems = fit_problems(c, y, E, b_i, ci_map)
        fits[arm] = PowerLawFit(
            E, A_i, b_i, c_scale, c, y, residuals,
            trial_ids=ids, ci=ci_map, ci_level=ci, reliable=not problems,
            warnings=warnings + problems, boot_params=arm_boot, boot_ratio=ratios,
            shared_asymptote=arms, seed_noise=seed_noise,
        )
    return {arm: fits[arm] for arm in points}
