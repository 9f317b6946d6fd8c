"""Seed noise in every interval (issue 51): η* and transfer-shift CIs cover the truth at their
nominal rate on bowls with known noise; reliable means informative (a CI no wider than asked,
a bracket that rises above the noise, a savings CI that excludes 0); one seed gives no CI.

The truths are the simulated bowls' own vertices and shifts; coverage is counted over many
independent bowls and held to a binomial tolerance around the nominal 95 %."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from hptransfer.analysis import compare_fits, fit_power_law, optimal_lr
from hptransfer.analysis.noise import (
    bracket_rise,
    paired_sd,
    pooled_sd,
    t_quantile,
    vertex_ci,
)
from hptransfer.analysis.powerlaw import PowerLawFit
from hptransfer.analysis.staged import transfer_check
from hptransfer.analysis.study_report import study_fit_report

CURVATURE = 0.05  # loss rise per octave² from the optimum


@pytest.mark.parametrize("ci", [0.5, 0.9, 0.95, 0.99])
def test_the_t_quantile_is_student_t_s(ci):
    """Every CI's t factor against scipy.stats' Student t (the analysis takes the inverse CDF
    from scipy.special, lighter to import): fractional degrees of freedom (Welch) included."""
    dof = np.array([1.0, 1.5, 2.0, 3.7, 10.0, 250.0])
    assert np.allclose(t_quantile(ci, dof), stats.t.ppf(0.5 + ci / 2, dof), rtol=1e-10)
    assert np.isnan(t_quantile(ci, np.array([0.0, 0.5]))).all()  # no CI below one dof


def _tolerance(n: int, level: float = 0.95) -> float:
    """Three binomial standard deviations of a coverage count over n intervals."""
    return 3.0 * math.sqrt(level * (1 - level) / n)


def _bowl_rows(n: int, seeds: int, noise: float, rng: np.random.Generator,
               grid: np.ndarray) -> tuple[list[dict], np.ndarray]:
    """n independent shapes (width = 64 + i), loss = 3 + c (log2 lr - v_i)² + N(0, noise)."""
    truth = rng.uniform(-9.0, -7.5, n)
    rows = [{"trial_id": f"t{i}-{x}-{s}", "arm": "a", "width": 64 + i, "depth": 2,
             "lr": 2.0**x, "sigma_base": 0.02, "seed": s, "status": "completed",
             "final_val_loss": 3 + CURVATURE * (x - truth[i]) ** 2 + rng.normal(0, noise)}
            for i in range(n) for x in grid for s in range(seeds)]
    return rows, truth


@pytest.mark.parametrize(("seeds", "noise"), [(2, 0.01), (3, 0.02)])
def test_eta_ci_covers_the_truth_at_its_nominal_rate(seeds: int, noise: float) -> None:
    # 2 seeds pool 5 degrees of freedom over the fitted LRs: a z interval (1.96 for the
    # t quantile 2.57) covered ~0.89, the seed bootstrap it replaced ~0.8
    n = 500
    rows, truth = _bowl_rows(n, seeds, noise, np.random.default_rng(seeds),
                             np.arange(-12.0, -4.5, 1.0))
    shapes = optimal_lr(pd.DataFrame(rows)).shapes.sort_values("width")
    lo, hi = shapes["log2_ci_low"].to_numpy(), shapes["log2_ci_high"].to_numpy()
    assert np.isfinite(lo).all() and np.isfinite(hi).all()
    coverage = np.mean((lo <= truth) & (truth <= hi))
    assert abs(coverage - 0.95) <= _tolerance(n), coverage
    assert (shapes["noise_dof"] == 5 * (seeds - 1)).all()


def test_shift_ci_combines_base_and_check_and_covers_the_truth() -> None:
    """Per arm: η* tuned at 32x2, a bracket around it at 64x8 whose optimum moved by a
    known shift; the shift's CI (base's and check's half-widths in quadrature) covers it."""
    rng = np.random.default_rng(7)
    n, noise = 200, 0.01
    rows: list[dict] = []
    truths = {}
    for i in range(n):
        arm = f"arm{i}"
        base = rng.uniform(-9.0, -7.5)
        moved = base + rng.uniform(-1.0, 1.0)
        truths[arm] = moved - base
        for x in np.arange(-12.0, -4.5, 1.0):
            for s in range(2):
                rows.append(dict(trial_id=f"{arm}-t{x}-{s}", arm=arm, width=32, depth=2,
                                 lr=2.0**x, sigma_base=0.02, seed=s, status="completed",
                                 stage="tune",
                                 final_val_loss=3 + CURVATURE * (x - base) ** 2
                                 + rng.normal(0, 2 * noise)))  # the base: the larger part
        centre = round(base)  # the bracket is planned around the transferred η*
        for off in (-2.0, -1.0, 0.0, 1.0, 2.0):
            x = centre + off
            for s in range(2):
                rows.append(dict(trial_id=f"{arm}-c{x}-{s}", arm=arm, width=64, depth=8,
                                 lr=2.0**x, sigma_base=0.02, seed=s, status="completed",
                                 stage="check",
                                 final_val_loss=3 + CURVATURE * (x - moved) ** 2
                                 + rng.normal(0, noise)))
    table = transfer_check(pd.DataFrame(rows)).table.set_index("arm")
    truth = np.array([truths[a] for a in table.index])
    lo, hi = table["shift_ci_low"].to_numpy(), table["shift_ci_high"].to_numpy()
    covered = (lo <= truth) & (truth <= hi)
    finite = np.isfinite(lo) & np.isfinite(hi)
    assert finite.mean() > 0.95
    # each side's standard errors added in quadrature, t of their Welch-Satterthwaite dof
    # (the two 5-dof t half-widths added as they are covered 0.985)
    coverage = covered.mean()
    assert abs(coverage - 0.95) <= _tolerance(n), coverage
    # and on each side: the base's half-width is added to both (missing on one side,
    # that side alone missed the truth ~8 % of the time)
    one_side = 0.025 + 3.0 * math.sqrt(0.025 * 0.975 / n)
    assert np.mean(truth < lo) <= one_side and np.mean(truth > hi) <= one_side
    # the shift's half-width exceeds each side's own: the base's uncertainty is counted
    assert (table["shift_ci_half"] > 0).all()


