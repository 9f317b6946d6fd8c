"""The residual (fixed-design) bootstrap behind every curve fit's CI, against known laws.

The coverage test draws many studies from known power laws with one shared E (the demo's
ladder design, log-normal noise), fits each with its bootstrap CI of the savings at a fixed
loss, and counts how often that CI holds the closed-form truth
1 - (A_arm/(L-E))^(1/b_arm) / (A_ref/(L-E))^(1/b_ref)."""

from __future__ import annotations

import numpy as np
import pytest

from hptransfer.analysis import compare_fits, fit_power_law
from hptransfer.analysis.fit_result import residual_bootstrap
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


def _drawn_noise(fitted: np.ndarray, residuals: np.ndarray, seed: int) -> np.ndarray:
    """The noise residual_bootstrap adds to `fitted` in each of its 200 redraws."""
    seen: list[np.ndarray] = []

    def refit(y: np.ndarray) -> np.ndarray:
        seen.append(y - fitted)
        return np.zeros(2)

    residual_bootstrap(fitted, residuals, 2, 200, seed, refit)
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
    assert np.mean(hits) >= 0.75, np.mean(hits)  # 0.87 over 30 studies when written


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
