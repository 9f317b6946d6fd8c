"""The residual (fixed-design) bootstrap behind every curve fit's CI, against known laws.

The coverage tests draw many studies from known power laws with one shared E (the demo's
ladder design, log-normal noise), fit each (all arms under one E, or each arm alone) with its
bootstrap CI of the savings at a fixed loss, and count how often that CI holds the
closed-form truth 1 - (A_arm/(L-E))^(1/b_arm) / (A_ref/(L-E))^(1/b_ref)."""

from __future__ import annotations

import numpy as np
import pytest

from hptransfer.analysis import compare_fits, fit_chinchilla, fit_power_law
from hptransfer.analysis.chinchilla import ChinchillaResult, compute_max, derived_quantities
from hptransfer.analysis.fit_result import (
    hat_values,
    residual_bootstrap,
    student_ratios,
    studentize,
)
from hptransfer.analysis.powerlaw_shared import fit_power_laws_shared_e

E_TRUE = 0.987
LAWS = {"completep": (81.7, 0.180), "mup": (66.3, 0.171), "sp": (243.0, 0.224)}  # demo's fit
DESIGN = np.array([7.8e8, 2.35e9, 9.35e9, 2.77e10, 3.9e10, 1.1e11, 2.3e11])  # demo's frontier
LOSS = 2.4


def _true_savings(arm: str, ref: str) -> float:
    compute = {k: (A / (LOSS - E_TRUE)) ** (1 / b) for k, (A, b) in LAWS.items()}
    return 1.0 - compute[arm] / compute[ref]


def test_zero_residuals_give_identical_refits_and_no_width() -> None:
    calls = []

    def refit(y: np.ndarray) -> np.ndarray:
        calls.append(y)
        return np.array([y.sum()])

    fitted = np.array([1.0, 2.0, 3.0, 4.0])
    boot = residual_bootstrap(fitted, np.zeros(4), 1, 25, 0, refit)
    assert boot.shape == (25, 1) and len(calls) == 25
    np.testing.assert_array_equal(boot, 10.0)


def _drawn_noise(fitted: np.ndarray, residuals: np.ndarray, seed: int,
                 leverage: np.ndarray | None = None) -> np.ndarray:
    """The noise residual_bootstrap adds to `fitted` in each of its 200 redraws."""
    seen: list[np.ndarray] = []

    def refit(y: np.ndarray) -> np.ndarray:
        seen.append(y - fitted)
        return np.zeros(2)

    residual_bootstrap(fitted, residuals, 2, 200, seed, refit, leverage=leverage)
    return np.concatenate(seen)


def test_draws_keep_the_design_and_rescale_median_centred_residuals() -> None:
    fitted = np.arange(6.0)
    residuals = np.array([0.1, -0.2, 0.3, 0.0, 0.05, 5.0])  # 5.0: an outlier
    draws = _drawn_noise(fitted, residuals, 3)
    # median-centred, then scaled by sqrt(n/(n-p)) = sqrt(6/4)
    allowed = (residuals - np.median(residuals)) * np.sqrt(6 / 4)
    assert np.isin(np.round(draws, 12), np.round(allowed, 12)).all()
    assert len(np.unique(np.round(draws, 12))) == 6  # every residual gets drawn
    # the same seed gives the same draws, another seed others
    np.testing.assert_array_equal(_drawn_noise(fitted, residuals, 3), draws)
    assert not np.array_equal(_drawn_noise(fitted, residuals, 4), draws)


def test_leverage_modifies_each_residual_by_its_own_hat_value() -> None:
    fitted = np.arange(5.0)
    residuals = np.array([0.1, -0.2, 0.3, 0.0, -0.05])
    leverage = np.array([0.9, 0.2, 0.5, 0.2, 0.99999])  # the last is capped at 0.99
    draws = _drawn_noise(fitted, residuals, 0, leverage)
    # r_i / sqrt(1 - h_i), then median-centred (Davison & Hinkley alg. 6.3); no global factor
    modified = residuals / np.sqrt(1 - np.minimum(leverage, 0.99))
    allowed = modified - np.median(modified)
    assert np.isin(np.round(draws, 12), np.round(allowed, 12)).all()
    assert len(np.unique(np.round(draws, 12))) == 5