def _two_arm_study(moves: dict[str, float], seeds: int, noise: float,
                   rng: np.random.Generator, check: tuple[int, int] = (64, 8)) -> pd.DataFrame:
    rows: list[dict] = []
    for arm, moved in moves.items():
        for x in np.arange(-12.0, -4.5, 1.0):
            for s in range(seeds):
                rows.append(dict(trial_id=f"{arm}t{x}{s}", arm=arm, width=32, depth=2,
                                 lr=2.0**x, sigma_base=0.02, seed=s, status="completed",
                                 stage="tune",
                                 final_val_loss=3 + 0.1 * (x + 8.3) ** 2 + rng.normal(0, noise)))
        for off in (-2.0, -1.0, 0.0, 1.0, 2.0):
            x = -8.0 + off
            for s in range(seeds):
                rows.append(dict(trial_id=f"{arm}c{x}{s}", arm=arm, width=check[0],
                                 depth=check[1], lr=2.0**x, sigma_base=0.02, seed=s,
                                 status="completed",
                                 stage="check", final_val_loss=3 + 0.1 * (x + 8.3 - moved) ** 2
                                 + rng.normal(0, noise)))
    return pd.DataFrame(rows)


def test_a_positive_and_a_negative_shift_are_both_detected() -> None:
    df = _two_arm_study({"up": 1.0, "down": -1.0}, seeds=4, noise=0.003,
                        rng=np.random.default_rng(2))
    table = transfer_check(df).table.set_index("arm")
    up, down = table.loc["up"], table.loc["down"]
    assert up["shift_log2"] == pytest.approx(1.0, abs=0.1)
    assert down["shift_log2"] == pytest.approx(-1.0, abs=0.1)
    assert 0 < up["shift_ci_low"] <= 1.0 <= up["shift_ci_high"]
    assert down["shift_ci_low"] <= -1.0 <= down["shift_ci_high"] < 0
    assert up["reliable"] and down["reliable"], table[["reason"]]


