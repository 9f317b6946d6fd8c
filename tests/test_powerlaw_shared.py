"""The joint loss-vs-compute fit with one asymptote E shared by every arm, against known laws.

Every expected value is a closed form of the laws that generated the points: E, A_k, b_k, and
the savings 1 - C_arm(L)/C_ref(L) = 1 - (A_arm/(L-E))^(1/b_arm) / (A_ref/(L-E))^(1/b_ref)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from hptransfer.analysis import compare_fits, loss_compute_frontier
from hptransfer.analysis.powerlaw_shared import fit_power_laws_shared_e

E_TRUE = 1.9
LAWS = {"sp": (40.0, 0.16), "mup": (60.0, 0.19), "completep": (55.0, 0.185)}
COMPUTE = np.logspace(11.5, 14.5, 8)  # 3 decades, 8 shapes: the demo's ladder


def _points(noise: float, seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {arm: (COMPUTE, (E_TRUE + A * COMPUTE**-b) * np.exp(rng.normal(0, noise, 8)))
            for arm, (A, b) in LAWS.items()}


def test_exact_laws_with_a_shared_asymptote_are_recovered() -> None:
    fits = fit_power_laws_shared_e(_points(0.0), bootstrap=0)
    assert list(fits) == list(LAWS)
    for arm, (A, b) in LAWS.items():
        f = fits[arm]
        assert f.E == pytest.approx(E_TRUE, rel=1e-4)
        assert f.A == pytest.approx(A, rel=1e-2) and f.b == pytest.approx(b, rel=1e-3)
        assert f.shared_asymptote == list(LAWS)
        np.testing.assert_allclose(f.residuals, 0.0, atol=1e-6)


def test_noisy_laws_are_recovered_within_their_bootstrap_ci() -> None:
    hits = []
    for seed in range(6):
        fits = fit_power_laws_shared_e(_points(0.004, seed), bootstrap=100, seed=seed)
        for arm, (A, b) in LAWS.items():
            f = fits[arm]
            assert f.reliable, (arm, f.warnings)
            assert len(f.boot_params) == 100
            for name, true in (("E", E_TRUE), ("b", b), ("A", A)):
                assert f.ci[name][1] > f.ci[name][0]
                hits.append(f.ci[name][0] <= true <= f.ci[name][1])
        # one E per joint refit: every arm's bootstrap E column is the same draw
        np.testing.assert_array_equal(fits["sp"].boot_params[:, 0],
                                      fits["mup"].boot_params[:, 0])
    # 54 intervals at a nominal 95 % (one miss in 20 is expected; see test_bootstrap.py)
    assert np.mean(hits) >= 0.8, np.mean(hits)


def test_shared_fit_keeps_the_reliability_rules() -> None:
    # L = A·C^-b with E = 0 for every arm: the shared E is driven to 0 and is flagged
    pts = {arm: (COMPUTE, A * COMPUTE**-b) for arm, (A, b) in LAWS.items()}
    fits = fit_power_laws_shared_e(pts, bootstrap=40, seed=0)
    for f in fits.values():
        assert not f.reliable and any("E is driven to 0" in w for w in f.warnings)


def test_the_seed_noise_is_the_least_noise_the_joint_bootstrap_draws() -> None:
    """Two laws fitted to 1e-4 of their losses: their residuals alone make b's CI a few
    thousandths wide. Seeds that moved each loss by 2 % (log scale) are noise the
    residuals did not see: drawn in every refit, they widen b's CI past a factor 3."""
    c = np.logspace(15, 19, 7)
    rng = np.random.default_rng(0)
    points = {arm: (c, (1.5 + a * c**-b) * (1 + 1e-4 * rng.standard_normal(c.size)))
              for arm, a, b in (("a", 30.0, 0.1), ("b", 40.0, 0.12))}
    quiet = fit_power_laws_shared_e(points, bootstrap=200, seed=0)
    noisy = fit_power_laws_shared_e(points, bootstrap=200, seed=0, seed_noise=0.02)
    for arm in points:
        lo, hi = quiet[arm].ci["b"]
        assert hi - lo < 0.002 and quiet[arm].reliable
        n_lo, n_hi = noisy[arm].ci["b"]
        assert n_hi - n_lo > 50 * (hi - lo) and n_hi / n_lo > 3
        assert not noisy[arm].reliable and noisy[arm].seed_noise == 0.02


def test_each_arm_is_judged_on_its_own_losses() -> None:
    """Arm a has flattened onto the shared E (1.5 + 30 C^-0.5 is 1.5 + 1e-8 at 1e19), arm b
    is still 0.5 above it: only a's curve "has not bent", b's fit stays reliable."""
    c = np.logspace(15, 19, 7)
    fits = fit_power_laws_shared_e({"a": (c, 1.5 + 30 * c**-0.5), "b": (c, 1.5 + 40 * c**-0.1)},
                                   bootstrap=100, seed=0)
    assert fits["a"].E == pytest.approx(1.5) and fits["b"].E == fits["a"].E
    assert not fits["a"].reliable and any("has not bent" in w for w in fits["a"].warnings)
    assert fits["b"].reliable, fits["b"].warnings