def test_a_pool_limits_the_residuals_drawn_not_their_number() -> None:
    fitted = np.arange(6.0)
    residuals = np.array([0.1, -0.2, 0.0, 0.3, 1e-4, -0.1])  # 0.0 and 1e-4: the fit's own
    leverage = np.full(6, 0.5)
    pool = np.abs(residuals) > 1e-3
    seen: list[np.ndarray] = []

    def refit(y: np.ndarray) -> np.ndarray:
        seen.append(y - fitted)
        return np.zeros(2)

    residual_bootstrap(fitted, residuals, 2, 200, 0, refit, leverage=leverage, pool=pool)
    draws = np.concatenate(seen)
    assert all(len(d) == 6 for d in seen)  # still one residual per point
    modified = residuals[pool] / np.sqrt(0.5)
    allowed = modified - np.median(modified)
    assert np.isin(np.round(draws, 12), np.round(allowed, 12)).all()
    assert len(np.unique(np.round(draws, 12))) == 4
    # a pool of fewer than two residuals (exact data) draws from all of them
    few = np.zeros(6, dtype=bool)
    few[0] = True
    seen.clear()
    residual_bootstrap(fitted, residuals, 2, 200, 0, refit, leverage=leverage, pool=few)
    assert len(np.unique(np.round(np.concatenate(seen), 12))) == 6


def test_hat_values_are_the_linear_models_and_skip_parameters_at_a_bound() -> None:
    x = np.column_stack([np.ones(6), np.linspace(0, 1, 6), np.linspace(0, 1, 6) ** 3])
    h = hat_values(x)
    np.testing.assert_allclose(h, np.diag(x @ np.linalg.solve(x.T @ x, x.T)))
    assert h.sum() == pytest.approx(3.0)
    # a parameter held at its bound is not fitted: the hat values of the other two columns
    np.testing.assert_allclose(hat_values(x, np.array([0, 0, 1])), hat_values(x[:, :2]))


def test_studentize_rescales_each_refit_by_its_own_noise_scale() -> None:
    ratios = student_ratios(0.02, np.array([0.01, 0.02, 0.04, 0.0]))
    np.testing.assert_array_equal(ratios[:3], [2.0, 1.0, 0.5])
    assert np.isnan(ratios[3])  # a refit with no residual spread cannot be studentized
    refits = np.array([1.5, 3.0, 0.0, 2.0])
    out = studentize(1.0, refits, ratios)
    np.testing.assert_array_equal(out[:3], [2.0, 3.0, 0.5])
    assert np.isnan(out[3])
    assert studentize(1.0, np.array([np.inf]), np.array([0.5]))[0] == np.inf  # stays unbounded
    # exact data (no spread anywhere): the refits are kept as they are
    np.testing.assert_array_equal(student_ratios(0.0, np.zeros(3)), 1.0)


def test_no_resamples_is_an_empty_sample() -> None:
    assert residual_bootstrap(np.ones(3), np.ones(3), 2, 0, 0, lambda y: y).shape == (0, 2)


def test_single_power_law_b_ci_covers_the_truth() -> None:
    rng = np.random.default_rng(5)
    A, b = LAWS["sp"]
    c = np.logspace(8.5, 11.5, 8)
    hits = []
    for rep in range(20):
        y = (E_TRUE + A * c**-b) * np.exp(rng.normal(0, 0.01, c.size))
        fit = fit_power_law(c, y, bootstrap=60, seed=rep)
        assert len(fit.boot_params) == 60  # a fixed design never skips a resample
        assert fit.ci["b"][1] > fit.ci["b"][0]
        hits.append(fit.ci["b"][0] <= b <= fit.ci["b"][1])
    # 0.87 over 30 studies when written; at these seeds 0.85 before the refits were
    # studentized (fit_result.studentize), 0.90 after
    assert np.mean(hits) >= 0.75, np.mean(hits)