def test_one_seed_gives_no_ci_and_every_number_says_why() -> None:
    df = _two_arm_study({"up": 1.0}, seeds=1, noise=0.003, rng=np.random.default_rng(2))
    eta = optimal_lr(df[df["stage"] == "tune"]).shapes.iloc[0]
    assert eta["sound"] and not eta["reliable"]
    assert math.isnan(eta["log2_ci_low"]) and "one seed per fitted LR" in eta["reason"]
    row = transfer_check(df).table.iloc[0]
    assert math.isnan(row["shift_ci_low"]) and not row["reliable"]
    assert "one seed per fitted LR" in row["reason"]
    # the report's headline carries the CI (none) and the reason
    head = study_fit_report(df).to_dict()["headline"]
    (shift,) = head["transfer_shift"]
    assert shift["ci_low"] is None and "one seed" in shift["reason"]
    assert all("one seed" in r["reason"] for r in head["eta_star"])


def test_a_flat_bracket_within_the_noise_is_not_reliable() -> None:
    # a bowl of curvature 0.002 per octave² under seed noise 0.01: the losses across the
    # bracket differ by less than another seed would move them
    rng = np.random.default_rng(4)
    rows, _ = _bowl_rows(1, 3, 0.01, rng, np.arange(-12.0, -4.5, 1.0))
    for r in rows:
        r["final_val_loss"] = 3 + 0.002 * (math.log2(r["lr"]) + 8.2) ** 2 + rng.normal(0, 0.01)
    row = optimal_lr(pd.DataFrame(rows)).shapes.iloc[0]
    assert not row["reliable"] and not row["informative"]
    assert "flat within the seed noise" in row["reason"] or "unbounded" in row["reason"]
    # the same bowl, 50x more curved: informative
    for r in rows:
        r["final_val_loss"] = 3 + 0.1 * (math.log2(r["lr"]) + 8.2) ** 2 + rng.normal(0, 0.01)
    assert optimal_lr(pd.DataFrame(rows)).shapes.iloc[0]["reliable"]


def _exact_pairs(curvature: float, d: float) -> pd.DataFrame:
    """A bowl centred at 2^-8 over LRs 2^-10..2^-6, each LR's two seeds at its loss ± d
    (their sd d·sqrt(2), pooled over 5 LRs: 5 degrees of freedom). Each LR runs its own two
    seeds: none is shared, so the noise is pooled per LR, not paired."""
    return pd.DataFrame([
        {"trial_id": f"{x}{s}", "arm": "a", "width": 64, "depth": 2, "lr": 2.0**x,
         "sigma_base": 0.02, "seed": 2 * i + s, "status": "completed",
         "final_val_loss": 3 + curvature * (x + 8) ** 2 + (d if s else -d)}
        for i, x in enumerate(np.arange(-10.0, -5.5, 1.0)) for s in range(2)])


def test_a_bracket_rising_less_than_the_noise_is_not_reliable_at_any_width() -> None:
    # closed form: each side rises 4c at ±2 octaves; a difference of two 2-seed means has
    # noise t(5) x d·sqrt(2) x 1 = 3.64 d. At c = 0.8 d the curvature is just past
    # Fieller's bound (0.69 d: a bounded, wide CI), at c = d the rise 4 d clears 3.64 d
    d = 0.01
    flat = optimal_lr(_exact_pairs(0.8 * d, d), max_ci_log2=100).shapes.iloc[0]
    assert np.isfinite(flat["log2_ci_low"]) and np.isfinite(flat["log2_ci_high"])
    assert flat["bracket_rise"] == pytest.approx(3.2 * d)
    assert flat["bracket_noise"] == pytest.approx(
        stats.t.ppf(0.975, 5) * d * math.sqrt(2), rel=1e-9)
    assert not flat["reliable"] and "flat within the seed noise" in flat["reason"]
    steep = optimal_lr(_exact_pairs(1.0 * d, d), max_ci_log2=100).shapes.iloc[0]
    assert steep["reliable"] and steep["reason"] is None