def test_an_arm_with_too_few_points_gets_a_reason_and_the_others_fit() -> None:
    pts = _points(0.0)
    pts["short"] = (COMPUTE[:2], pts["sp"][1][:2])
    fits = fit_power_laws_shared_e(pts, bootstrap=0)
    assert fits["short"].reason is not None and "3 distinct compute" in str(fits["short"].reason)
    assert fits["sp"].E == pytest.approx(E_TRUE, rel=1e-4)
    assert "short" not in fits["sp"].shared_asymptote


def _frame(noise: float, seeds: int = 1) -> pd.DataFrame:
    """The points as trials; with 2 seeds, each point's pair is its loss x (1 ± noise), so
    their mean is the point and their spread the noise (its mean's log sd: `noise`)."""
    rows = []
    for arm, (c, y) in _points(noise).items():
        for i, (ci, yi) in enumerate(zip(c, y, strict=True)):
            for s in range(seeds):
                spread = 0.0 if seeds == 1 else noise * (1 if s == 0 else -1)
                rows.append({"arch": "gpt", "parameterization": arm, "arm": arm,
                             "width": 16 * (i + 1), "depth": 2, "lr": 1e-3, "sigma_base": 0.02,
                             "seed": s, "status": "completed", "flops": ci,
                             "final_val_loss": yi * (1 + spread), "tokens": np.nan,
                             "params_non_embedding": np.nan, "params_embedding": 0,
                             "trial_id": f"{arm}{i}s{s}"})
    return pd.DataFrame(rows)


def test_frontier_with_shared_asymptote_gives_closed_form_savings() -> None:
    frontier = loss_compute_frontier(_frame(0.0), bootstrap=0, shared_asymptote=True)
    assert {f.E for f in frontier.fits.values()} == {frontier.fits["sp"].E}
    comp = compare_fits(frontier.fits["completep"], frontier.fits["sp"], arm="completep",
                        reference="sp", n_grid=9)
    loss = comp.table["loss"].to_numpy()
    (a1, b1), (a0, b0) = LAWS["completep"], LAWS["sp"]
    expected = 1 - (a1 / (loss - E_TRUE)) ** (1 / b1) / (a0 / (loss - E_TRUE)) ** (1 / b0)
    np.testing.assert_allclose(comp.table["savings"], expected, atol=5e-3)


def test_savings_of_noisy_shared_fits_have_a_real_ci_containing_the_truth() -> None:
    frontier = loss_compute_frontier(_frame(0.004, seeds=2), bootstrap=200, seed=0,
                                     shared_asymptote=True)
    assert frontier.reliable
    assert frontier.fits["sp"].seed_noise == pytest.approx(0.004, rel=0.02)
    # one seed per point: the same curve, but the noise between seeds is not measured
    alone = loss_compute_frontier(_frame(0.004), bootstrap=50, seed=0, shared_asymptote=True)
    assert not alone.reliable and all(
        any(w.startswith("one seed per point") for w in f.warnings)
        for f in alone.fits.values())
    comp = compare_fits(frontier.fits["completep"], frontier.fits["sp"], arm="completep",
                        reference="sp", n_grid=9)
    head = comp.headline()
    assert comp.no_ci is None and head["ci_high"] - head["ci_low"] > 1e-3
    (a1, b1), (a0, b0) = LAWS["completep"], LAWS["sp"]
    loss = head["loss"]
    truth = 1 - (a1 / (loss - E_TRUE)) ** (1 / b1) / (a0 / (loss - E_TRUE)) ** (1 / b0)
    assert head["ci_low"] <= truth <= head["ci_high"]


@pytest.mark.parametrize("arms", [("mup", "completep"), ("sp", "mup", "completep")])
def test_a_study_reports_completep_over_mup_with_or_without_sp(arms) -> None:
    """The paper's headline is CompleteP over µP: a study of µP and CompleteP alone reported
    only µP over CompleteP (the first arm by name as the reference), another number."""
    from hptransfer.analysis.frontier import FrontierResult
    from hptransfer.analysis.staged import study_savings

    points = {arm: p for arm, p in _points(0.0).items() if arm in arms}
    frontier = FrontierResult(pd.DataFrame(), fit_power_laws_shared_e(points, bootstrap=0))
    result = study_savings(frontier, None, {a: a for a in arms}, n_grid=9, ci=0.95)
    pairs = {(c.arm, c.reference): c for c in result.comparisons.values()}
    assert ("completep", "mup") in pairs and ("mup", "completep") not in pairs, sorted(pairs)
    assert result.reference == ("sp" if "sp" in arms else "mup")
    # the closed form at the grid's middle loss: 1 - C_completep(L) / C_mup(L)
    table = pairs[("completep", "mup")].table
    loss = float(table["loss"].iloc[len(table) // 2])
    (a_c, b_c), (a_m, b_m) = LAWS["completep"], LAWS["mup"]
    want = 1 - (a_c / (loss - E_TRUE)) ** (1 / b_c) / (a_m / (loss - E_TRUE)) ** (1 / b_m)
    assert float(table["savings"].iloc[len(table) // 2]) == pytest.approx(want, abs=2e-3)