@pytest.mark.parametrize("sigma", [0.01, 0.02])
def test_savings_ci_covers_the_truth_near_the_nominal_rate(sigma: float) -> None:
    rng = np.random.default_rng(123)
    pairs = [("completep", "sp"), ("mup", "sp"), ("completep", "mup")]
    hits, spans = [], []
    for rep in range(24):
        pts = {arm: (DESIGN, (E_TRUE + A * DESIGN**-b) * np.exp(rng.normal(0, sigma, 7)))
               for arm, (A, b) in LAWS.items()}
        fits = fit_power_laws_shared_e(pts, bootstrap=60, seed=rep)
        for arm, ref in pairs:
            row = compare_fits(fits[arm], fits[ref], losses=[LOSS]).table.iloc[0]
            assert np.isfinite(row["ci_low"]) and row["ci_high"] > row["ci_low"]
            hits.append(row["ci_low"] <= _true_savings(arm, ref) <= row["ci_high"])
            spans.append((1 - row["ci_low"]) / (1 - row["ci_high"]))
    coverage = float(np.mean(hits))
    # 72 intervals at a nominal 95 %: under 80 % would be a CI too narrow to trust, and a
    # median span far over the noise's own scale would be one too wide to say anything
    assert coverage >= 0.80, coverage
    assert np.median(spans) < 1.0 + 60 * sigma, np.median(spans)


def test_separate_fits_savings_ci_covers_the_truth_near_the_nominal_rate() -> None:
    """Each arm fitted alone (loss_compute_frontier's default): 3 parameters on 7 points leave
    4 degrees of freedom to the noise scale. Refits that take that scale as known gave a
    z-interval where a t-interval is due: 0.878 here (0.88-0.90 over other seeds, 0.916 over
    600 intervals at bootstrap=200); studentized refits give 0.972 here (0.94-0.97)."""
    rng = np.random.default_rng(123)
    pairs = [("completep", "sp"), ("mup", "sp"), ("completep", "mup")]
    hits, spans = [], []
    for rep in range(60):
        fits = {
            arm: fit_power_law(DESIGN, (E_TRUE + A * DESIGN**-b) * np.exp(rng.normal(0, 0.01, 7)),
                               bootstrap=60, seed=3 * rep + i)
            for i, (arm, (A, b)) in enumerate(LAWS.items())
        }
        for arm, ref in pairs:
            row = compare_fits(fits[arm], fits[ref], losses=[LOSS]).table.iloc[0]
            hits.append(row["ci_low"] <= _true_savings(arm, ref) <= row["ci_high"])
            spans.append((1 - row["ci_low"]) / (1 - row["ci_high"]))
    coverage = float(np.mean(hits))
    # 180 intervals at a nominal 95 %: 0.92 sits between the two with 8-9 intervals to spare
    # either way; the span bound is the shared-E test's (1 + 60 sigma): not wider than useful
    assert coverage >= 0.92, coverage
    assert np.median(spans) < 1.6, np.median(spans)


CHINCHILLA = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}  # Hoffmann et al.


def test_chinchilla_cis_cover_the_truth_near_the_nominal_rate() -> None:
    """fit_chinchilla's Huber loss (δ = 1e-3 against 1 % noise) is near L1: the fit passes
    through about one point per parameter, and with those ~0 residuals redrawn among the
    others the refits stayed too close to the estimate: the plain percentile CIs of E, A, B,
    α, β covered the truth 0.848 of the time here (0.73-0.86 on the demo's 15-point design,
    0.90-0.92 on 36 points; README). Drawing only the residuals outside δ, leverage-adjusted,
    and studentizing each refit by its own noise scale: 0.94 here."""
    n, d = (g.ravel() for g in np.meshgrid(np.logspace(7, 10, 5), np.logspace(9, 12, 5)))
    p = CHINCHILLA
    law = p["E"] + p["A"] / n ** p["alpha"] + p["B"] / d ** p["beta"]
    # what the fit derives (N_opt's and D_opt's exponents in C, both at the largest compute)
    derived = derived_quantities(p["A"], p["B"], p["alpha"], p["beta"], compute_max(n, d))
    rng = np.random.default_rng(7)
    hits, derived_hits, spans = [], [], []
    for rep in range(100):
        fit = fit_chinchilla(n, d, law * np.exp(rng.normal(0, 0.01, n.size)),
                             bootstrap=60, seed=rep)
        assert len(fit.boot_params) == 60
        hits += [fit.ci[k][0] <= v <= fit.ci[k][1] for k, v in p.items()]
        derived_hits += [fit.ci[k][0] <= v <= fit.ci[k][1] for k, v in derived.items()]
        spans.append(fit.ci["alpha"][1] / fit.ci["alpha"][0])
    coverage = float(np.mean(hits))
    # 500 intervals (100 studies x 5 parameters) at a nominal 95 %: 0.90 sits between the
    # old 0.848 and the new 0.94 with ~20 intervals to spare either way; α's CI must stay
    # narrow enough to say something
    assert coverage >= 0.90, coverage
    assert np.median(spans) < 1.5, np.median(spans)
    # the derived quantities' CIs, studentized from the same refits as the parameters': 0.935
    # (400 intervals; 0.965 as plain percentiles of the refits). Derived from the wrong
    # refits (the exponents swapped, say) they would cover far less
    assert np.mean(derived_hits) >= 0.90, np.mean(derived_hits)