def _shifted_bowls(n: int, seeds: int, shift: float, noise: float, rng: np.random.Generator,
                   grid: np.ndarray) -> tuple[pd.DataFrame, np.ndarray]:
    """n shapes whose seed s lifts the shape's whole curve by its own N(0, shift) (a seed's
    init and data order, shared by its LRs) on top of N(0, noise) per run."""
    rows, truth = _bowl_rows(n, seeds, noise, rng, grid)
    lift = rng.normal(0, shift, (n, seeds))
    for r in rows:
        r["final_val_loss"] += lift[r["width"] - 64, r["seed"]]
    return pd.DataFrame(rows), truth


def test_a_seeds_shift_of_the_whole_curve_is_left_out_of_etas_ci() -> None:
    """Seeds that lift a shape's whole curve by ~0.2 (20x the noise left): paired by seed,
    η*'s CI covers the truth at its nominal rate with the noise left; with each LR's seeds
    its own, the same losses give CIs many times wider."""
    n, grid = 400, np.arange(-12.0, -4.5, 1.0)
    df, truth = _shifted_bowls(n, 2, 0.2, 0.01, np.random.default_rng(11), grid)
    shapes = optimal_lr(df).shapes.sort_values("width")
    assert shapes["seeds_paired"].all()
    assert (shapes["eta_noise_dof"] == 4).all()  # (5 fitted LRs - 1)(2 seeds - 1)
    assert (shapes["noise_dof"] == 5).all()  # the point's loss noise is still all of it
    assert np.median(shapes["eta_noise_sd"]) == pytest.approx(0.01, rel=0.25)
    assert np.median(shapes["noise_sd"]) > 8 * np.median(shapes["eta_noise_sd"])
    lo, hi = shapes["log2_ci_low"].to_numpy(), shapes["log2_ci_high"].to_numpy()
    coverage = np.mean((lo <= truth) & (truth <= hi))
    assert abs(coverage - 0.95) <= _tolerance(n), coverage
    paired_half = np.median(shapes["ci_half_log2"])
    assert paired_half < 0.5 and shapes["reliable"].mean() > 0.9

    unpaired = df.assign(seed=df["seed"] + 2 * np.log2(df["lr"]).round().astype(int) + 40)
    alone = optimal_lr(unpaired).shapes
    assert not alone["seeds_paired"].any()
    assert (alone["eta_noise_sd"] == alone["noise_sd"]).all()
    assert np.median(alone["ci_half_log2"]) > 4 * paired_half


def test_paired_sd_is_the_two_way_models_residual_sd() -> None:
    """Against least squares on dummy columns (an LR effect per LR, a seed effect per seed),
    group by group: the residual sum of squares over n - L - S + 1 degrees of freedom. The
    groups are computed together, in any order of runs, and a group that is not a full
    LR x seed table gets none."""
    rng = np.random.default_rng(5)
    runs, expected = [], []
    for g, (n_l, n_s) in enumerate([(2, 2), (5, 2), (3, 4)]):
        col = np.repeat(np.arange(n_l) * 7, n_s)
        seed = np.tile(np.arange(n_s) + 3, n_l)
        loss = rng.normal(3, 0.1, n_l * n_s) + 0.5 * seed
        design = np.column_stack([col == c for c in np.unique(col)]
                                 + [seed == s for s in np.unique(seed)[1:]]).astype(float)
        fitted = design @ np.linalg.lstsq(design, loss, rcond=None)[0]
        dof = n_l * n_s - n_l - n_s + 1
        expected.append((math.sqrt(np.sum((loss - fitted) ** 2) / dof), dof))
        runs += [(x, c, s, g) for x, c, s in zip(loss, col, seed, strict=True)]
    # not tables: a seed missing at one LR; one seed; one LR; a seed twice at one LR
    runs += [(3.0, 0, 0, 3), (3.1, 0, 1, 3), (3.2, 1, 0, 3)]
    runs += [(3.0, c, 0, 4) for c in range(3)]
    runs += [(3.0, 0, s, 5) for s in range(3)]
    runs += [(3.0, 0, 0, 6), (3.1, 0, 0, 6), (3.2, 1, 1, 6), (3.3, 1, 0, 6)]
    runs = [runs[k] for k in rng.permutation(len(runs))]
    loss, col, seed, group = (np.array(v) for v in zip(*runs, strict=True))
    sd, dof = paired_sd(loss, col, seed, group, 8)
    for g, (want_sd, want_dof) in enumerate(expected):
        assert dof[g] == want_dof
        assert sd[g] == pytest.approx(want_sd, rel=1e-9)
    assert (dof[3:] == 0).all() and np.isnan(sd[3:]).all()  # group 7: no runs at all


def test_a_seed_missing_at_a_fitted_lr_falls_back_to_the_pooled_noise() -> None:
    df, _ = _shifted_bowls(1, 3, 0.2, 0.01, np.random.default_rng(3),
                           np.arange(-12.0, -4.5, 1.0))
    full = optimal_lr(df).shapes.iloc[0]
    assert full["seeds_paired"]
    best = np.log2(full["best_lr"])
    gap = df[~(np.isclose(np.log2(df["lr"]), best + 1) & (df["seed"] == 2))]
    row = optimal_lr(gap).shapes.iloc[0]
    assert not row["seeds_paired"]
    assert row["eta_noise_sd"] == row["noise_sd"] and row["eta_noise_dof"] == row["noise_dof"]


def test_vertex_ci_is_the_set_fiellers_inequality_admits() -> None:
    """Against a brute-force scan of v: (c1 + 2 c2 v)² <= t² Var(c1 + 2 c2 v)."""
    t = np.array([2.5])
    for c1, c2, cov in [(0.02, 0.05, np.diag([0.0, 1e-4, 2e-4])),
                        (-0.03, 0.04, np.array([[0, 0, 0], [0, 2e-4, -5e-5], [0, -5e-5, 1e-4]])),
                        (0.01, 0.004, np.diag([0.0, 1e-4, 1e-4]))]:  # c2 < t·SE: unbounded
        lo, hi = vertex_ci(np.array([c1]), np.array([c2]), cov[None], t)
        v = np.linspace(-40, 40, 400_001)
        var = cov[1, 1] + 4 * v * cov[1, 2] + 4 * v**2 * cov[2, 2]
        inside = v[(c1 + 2 * c2 * v) ** 2 <= t[0] ** 2 * var]
        if c2**2 > t[0] ** 2 * cov[2, 2]:
            assert lo[0] == pytest.approx(inside.min(), abs=2e-4)
            assert hi[0] == pytest.approx(inside.max(), abs=2e-4)
            assert lo[0] < -c1 / (2 * c2) < hi[0]
        else:
            assert inside.min() == v.min() or inside.max() == v.max()  # no bound in the scan
            assert lo[0] == -np.inf and hi[0] == np.inf


def test_bracket_rise_against_hand_computed_rises() -> None:
    # one row: LRs -2..2 (best at 0), two seeds each, sd 0.01 pooled, t = 2
    x = np.array([[-2.0, -1.0, 0.0, 1.0, 2.0]])
    means = np.array([[3.10, 3.05, 3.00, 3.01, 3.015]])
    n = np.full((1, 5), 2.0)
    window = np.ones((1, 5), dtype=bool)
    rise, noise, ok = bracket_rise(x, means, n, window, np.array([2]), np.array([0.01]),
                                   np.array([2.0]))
    # the upper side rises 0.015 (its highest, at +2), the lower 0.10; the noise of a
    # difference of two 2-seed means: 2 x 0.01 x sqrt(1/2 + 1/2) = 0.02
    assert rise[0] == pytest.approx(0.015) and noise[0] == pytest.approx(0.02)
    assert not ok[0]
    means[0, 4] = 3.03  # now 0.03 > 0.02 on the upper side too
    rise, noise, ok = bracket_rise(x, means, n, window, np.array([2]), np.array([0.01]),
                                   np.array([2.0]))
    assert rise[0] == pytest.approx(0.03) and ok[0]