def test_chinchilla_cis_on_few_points_are_neither_too_narrow_nor_too_wide() -> None:
    """12 points (3 sizes x 4 token counts) for 5 parameters: here both corrections carry the
    coverage, and a two-sided bound holds each to account. Measured when written (400
    intervals at a nominal 95 %): 0.93 as fitted; 0.985 with the refits not studentized (each
    refit's own noise scale left out: intervals too wide) and 0.833 with the residuals not
    leverage-adjusted (the points pinning the surface's corners keep their shrunk residuals:
    too narrow). The 25-point test above cannot tell either apart (0.962, 0.938)."""
    n, d = (g.ravel() for g in np.meshgrid(np.logspace(7, 10, 3), np.logspace(9, 12, 4)))
    p = CHINCHILLA
    law = p["E"] + p["A"] / n ** p["alpha"] + p["B"] / d ** p["beta"]
    rng = np.random.default_rng(7)
    hits = []
    for rep in range(80):
        fit = fit_chinchilla(n, d, law * np.exp(rng.normal(0, 0.01, n.size)),
                             bootstrap=60, seed=rep)
        hits += [fit.ci[k][0] <= v <= fit.ci[k][1] for k, v in p.items()]
    coverage = float(np.mean(hits))
    assert 0.88 <= coverage <= 0.97, coverage


def test_derived_quantities_are_the_closed_forms_and_their_cis_agree() -> None:
    """N_opt and D_opt minimise the law at C = 6 N D (checked by a scan along that line); the
    exponents are β/(α+β) and α/(α+β); the D exponent's CI is 1 minus the N exponent's and
    D_opt's CI is C/6 over N_opt's, since both pairs are one quantity each."""
    p = CHINCHILLA
    n, d = (g.ravel() for g in np.meshgrid(np.logspace(7, 9, 4), np.logspace(9, 11, 4)))
    c = compute_max(n, d)
    assert c == pytest.approx(6 * 1e9 * 1e11)
    got = derived_quantities(p["A"], p["B"], p["alpha"], p["beta"], c)
    assert got["n_exponent"] == pytest.approx(0.28 / 0.62)
    assert got["d_exponent"] == pytest.approx(0.34 / 0.62)
    scan = np.logspace(8, 12, 40001)
    loss = p["A"] / scan ** p["alpha"] + p["B"] / (c / 6 / scan) ** p["beta"]
    assert got["n_opt_at_max"] == pytest.approx(scan[np.argmin(loss)], rel=1e-3)
    assert got["n_opt_at_max"] * got["d_opt_at_max"] == pytest.approx(c / 6)
    law = p["E"] + p["A"] / n ** p["alpha"] + p["B"] / d ** p["beta"]
    rng = np.random.default_rng(3)
    fit = fit_chinchilla(n, d, law * np.exp(rng.normal(0, 0.01, n.size)), bootstrap=40, seed=1)
    lo, hi = fit.ci["n_exponent"]
    assert 0 < lo < fit.n_exponent < hi < 1
    assert fit.ci["d_exponent"] == pytest.approx((1 - hi, 1 - lo))
    lo, hi = fit.ci["n_opt_at_max"]
    assert fit.ci["d_opt_at_max"] == pytest.approx((c / 6 / hi, c / 6 / lo), rel=1e-9)
    row = fit_frame_row(fit)
    assert (row["n_exponent_ci_low"], row["n_exponent_ci_high"]) == fit.ci["n_exponent"]


def fit_frame_row(fit: object) -> dict:
    """The one row `ChinchillaResult.to_frame` gives for a single fit."""
    return ChinchillaResult(fits={"a": fit}).to_frame().iloc[0].to_dict()