def test_pooled_sd_weights_each_point_by_its_degrees_of_freedom() -> None:
    std = np.array([0.01, 0.02, np.nan])
    n = np.array([2, 4, 1])
    sd, dof = pooled_sd(std, n)
    assert dof == 4 and sd == pytest.approx(math.sqrt((1 * 0.01**2 + 3 * 0.02**2) / 4))
    assert np.isnan(pooled_sd(np.array([np.nan]), np.array([1]))[0])


def test_an_eta_ci_wider_than_asked_is_not_reliable() -> None:
    rows, _ = _bowl_rows(1, 2, 0.02, np.random.default_rng(9), np.arange(-12.0, -4.5, 1.0))
    row = optimal_lr(pd.DataFrame(rows)).shapes.iloc[0]
    half = row["ci_half_log2"]
    assert 0.05 < half < 0.5 and row["reliable"]
    narrow = optimal_lr(pd.DataFrame(rows), max_ci_log2=half * 0.9).shapes.iloc[0]
    assert not narrow["reliable"] and narrow["sound"]
    assert f"wider than the ±{half * 0.9:g}" in narrow["reason"]
    assert optimal_lr(pd.DataFrame(rows), max_ci_log2=half * 1.1).shapes.iloc[0]["reliable"]


def _law_fit(A: float, boot_A: np.ndarray) -> PowerLawFit:
    """L = 1 + A C^-0.5 seen over losses [1.2, 2]; refits that differ in A only."""
    b, E, c_scale = 0.5, 1.0, 1.0
    compute = (A / (np.array([1.2, 2.0]) - E)) ** (1 / b)
    boot = np.column_stack([np.full(boot_A.size, E), boot_A, np.full(boot_A.size, b)])
    return PowerLawFit(E, A, b, c_scale, compute, np.array([1.2, 2.0]), np.zeros(2),
                       boot_params=boot, reliable=True)


def test_a_savings_row_is_reliable_only_when_its_ci_excludes_zero() -> None:
    spread = np.linspace(-0.05, 0.05, 101)
    ref = _law_fit(1.0, 1.0 + spread)
    close = compare_fits(_law_fit(0.99, 0.99 + spread[::-1]), ref, n_grid=5)
    far = compare_fits(_law_fit(0.8, 0.8 + spread[::-1]), ref, n_grid=5)
    c = close.table.iloc[2]
    assert c["ci_low"] < 0 < c["ci_high"] and not c["reliable"] and "includes 0" in c["note"]
    assert not close.reliable
    f = far.table.iloc[2]
    assert f["ci_low"] > 0 and f["reliable"] and far.reliable


def test_the_frontier_bootstrap_draws_at_least_the_seed_noise() -> None:
    # an exact law: no residuals, so without the seeds' noise every refit is the fit
    compute = np.logspace(12, 15, 7)
    loss = 1.9 + 40 * compute**-0.16
    bare = fit_power_law(compute, loss, bootstrap=60, seed=0)
    noisy = fit_power_law(compute, loss, bootstrap=60, seed=0, seed_noise=0.004)
    bare_b, noisy_b = bare.ci["b"], noisy.ci["b"]
    assert bare_b[1] - bare_b[0] < 1e-6
    assert noisy_b[0] < 0.16 < noisy_b[1] and noisy_b[1] - noisy_b[0] > 0.01
    assert noisy.to_dict()["seed_noise_log"] == 0.004
