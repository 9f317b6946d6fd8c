"""Behaviour of hptransfer.analysis against independent references (closed forms, brute force)."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from scipy.optimize import brentq, minimize_scalar

from hptransfer.analysis import (
    AnalysisError,
    chinchilla_fit,
    compare_fits,
    compute_optimal_allocation,
    fit_chinchilla,
    fit_cubic_optimum,
    fit_lr_parabola,
    fit_power_law,
    fit_report,
    fit_slope,
    flop_savings,
    frontier_mask,
    group_by_size,
    loss_compute_frontier,
    optimal_aspect_ratio,
    optimal_lr,
    transfer_drift,
)
from hptransfer.analysis.basins import rival_basins

LOG2_GRID = np.arange(-12.0, -3.5, 1.0)  # lr = 2^-12 ... 2^-4


def trial_frame(rows: list[dict]) -> pd.DataFrame:
    """Complete trial rows with defaults for the columns a test does not care about."""
    defaults = {
        "arch": "gpt",
        "parameterization": "mup",
        "sigma_base": 0.02,
        "seed": 0,
        "status": "completed",
        "flops": np.nan,
        "tokens": np.nan,
        "params_non_embedding": np.nan,
        "params_embedding": 0,
    }
    frame = pd.DataFrame([{**defaults, **r} for r in rows])
    frame["trial_id"] = [f"t{i}" for i in range(len(frame))]
    return frame


def lr_sweep(
    vertex_log2: dict[tuple[str, int, int], float],
    *,
    seeds: int = 3,
    noise: float = 0.0,
    curvature: float = 0.05,
    grid: np.ndarray = LOG2_GRID,
    rng: np.random.Generator | None = None,
) -> pd.DataFrame:
    """Loss = 3 + curvature*(log2 lr - vertex)^2 (+ noise) for each (arm, width, depth)."""
    rng = rng or np.random.default_rng(0)
    rows = []
    for (arm, width, depth), v in vertex_log2.items():
        for x in grid:
            for s in range(seeds):
                loss = 3.0 + curvature * (x - v) ** 2 + rng.normal(0.0, noise)
                rows.append(
                    {
                        "arm": arm,
                        "width": width,
                        "depth": depth,
                        "lr": 2.0**x,
                        "seed": s,
                        "final_val_loss": loss,
                    }
                )
    return trial_frame(rows)


def assert_json_safe(obj: dict) -> None:
    json.dumps(obj, allow_nan=False)


# ------------------------------------------------------------------------ optimal LR


def test_exact_parabola_vertex_recovered_off_grid() -> None:
    truth = -7.37
    res = optimal_lr(lr_sweep({("a", 256, 4): truth}), bootstrap=0)
    row = res.shapes.iloc[0]
    assert abs(row["log2_lr_opt"] - truth) < 1e-6
    assert abs(row["lr_opt"] - 2.0**truth) / 2.0**truth < 1e-6
    assert abs(row["loss_at_opt"] - 3.0) < 1e-9
    assert row["best_lr"] == 2.0**-7
    assert row["edge"] is None and row["reliable"]
    assert row["n_fit_points"] == 5 and len(row["residuals"]) == 5
    assert max(abs(r) for r in row["residuals"]) < 1e-9
    single = fit_lr_parabola(2.0**LOG2_GRID, 3.0 + 0.05 * (LOG2_GRID - truth) ** 2)
    assert abs(single["log2_lr_opt"] - truth) < 1e-6 and single["fit_ok"]
    assert len(row["trial_ids"]) == 3 * len(LOG2_GRID)
    assert res.reason is None
    assert_json_safe(res.to_dict())


def test_bootstrap_ci_contains_truth_and_is_reproducible() -> None:
    truth = -8.6
    df = lr_sweep({("a", 256, 4): truth}, seeds=8, noise=0.004, rng=np.random.default_rng(3))
    first = optimal_lr(df, bootstrap=200, seed=11).shapes.iloc[0]
    again = optimal_lr(df, bootstrap=200, seed=11).shapes.iloc[0]
    assert first["log2_ci_low"] < truth < first["log2_ci_high"]
    assert first["log2_ci_low"] < first["log2_lr_opt"] < first["log2_ci_high"]
    assert first["log2_ci_high"] - first["log2_ci_low"] < 1.0
    assert first["log2_ci_low"] == again["log2_ci_low"]
    assert first["lr_ci_low"] == pytest.approx(2.0 ** first["log2_ci_low"])


def _delta_method_half(df: pd.DataFrame, fit_lrs: list[float], paired: bool = False) -> float:
    """Independent reference for η*'s CI half-width: least squares of a parabola in log2(lr)
    through the fitted LRs' mean losses, its vertex's variance by the delta method from the
    seed variance pooled over those LRs (each over its seed count), times the t quantile
    with the pooled degrees of freedom. `paired`: every LR ran the same seeds, and the
    variance is the residual of least squares on an effect per LR and one per seed."""
    by_lr = df.groupby("lr")["final_val_loss"]
    lrs = np.array(fit_lrs)
    mean, var, n = (by_lr.mean().loc[lrs].to_numpy(), by_lr.var(ddof=1).loc[lrs].to_numpy(),
                    by_lr.count().loc[lrs].to_numpy())
    dof = np.sum(n - 1)
    pooled = np.sum((n - 1) * var) / dof
    if paired:
        runs = df[df["lr"].isin(lrs)]
        effects = pd.get_dummies(runs["lr"].astype(str)).join(
            pd.get_dummies(runs["seed"].astype(str), prefix="s", drop_first=True))
        design_runs = effects.to_numpy(dtype=float)
        loss = runs["final_val_loss"].to_numpy()
        resid = loss - design_runs @ np.linalg.lstsq(design_runs, loss, rcond=None)[0]
        dof = len(runs) - design_runs.shape[1]
        pooled = np.sum(resid**2) / dof
    x = np.log2(lrs)
    design = np.stack([np.ones_like(x), x, x**2], axis=1)
    solve = np.linalg.solve(design.T @ design, design.T)  # coefficients = solve @ mean
    c = solve @ mean
    d_vertex = np.array([0.0, -1 / (2 * c[2]), c[1] / (2 * c[2] ** 2)]) @ solve
    return float(stats.t.ppf(0.975, dof) * np.sqrt(np.sum(d_vertex**2 * pooled / n)))


@pytest.mark.parametrize("paired", [True, False])
@pytest.mark.parametrize("seeds", [2, 3])
def test_eta_ci_has_the_delta_method_width_with_few_seeds(seeds: int, paired: bool) -> None:
    """With a well-curved bowl Fieller's interval is the delta method's: its half-width is
    t(dof) x the vertex's standard error from the seed variance: what is left after each
    seed's shift where every LR ran the same seeds, else pooled per LR. (The seed bootstrap
    it replaced was a z-interval from 1-2 degrees of freedom per LR: it covered the truth
    about 0.8 of the time at 95 % with 2 seeds.)"""
    ratios = []
    for rep in range(12):
        df = lr_sweep({("a", 256, 4): -8.4}, seeds=seeds, noise=0.01,
                      rng=np.random.default_rng(rep))
        if not paired:  # each LR its own seeds
            df["seed"] += 10 * np.log2(df["lr"]).round().astype(int) + 200
        row = optimal_lr(df).shapes.iloc[0]
        half = (row["log2_ci_high"] - row["log2_ci_low"]) / 2
        assert row["noise_dof"] == 5 * (seeds - 1)
        assert row["seeds_paired"] == paired
        assert row["eta_noise_dof"] == (4 * (seeds - 1) if paired else 5 * (seeds - 1))
        ratios.append(half / _delta_method_half(df, row["fit_lrs"], paired))
    assert 0.95 < np.median(ratios) < 1.05, ratios


def test_curve_spread_is_the_sample_std_and_unequal_seed_counts_bootstrap() -> None:
    """`std_loss` is each LR's sample standard deviation over its seeds (ddof 1). LRs with
    different seed counts (two seeds of LR 2^-5 failed) still give a narrow interval that
    holds η*: each LR resamples its own seeds only (drawing from the empty slots, 2^-5 looked
    like the best LR in most refits)."""
    df = lr_sweep({("a", 256, 4): -8.3}, seeds=4, noise=0.01, rng=np.random.default_rng(3))
    far = np.isclose(np.log2(df["lr"]), -5.0) & (df["seed"] >= 2)
    df = df[~far].reset_index(drop=True)
    res = optimal_lr(df, bootstrap=400, seed=0)
    curves = res.curves.set_index(np.log2(res.curves["lr"]).round(6))
    for x, cell in df.groupby(np.log2(df["lr"]).round(6)):
        assert curves.loc[x, "std_loss"] == pytest.approx(
            np.std(cell["final_val_loss"], ddof=1), rel=1e-9)
    assert curves.loc[-5.0, "n_completed"] == 2 and curves.loc[-9.0, "n_completed"] == 4
    row = res.shapes.iloc[0]
    assert math.isfinite(row["log2_ci_low"]) and math.isfinite(row["log2_ci_high"])
    assert row["log2_ci_low"] <= row["log2_lr_opt"] <= row["log2_ci_high"]
    assert row["log2_ci_high"] - row["log2_ci_low"] < 1.0


def test_lrs_that_differ_by_a_rounding_when_stored_are_one_grid_point() -> None:
    """Half the seeds' LRs written with 7 significant digits (a CSV from another tool) or
    through float32: each LR is still one cell with all its seeds, and η* is unchanged.
    Rounded to 6 decimals of log2, 22 of these 200 LRs were split in two cells."""
    lrs = 2.0 ** np.linspace(-12.0, -4.0, 200) * 1.0173  # off the powers of two
    stored = {1: lambda v: float(f"{v:.7g}"), 3: lambda v: float(np.float32(v))}
    rows = [{"arm": "a", "width": 256, "depth": 4, "seed": seed,
             "lr": stored[seed](lr) if seed in stored else float(lr),
             "final_val_loss": 3.0 + 0.05 * (math.log2(lr) + 8.3) ** 2 + 0.001 * seed}
            for lr in lrs for seed in range(4)]
    frame = trial_frame(rows)
    assert frame["lr"].nunique() > len(lrs)  # the round trip did move some LRs
    row = optimal_lr(frame, bootstrap=0).shapes.iloc[0]
    exact = optimal_lr(frame.assign(lr=np.repeat(lrs, 4)), bootstrap=0).shapes.iloc[0]
    assert row["n_lrs"] == len(lrs) and row["n_seeds"] == 4
    assert row["log2_lr_opt"] == pytest.approx(exact["log2_lr_opt"], abs=1e-6)


def test_no_ci_when_the_fitted_lrs_have_one_seed_each() -> None:
    """A second seed at an LR far from the optimum (outside the fit) adds no spread to η*:
    no interval, said why, rather than one of zero width."""
    df = lr_sweep({("a", 256, 4): -8.3}, seeds=1, noise=0.01, rng=np.random.default_rng(1))
    far = trial_frame([{"arm": "a", "width": 256, "depth": 4, "lr": 2.0**-12, "seed": 1,
                        "final_val_loss": 3 + 0.05 * 4.3**2 + 0.01}])
    far["trial_id"] = "far"
    row = optimal_lr(pd.concat([df, far], ignore_index=True), bootstrap=200).shapes.iloc[0]
    assert 2.0**-12 not in row["fit_lrs"] and row["n_seeds"] == 2
    assert np.isnan(row["log2_ci_low"]) and np.isnan(row["log2_ci_high"])
    # a number without a CI is not reliable, however sound its fit, and the row says why
    assert row["sound"] and not row["reliable"] and row["noise_dof"] == 0
    assert row["reason"].startswith("one seed per fitted LR: the loss noise between seeds")


@pytest.mark.parametrize(
    ("truth", "edge", "words"),
    [
        (-2.5, "high", "extend the LR grid above 0.0625"),
        (-13.5, "low", "extend the LR grid below 0.000244"),
    ],
)
def test_edge_flag_when_vertex_is_outside_the_grid(truth: float, edge: str, words: str) -> None:
    df = lr_sweep({("a", 256, 4): truth})
    row = optimal_lr(df, bootstrap=0).shapes.iloc[0]
    assert row["edge"] == edge
    assert not row["reliable"]
    assert any(words in w for w in row["warnings"])
    # η* is kept inside the tested LRs rather than extrapolated.
    assert LOG2_GRID.min() <= row["log2_lr_opt"] <= LOG2_GRID.max()
    # The CLI shows an unreliable η* rounded and marked, not as a precise-looking number.
    text = fit_report(df, bootstrap=0).format_text()
    assert f"~{row['lr_opt']:.2g}" in text and words in text
    # ... while the observed inputs on that row stay exact (they are not estimates)
    line = next(ln for ln in text.splitlines() if f"~{row['lr_opt']:.2g}" in ln)
    assert f" {row['best_lr']:.4g} " in line and " 0.02 " in line and "~0.02" not in line


def test_diverged_runs_are_excluded_but_counted() -> None:
    truth = -8.3
    clean = lr_sweep({("a", 256, 4): truth})
    blown = trial_frame(
        [
            {
                "arm": "a",
                "width": 256,
                "depth": 4,
                "lr": 2.0**x,
                "seed": s,
                "status": "diverged",
                "final_val_loss": 0.01,
            }  # a bogus loss on a diverged run must not be used
            for x in (-3.0, -2.0)
            for s in range(3)
        ]
        + [
            {
                "arm": "a",
                "width": 256,
                "depth": 4,
                "lr": 2.0**-8,
                "seed": 9,
                "final_val_loss": float("nan"),
            },  # completed but NaN: a silent divergence
            {
                "arm": "a",
                "width": 256,
                "depth": 4,
                "lr": 2.0**-8,
                "seed": 8,
                "status": "failed",
                "final_val_loss": 0.5,
            },  # failed runs are ignored entirely
        ]
    )
    res = optimal_lr(pd.concat([clean, blown], ignore_index=True), bootstrap=0)
    row = res.shapes.iloc[0]
    assert abs(row["log2_lr_opt"] - truth) < 1e-6
    assert row["n_diverged"] == 7
    assert row["n_completed"] == 3 * len(LOG2_GRID)
    assert row["n_lrs"] == len(LOG2_GRID) + 2
    assert row["edge"] is None  # the best LR is interior to the tested grid
    assert any("NaN/inf final_val_loss" in w for w in res.warnings)
    curve = res.curves.set_index("log2_lr")
    assert curve.loc[-3.0, "n_diverged"] == 3 and math.isnan(curve.loc[-3.0, "mean_loss"])


def test_partial_divergence_above_best_is_reported() -> None:
    df = lr_sweep({("a", 256, 4): -7.8})
    df.loc[np.isclose(np.log2(df["lr"]), -7.0) & (df["seed"] == 0), "status"] = "diverged"
    row = optimal_lr(df, bootstrap=0).shapes.iloc[0]
    assert any("next LR above the best diverged in 1 of 3" in w for w in row["warnings"])


def test_concave_curve_is_flagged_not_trusted() -> None:
    # Best at the top LR with a bump left of it: the fitted parabola opens downward.
    rows = [
        {"arm": "a", "width": 256, "depth": 4, "lr": 2.0**x, "final_val_loss": loss}
        for x, loss in zip((-10, -9, -8, -7), (3.30, 3.05, 3.10, 3.00), strict=True)
    ]
    row = optimal_lr(trial_frame(rows), bootstrap=0).shapes.iloc[0]
    assert row["concave"] and not row["reliable"]
    assert row["lr_opt"] == 2.0**-7
    assert any("opens downward" in w for w in row["warnings"])


# An SP 64 x 1 Optuna study at 100 steps (tests/test_optuna_search.py), log2 LR -> final loss:
# the first batch and the refinement around its best. The curve dips at 2^-6.52 and 2^-4.02
# (and 2^-9.02) to within 0.004 of each other, with 2^-5.27 0.24 above both; the grid puts
# η* near 2^-7.5 (3.16), and the parabola through 2^-5.27, 2^-4.02 and 2^-3 (vertex
# 2^-4.19) trained to 3.51.
SP64_SEARCH = {-11.52: math.nan, -9.02: 3.385334, -6.52: 3.382391, -5.27: 3.626345,
               -4.02: 3.381978, -3.0: 3.681906}


def test_rival_basins_are_dips_as_deep_as_the_best_behind_a_worse_lr() -> None:
    x, y = list(SP64_SEARCH), list(SP64_SEARCH.values())
    # the best is 2^-4.02; 2^-6.52 and 2^-9.02 lie behind 2^-5.27's bump, lowest first
    assert [x[i] for i in rival_basins(x, y)] == [-6.52, -9.02]
    # the grid of the same shape: its second dip (2^-4) is 6.5 % above the best, no rival
    grid = {-9: 3.383, -8: 3.165, -7: 3.161, -6: 3.354, -5: 3.502, -4: 3.365, -3: 3.682}
    assert rival_basins(list(grid), list(grid.values())) == []
    # one flat, noisy valley: the LRs between never rise more than 1 % above the ends
    flat = [3.30, 3.17, 3.16, 3.19, 3.162, 3.40]
    assert rival_basins(range(6), flat) == []
    # behind a bump: 0.5 % above the best is a rival, 1.5 % is not; the margin is relative
    assert rival_basins(range(4), [3.0, 3.5, 3.015, 3.6]) == [2]
    assert rival_basins(range(4), [3.0, 3.5, 3.045, 3.6]) == []
    assert rival_basins(range(4), [30.0, 35.0, 30.15, 36.0]) == [2]
    assert rival_basins(range(3), [3.0, 3.5, 3.01]) == [2]  # three LRs are enough for one
    # each side scanned outward from the best: a rival behind two bumps counts as one
    # behind the nearer bump does
    assert rival_basins(range(5), [3.005, 3.6, 3.01, 3.5, 3.0]) == [0, 2]
    # a diverged LR (NaN) is no bump; fewer than three completed LRs have no basins
    assert rival_basins(range(4), [3.0, math.nan, 3.01, 3.6]) == []
    assert rival_basins(range(3), [3.0, 3.5, math.nan]) == []
    with pytest.raises(ValueError, match="ascending"):
        rival_basins([1.0, 0.0, 2.0], [3.0, 3.1, 3.2])


def test_a_fit_with_a_rival_basin_is_unreliable_and_says_where() -> None:
    rows = [{"arm": "sp", "width": 64, "depth": 1, "lr": 2.0**x, "final_val_loss": v,
             **({"status": "diverged"} if math.isnan(v) else {})}
            for x, v in SP64_SEARCH.items()]
    row = optimal_lr(trial_frame(rows), bootstrap=0, neighbours=1).shapes.iloc[0]
    # the parabola itself is fine: three points, convex, vertex inside (2^-4.19)
    assert row["log2_lr_opt"] == pytest.approx(-4.19, abs=0.01)
    assert row["n_fit_points"] == 3 and not row["concave"] and not row["clamped"]
    assert row["edge"] is None
    assert not row["reliable"] and not row["sound"]  # the rival alone: one seed is not why
    assert math.log2(row["rival_lr"]) == pytest.approx(-6.52)
    (note,) = [w for w in row["warnings"] if w.startswith("two basins")]
    assert "0.0109" in note and "3.382" in note  # the rival's LR and its loss
    # the point the search then asked, half a slice below the rival, trained to 3.16: one
    # basin, 0.07 below the rest, and a sound η* between 2^-9.02 and 2^-6.52 (one seed:
    # no CI, so not reliable)
    rows.append({"arm": "sp", "width": 64, "depth": 1, "lr": 2.0**-7.77, "final_val_loss": 3.16})
    row = optimal_lr(trial_frame(rows), bootstrap=0, neighbours=1).shapes.iloc[0]
    assert row["sound"] and np.isnan(row["rival_lr"])
    assert not row["reliable"] and row["reason"].startswith("one seed per fitted LR")
    assert -9.02 < row["log2_lr_opt"] < -6.52
    assert not any(w.startswith("two basins") for w in row["warnings"])
    # one curve, as fit_lr_parabola takes it: the same rival, and none with 2^-7.77
    one = fit_lr_parabola([2.0**x for x in SP64_SEARCH], list(SP64_SEARCH.values()), 1)
    assert one["log2_lr_opt"] == pytest.approx(-4.19, abs=0.01)
    assert math.log2(one["rival_lr"]) == pytest.approx(-6.52)
    both = fit_lr_parabola([r["lr"] for r in rows], [r["final_val_loss"] for r in rows], 1)
    assert math.isnan(both["rival_lr"]) and both["log2_lr_opt"] == pytest.approx(
        row["log2_lr_opt"])


# ------------------------------------------------------------------------ transfer


def drift_sweep(rng: np.random.Generator) -> pd.DataFrame:
    vertices = {}
    for w in (128, 256, 512, 1024):
        for d in (2, 4, 8):
            vertices[("sp", w, d)] = -8.0 - math.log2(w / 256)  # η* ∝ 1/width
            vertices[("completep", w, d)] = -8.0  # η* constant
    return lr_sweep(vertices, seeds=4, noise=0.002, rng=rng, grid=np.arange(-13.0, -3.5, 0.5))


def test_transfer_slopes_recover_known_drift() -> None:
    opt = optimal_lr(drift_sweep(np.random.default_rng(5)), bootstrap=0)
    res = transfer_drift(opt)
    table = res.to_frame().set_index(["arm", "axis"])
    sp, cp = table.loc[("sp", "width")], table.loc[("completep", "width")]
    assert sp["ci_low"] <= -1.0 <= sp["ci_high"] and abs(sp["slope"] + 1) < 0.05
    assert cp["ci_low"] <= 0.0 <= cp["ci_high"] and abs(cp["slope"]) < 0.05
    assert sp["verdict"] == "drifts" and cp["verdict"] == "transfers"
    assert abs(sp["max_shift_log2"] - 3.0) < 0.1  # 128 -> 1024 is 3 doublings
    for arm in ("sp", "completep"):
        depth = table.loc[(arm, "depth")]
        assert depth["ci_low"] <= 0.0 <= depth["ci_high"]
    assert sp["dof"] == 12 - 3 - 1  # 12 shapes, one intercept per depth, one slope
    assert len(sp["residuals"]) == 12 and len(sp["trial_ids"]) > 0
    assert_json_safe(res.to_dict())


def test_transfer_detects_positive_drift() -> None:
    # η* that rises with the model (as CompleteP's did with depth at a short horizon, issue
    # 51): +0.5 octave per width doubling, +0.25 per depth doubling. The verdict's
    # `ci_low > 0` branch is the only thing that can call this a drift.
    vertices = {("up", w, d): -8.0 + 0.5 * math.log2(w / 256) + 0.25 * math.log2(d / 2)
                for w in (128, 256, 512, 1024) for d in (2, 4, 8)}
    res = transfer_drift(lr_sweep(vertices, seeds=4, noise=0.002,
                                  rng=np.random.default_rng(11),
                                  grid=np.arange(-13.0, -3.5, 0.5)))
    table = res.to_frame().set_index("axis")
    for axis, truth in (("width", 0.5), ("depth", 0.25)):
        row = table.loc[axis]
        assert row["slope"] == pytest.approx(truth, abs=0.05)
        assert 0.0 < row["ci_low"] <= truth <= row["ci_high"]
        assert row["verdict"] == "drifts", (axis, row["ci_low"], row["ci_high"])
        assert row["reliable"]


def test_slope_and_ci_match_dummy_variable_regression() -> None:
    rng = np.random.default_rng(2)
    x = np.tile(np.arange(5.0), 3)
    groups = np.repeat([0, 1, 2], 5)
    y = -0.7 * x + np.array([0.3, -1.0, 2.0])[groups] + rng.normal(0, 0.05, len(x))
    fit = fit_slope(x, y, groups)
    design = np.column_stack([x, *(groups == g for g in range(3))]).astype(float)
    coef, rss, *_ = np.linalg.lstsq(design, y, rcond=None)
    dof = len(x) - 4
    cov = rss[0] / dof * np.linalg.inv(design.T @ design)
    assert fit.slope == pytest.approx(coef[0], abs=1e-12)
    assert fit.stderr == pytest.approx(math.sqrt(cov[0, 0]), rel=1e-9)
    assert fit.dof == dof
    # the 95 % interval: Student's t at 11 degrees of freedom (2.2010, from the tables)
    t_975_11 = 2.200985160091639
    assert fit.ci_high - fit.slope == pytest.approx(t_975_11 * fit.stderr, rel=1e-9)
    assert fit.slope - fit.ci_low == pytest.approx(t_975_11 * fit.stderr, rel=1e-9)


def test_single_width_gives_a_reason_for_the_width_axis() -> None:
    df = lr_sweep({("a", 256, d): -8.0 for d in (2, 4, 8)})
    res = transfer_drift(df)
    rows = res.to_frame().set_index("axis")
    assert rows.loc["width", "reason"] == (
        "not enough data for width transfer of arm=a, sigma_base=0.02 because only one width "
        "(256) has a fitted η*"
    )
    assert rows.loc["depth", "reason"] is None
    assert not res.reliable
    report = fit_report(df, bootstrap=5)
    assert report.failures == {}
    assert_json_safe(report.to_dict())
    assert "only one width (256)" in report.format_text()


# ------------------------------------------------------------------------ loss vs compute


def test_power_law_parameters_recovered() -> None:
    rng = np.random.default_rng(1)
    E, A, b = 1.8, 300.0, 0.12
    c = np.logspace(15, 21, 15)
    loss = (E + A * c**-b) * np.exp(rng.normal(0, 0.001, c.size))
    fit = fit_power_law(c, loss, bootstrap=100, seed=0)
    assert fit.reliable
    assert fit.E == pytest.approx(E, abs=0.03)
    assert fit.b == pytest.approx(b, rel=0.03)
    assert fit.ci["E"][0] <= E <= fit.ci["E"][1]
    assert fit.ci["b"][0] <= b <= fit.ci["b"][1]
    assert np.max(np.abs(fit.residuals)) < 0.01
    assert_json_safe(fit.to_dict())


@pytest.mark.parametrize("loss_decimals", [None, 1])
def test_frontier_mask_matches_brute_force(loss_decimals: int | None) -> None:
    """A point is on the frontier when no point of its group at most as costly has a loss at
    most as low, ties in both broken by the order given (of exact duplicates one stays);
    rounded losses make such ties."""
    rng = np.random.default_rng(4)
    n = 200
    c = rng.uniform(1, 30, n).round()
    loss = rng.uniform(2, 4, n)
    if loss_decimals is not None:
        loss = loss.round(loss_decimals)
    groups = rng.integers(0, 3, n)
    idx = np.arange(n)
    expected = np.array([
        not np.any((groups == groups[i]) & (loss <= loss[i]) & (
            (c < c[i]) | ((c == c[i]) & ((loss < loss[i]) | (idx < i)))))
        for i in range(n)
    ])
    mask = frontier_mask(c, loss, groups)
    assert np.array_equal(mask, expected)
    if loss_decimals is not None:  # ties were there to break
        same = pd.DataFrame({"g": groups, "c": c, "l": loss}).duplicated(keep=False)
        assert same.any() and mask[same.to_numpy()].sum() < same.sum()


def power_law_frame(arms: dict[str, tuple[float, float, float]],
                    noise: float = 0.0) -> pd.DataFrame:
    """Shapes at a single LR whose loss follows each arm's L(C) = E + A*C^-b (times a
    deterministic relative error of about `noise`)."""
    rows = []
    wiggle = noise * np.array([1, -1, 0.5, -0.5, 1, -1, 0.3, -0.8, 0.6])
    for arm, (E, A, b) in arms.items():
        for i, c in enumerate(np.logspace(17, 21, 9)):
            rows.append(
                {
                    "arm": arm,
                    "width": 128 * (i + 1),
                    "depth": 4,
                    "lr": 1e-3,
                    "flops": c,
                    "final_val_loss": (E + A * c**-b) * (1 + wiggle[i]),
                }
            )
        # A dominated point (more compute, worse loss) must not enter the fit.
        rows.append(
            {
                "arm": arm,
                "width": 64,
                "depth": 64,
                "lr": 1e-3,
                "flops": 1e21,
                "final_val_loss": 10.0,
            }
        )
    return trial_frame(rows)


def test_savings_match_closed_form_inverse() -> None:
    laws = {"completep": (1.7, 250.0, 0.11), "mup": (1.75, 260.0, 0.105)}
    frontier = loss_compute_frontier(power_law_frame(laws), bootstrap=30, seed=0)
    assert frontier.fits["mup"].compute.size == 9  # the dominated shape is off the frontier
    res = flop_savings(frontier, "mup", n_grid=7)
    table = res.comparisons["completep"].table

    def compute_for(law: tuple[float, float, float], loss: np.ndarray) -> np.ndarray:
        E, A, b = law
        return (A / (loss - E)) ** (1.0 / b)

    expected = 1 - compute_for(laws["completep"], table["loss"]) / compute_for(
        laws["mup"], table["loss"]
    )
    np.testing.assert_allclose(table["savings"], expected, atol=2e-3)
    lo = max(frontier.fits[a].loss_range[0] for a in laws)
    hi = min(frontier.fits[a].loss_range[1] for a in laws)
    assert table["loss"].min() == pytest.approx(lo) and table["loss"].max() == pytest.approx(hi)
    # exact points: every bootstrap refit is the same curve, so no interval (zero width
    # would read as certainty), the reason is given and the comparison is not `reliable`
    comp = res.comparisons["completep"]
    assert table["ci_low"].isna().all() and table["ci_high"].isna().all()
    assert comp.no_ci and not comp.reliable
    assert_json_safe(res.to_dict())


def test_savings_ci_from_noisy_points_brackets_the_estimate() -> None:
    laws = {"completep": (1.7, 250.0, 0.11), "mup": (1.75, 260.0, 0.105)}
    frontier = loss_compute_frontier(power_law_frame(laws, noise=0.003), bootstrap=60, seed=0)
    comp = flop_savings(frontier, "mup", n_grid=7).comparisons["completep"]
    assert comp.no_ci is None
    table = comp.table
    assert (table["ci_high"] - table["ci_low"] > 1e-4).all()  # a real, non-zero width
    assert (table["ci_low"] <= table["savings"] + 1e-9).all()
    assert (table["savings"] <= table["ci_high"] + 1e-9).all()
    head = comp.headline()
    assert head["ci_low"] < head["savings"] < head["ci_high"]


def test_savings_refuse_to_extrapolate() -> None:
    c = np.logspace(17, 21, 9)
    low = fit_power_law(c, 1.7 + 250.0 * c**-0.11, bootstrap=0)
    other = fit_power_law(c, 1.75 + 260.0 * c**-0.105, bootstrap=0)
    lo, hi = (
        max(low.loss_range[0], other.loss_range[0]),
        min(low.loss_range[1], other.loss_range[1]),
    )
    comp = compare_fits(low, other, arm="x", reference="y", losses=[lo - 0.05, (lo + hi) / 2])
    assert math.isnan(comp.table["savings"].iloc[0])
    assert "refusing to extrapolate" in comp.table["note"].iloc[0]
    assert np.isfinite(comp.table["savings"].iloc[1]) and comp.table["note"].iloc[1] is None
    outside = compare_fits(low, other, arm="x", reference="y", losses=[hi + 1.0])
    assert outside.reason is not None
    assert str(outside.reason).startswith(
        "not enough data for FLOP savings of x vs y because "
        "every requested loss is outside the range"
    )
    # Disjoint loss ranges: nothing to compare at all.
    far = fit_power_law(c, 5.0 + 250.0 * c**-0.11, bootstrap=0)
    disjoint = compare_fits(far, other, arm="far", reference="y")
    assert "do not overlap" in str(disjoint.reason)
    assert "refusing to extrapolate" in str(disjoint.reason)


# ------------------------------------------------------------------------ aspect ratio


def test_cubic_argmin_and_band_recovered() -> None:
    x0 = math.log(11.8)
    rows = []
    for depth in (4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128):
        width = round(math.sqrt(1e7 / depth))  # ~ fixed params 12*N^2*L = 1.2e8
        u = math.log(width / depth) - x0
        for seed, spread in enumerate((0.002, -0.002)):  # two seeds: their mean on the cubic
            rows.append(
                {
                    "arm": "completep",
                    "width": width,
                    "depth": depth,
                    "lr": 1e-3,
                    "seed": seed,
                    "params_non_embedding": 12 * width**2 * depth,
                    "final_val_loss": 3.0 + 0.02 * u**2 + 0.002 * u**3 + spread,
                }
            )
    res = optimal_aspect_ratio(trial_frame(rows))
    assert res.reason is None
    row = res.to_frame().iloc[0]
    assert row["n_points"] == 11 and row["reliable"]
    assert row["nl_opt"] == pytest.approx(11.8, rel=1e-6)
    # its CI holds the seeds' noise (sd 0.0028 per loss, 0.002 per mean of two)
    assert row["noise_sd"] == pytest.approx(0.002, rel=1e-6)
    assert row["nl_ci_low"] < 11.8 < row["nl_ci_high"]
    # one seed: the same means, no noise measured, so no CI and not reliable
    one = optimal_aspect_ratio(trial_frame(rows[::2])).to_frame().iloc[0]
    assert math.isnan(one["nl_ci_low"]) and not one["reliable"]
    assert any(w.startswith("one seed per point") for w in one["warnings"])

    # Band edges from the analytic cubic: 0.02u^2 + 0.002u^3 = 0.01 * 3.
    def excess(u: float) -> float:
        return 0.02 * u**2 + 0.002 * u**3 - 0.03

    u_lo, u_hi = brentq(excess, -5, 0), brentq(excess, 0, 5)
    assert row["nl_within_low"] == pytest.approx(math.exp(x0 + u_lo), rel=1e-3)
    assert row["nl_within_high"] == pytest.approx(math.exp(x0 + u_hi), rel=1e-3)
    assert_json_safe(res.to_dict())


def test_cubic_optimum_at_range_edge_is_flagged() -> None:
    x = np.linspace(0, 3, 7)
    fit = fit_cubic_optimum(x, 3 - 0.1 * x + 0.001 * x**3)
    assert fit.edge == "high" and fit.x_opt == pytest.approx(3.0)


def test_size_groups_within_tolerance_of_median() -> None:
    labels = group_by_size(np.array([100, 110, 95, 200, 212, 400, 90]), tolerance=0.15)
    assert labels == [0, 0, 0, 1, 1, 2, 0]
    # the upper bound: 125 is 25 % above the median of 100, 114 is within 15 %
    assert group_by_size(np.array([100, 100, 100, 125]), tolerance=0.15) == [0, 0, 0, 1]
    assert group_by_size(np.array([100, 100, 100, 114]), tolerance=0.15) == [0, 0, 0, 0]


def test_cubic_band_edges_are_the_last_grid_points_within_the_band() -> None:
    """The band [x_low, x_high] where the cubic is within 1 % of its minimum ends at the
    last grid point inside it on each side: against the cubic's own roots (brentq)."""
    x = np.linspace(-3.0, 3.0, 9)
    loss = 3.0 + 0.2 * x**2 + 0.02 * x**3
    fit = fit_cubic_optimum(x, loss, within=0.01)
    assert fit.edge is None and fit.x_opt == pytest.approx(0.0, abs=1e-9)
    level = fit.loss_opt * 1.01

    def excess(v: float) -> float:
        return float(np.polyval(fit.coefficients, v - fit.x_center)) - level

    low, high = brentq(excess, -3.0, 0.0), brentq(excess, 0.0, 3.0)
    step = 6.0 / 4000  # the band's grid
    assert low <= fit.x_low < low + step
    assert high - step < fit.x_high <= high


# ------------------------------------------------------------------------ chinchilla

CHINCHILLA = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}


def test_chinchilla_constants_recovered() -> None:
    rng = np.random.default_rng(0)
    n, d = (g.ravel() for g in np.meshgrid(np.logspace(7, 10, 8), np.logspace(9, 12, 8)))
    p = CHINCHILLA
    loss = (p["E"] + p["A"] / n ** p["alpha"] + p["B"] / d ** p["beta"]) * np.exp(
        rng.normal(0, 1e-4, n.size)
    )
    fit = fit_chinchilla(n, d, loss)
    assert fit.reliable, fit.warnings
    assert fit.alpha == pytest.approx(p["alpha"], abs=0.02)
    assert fit.beta == pytest.approx(p["beta"], abs=0.02)
    assert fit.E == pytest.approx(p["E"], abs=0.02)
    assert fit.A == pytest.approx(p["A"], rel=0.1) and fit.B == pytest.approx(p["B"], rel=0.1)
    assert np.max(np.abs(fit.residuals)) < 1e-3
    assert_json_safe(fit.to_dict())


@pytest.mark.parametrize("compute", [1e19, 1e21, 1e23, 5.76e23])
def test_compute_optimal_frontier_matches_brute_force(compute: float) -> None:
    p = CHINCHILLA

    def loss_at(log_n: float) -> float:
        n = math.exp(log_n)
        return p["E"] + p["A"] / n ** p["alpha"] + p["B"] / (compute / (6 * n)) ** p["beta"]

    brute = minimize_scalar(
        loss_at,
        bounds=(math.log(1e3), math.log(compute / 6) - 1),
        method="bounded",
        options={"xatol": 1e-10},
    )
    n_opt, d_opt = compute_optimal_allocation(
        compute, A=p["A"], B=p["B"], alpha=p["alpha"], beta=p["beta"]
    )
    assert float(n_opt) == pytest.approx(math.exp(brute.x), rel=1e-5)
    assert float(n_opt * d_opt) * 6 == pytest.approx(compute, rel=1e-12)


def test_an_allocation_past_floats_range_is_infinite_without_a_warning() -> None:
    """A bootstrap refit with A near 0 (the demo's SP arm: α at its bound, A ~ 1e-11) puts
    D_opt past float's range; the demo's report printed numpy's overflow warning for it."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        n_opt, d_opt = compute_optimal_allocation(4e12, A=1e-300, B=9.0, alpha=0.001, beta=0.11)
    assert float(d_opt) == math.inf
    assert float(n_opt) == 0.0


def test_a_frame_with_several_budgets_per_shape_fits_each_budget_as_a_point() -> None:
    """Closed-form L(N, D) on 12 shapes x 3 budgets (5, 20, 80 tokens per parameter), an LR
    grid each: the compute fits take 36 points and recover the constants. Averaged as if
    the budgets were seeds (as they were), a shape was one point at its mean tokens and the
    fit was refused as "tokens per parameter is the same for every run"."""
    p = CHINCHILLA
    rows = []
    for width in (128, 256, 512, 1024):
        for depth in (2, 4, 8):
            n = 12.0 * width**2 * depth
            for tpp in (5.0, 20.0, 80.0):
                d = tpp * n
                loss = p["E"] + p["A"] / n ** p["alpha"] + p["B"] / d ** p["beta"]
                rows += [{"arm": "a", "width": width, "depth": depth, "lr": 2.0**x, "tokens": d,
                          "flops": 6 * n * d, "params_non_embedding": n,
                          "final_val_loss": loss + 0.01 * (x + 8) ** 2}
                         for x in (-10.0, -9.0, -8.0, -7.0, -6.0)]
    frame = trial_frame(rows)
    for fit in (chinchilla_fit(frame).to_frame().iloc[0],
                fit_report(frame, bootstrap=0).tables()["chinchilla"].iloc[0]):
        assert fit["n_points"] == 36, fit["reason"]
        assert fit["alpha"] == pytest.approx(p["alpha"], abs=1e-3)
        assert fit["beta"] == pytest.approx(p["beta"], abs=1e-3)
        assert fit["E"] == pytest.approx(p["E"], abs=1e-3)
    assert any("several token budgets" in w for w in fit_report(frame, bootstrap=0).warnings)


def test_a_tie_between_budgets_keeps_the_smallest_tokens_per_parameter() -> None:
    """Two shapes at 20 tokens per parameter and two at 80: as many at each, so the group
    is compared at the smaller budget (the larger one set aside, and said so)."""
    from hptransfer.analysis.aspect_ratio import _one_budget_per_group

    n = np.array([1e7, 1.02e7, 0.98e7, 1.01e7])
    points = pd.DataFrame({"arm": "cp", "group": 0, "params": n,
                           "tokens": n * np.array([80.0, 20.0, 80.0, 20.0])})
    for order in (slice(None), slice(None, None, -1)):  # whichever comes first
        kept, notes = _one_budget_per_group(points.iloc[order])
        assert sorted(kept.index) == [1, 3]
        assert len(notes) == 1 and "compared at 20 tokens per parameter only (2 set aside)" \
            in notes[0], notes


def test_aspect_ratio_compares_a_size_group_at_one_budget() -> None:
    """Nine shapes of 1e7 params at 20 tokens per parameter, one of them also at 80 (a lower
    loss at any N:L): N:L is the 20-token optimum, with the longer run set aside and said
    so. Mixed in, it pulled N:L from 11.8 to 13.0."""
    x0, rows = math.log(11.8), []
    for depth in (4, 6, 8, 12, 16, 24, 32, 48, 64):
        width = round(math.sqrt(1e7 / depth))
        n, u = 12 * width**2 * depth, math.log(width / depth) - x0
        for tpp in [20.0] + ([80.0] if depth == 32 else []):
            loss = 3.0 + 0.2 * u**2 + 0.02 * u**3 - (0.2 if tpp == 80 else 0.0)
            rows += [{"arm": "cp", "width": width, "depth": depth, "lr": 2.0**x,
                      "tokens": tpp * n, "params_non_embedding": n,
                      "final_val_loss": loss + 0.01 * (x + 8) ** 2} for x in (-10, -9, -8, -7, -6)]
    result = optimal_aspect_ratio(trial_frame(rows))
    row = result.to_frame().iloc[0]
    assert row["nl_opt"] == pytest.approx(11.8, rel=1e-3) and row["n_points"] == 9
    assert any("compared at 20 tokens per parameter only (1 set aside)" in w
               for w in result.warnings), result.warnings



@pytest.mark.parametrize("tpps", [
    (20.05, 20.10) * 4,  # 0.25 % apart, across a fixed 1 % bin's edge (20.086)
    (20.00, 20.05) * 4,  # the same spread inside one such bin
])
def test_aspect_ratio_budgets_apart_by_whole_batch_rounding_are_one(tpps) -> None:
    """Trained to 20 tokens per parameter in whole batches, shapes land a little above it;
    fixed 1 % bins split 20.05 from 20.10 (half the shapes set aside, N:L from 4 ratios)."""
    x0, rows = math.log(11.8), []
    for depth, tpp in zip((4, 6, 8, 12, 16, 24, 32, 48), tpps, strict=True):
        width = round(math.sqrt(1e7 / depth))
        n, u = 12 * width**2 * depth, math.log(width / depth) - x0
        rows += [{"arm": "cp", "width": width, "depth": depth, "lr": 2.0**x,
                  "tokens": tpp * n, "params_non_embedding": n,
                  "final_val_loss": 3.0 + 0.2 * u**2 + 0.02 * u**3 + 0.01 * (x + 8) ** 2}
                 for x in (-10, -9, -8, -7, -6)]
    result = optimal_aspect_ratio(trial_frame(rows))
    row = result.to_frame().iloc[0]
    assert not any("set aside" in w for w in result.warnings), result.warnings
    assert row["n_points"] == 8 and row["nl_opt"] == pytest.approx(11.8, rel=1e-3)


def test_aspect_ratio_shapes_trained_the_same_tokens_are_at_one_budget() -> None:
    """A budget in steps trains every shape the same tokens; the shapes' sizes differ within
    the group's tolerance (here +-6 %), so their tokens per parameter do too, and all but
    one budget's shapes were set aside (N:L refused: "fewer than 4 aspect ratios")."""
    x0, rows = math.log(11.8), []
    for depth, size in zip((4, 6, 8, 12, 16, 24), (0.94, 1.06, 1.0, 0.96, 1.04, 1.0),
                           strict=True):
        width = round(math.sqrt(1e7 * size / depth))
        n, u = 12 * width**2 * depth, math.log(width / depth) - x0
        rows += [{"arm": "cp", "width": width, "depth": depth, "lr": 2.0**x,
                  "tokens": 2.0e8, "params_non_embedding": n,
                  "final_val_loss": 3.0 + 0.2 * u**2 + 0.02 * u**3 + 0.01 * (x + 8) ** 2}
                 for x in (-10, -9, -8, -7, -6)]
    result = optimal_aspect_ratio(trial_frame(rows))
    assert result.set_aside == [] and result.to_frame().iloc[0]["n_points"] == 6
    # shapes truly trained longer are still set aside, and the report's text says so
    rows += [{**r, "tokens": 8.0e8, "final_val_loss": r["final_val_loss"] - 0.2}
             for r in rows if r["depth"] == 8]
    report = fit_report(trial_frame(rows), bootstrap=0)
    assert len(report.aspect_ratio.set_aside) == 1 and "(1 set aside)" in (
        report.aspect_ratio.set_aside[0])
    assert f"warning: {report.aspect_ratio.set_aside[0]}" in report.format_text()

def test_chinchilla_refuses_constant_tokens_per_parameter() -> None:
    n = np.logspace(7, 10, 10)
    fit = fit_chinchilla(n, 20 * n, 1.7 + 400 / n**0.34 + 400 / (20 * n) ** 0.28)
    assert not fit.ok
    assert str(fit.reason).startswith(
        "not enough data for the Chinchilla fit because tokens per parameter is the same"
    )


# ------------------------------------------------------------------------ bad data


def test_fit_slope_skips_non_finite_points_and_keeps_a_missing_group_label() -> None:
    """Two groups with the same slope 0.5 and their own intercepts, one labelled NaN, plus a
    point with a NaN y: the slope is exact, the NaN point ignored (a NaN group label made
    an IndexError before, a NaN y a NaN slope)."""
    x = np.array([1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 4.0])
    y = 0.5 * x + np.array([0, 0, 0, 7, 7, 7, 0.0])
    y[-1] = np.nan
    fit = fit_slope(x, y, np.array(["a", "a", "a", np.nan, np.nan, np.nan, "a"], dtype=object))
    assert fit.slope == pytest.approx(0.5, abs=1e-12) and fit.n_points == 6 and fit.n_levels == 2


@pytest.mark.parametrize("bad", [0.0, -1e-3, math.inf, math.nan])
def test_fit_lr_parabola_refuses_an_lr_without_a_logarithm(bad: float) -> None:
    with pytest.raises(AnalysisError, match="every lr must be positive and finite"):
        fit_lr_parabola([bad, 1e-3, 2e-3, 4e-3], [3.1, 3.0, 2.9, 3.0])
    with pytest.raises(AnalysisError, match="one length"):
        fit_lr_parabola([1e-3, 2e-3], [3.0])



def test_repeated_lrs_are_refused_or_not_fitted_never_a_numpy_error() -> None:
    """An LR given once per seed: with neighbours=1 the window held 2 distinct LRs and the
    3x3 normal equations were singular (numpy's LinAlgError escaped)."""
    from hptransfer.analysis.parabola import fit_parabolas

    x = np.repeat([-10.0, -9.0, -8.0, -7.0], 2)
    y = 3.0 + 0.05 * (x + 8.6) ** 2
    with pytest.raises(AnalysisError, match="each lr once, with its mean loss: lr 0.00.* "
                                            "appears 2 times"):
        fit_lr_parabola(2.0**x, y, neighbours=1)
    fits = fit_parabolas(x[None, :], y[None, :], neighbours=1)  # 2 distinct LRs in its window
    assert not fits.fit_ok[0] and np.isnan(fits.log2_opt[0])
    fits = fit_parabolas(x[None, :], y[None, :], neighbours=2)  # 3 distinct: the vertex
    assert fits.fit_ok[0] and fits.log2_opt[0] == pytest.approx(-8.6)

def test_missing_columns_raise_a_clear_error() -> None:
    df = lr_sweep({("a", 256, 4): -8.0}).drop(columns=["lr", "seed"])
    with pytest.raises(AnalysisError, match=r"^missing required columns: lr, seed \(the frame"):
        optimal_lr(df)
    with pytest.raises(AnalysisError, match="expected a pandas DataFrame"):
        optimal_lr([1, 2, 3])  # type: ignore[arg-type]
    report = fit_report(df)
    assert report.error.startswith("missing required columns: lr, seed")
    assert "missing required columns" in report.format_text()
    assert_json_safe(report.to_dict())
    assert all(t.empty for t in report.tables().values())


def test_missing_flops_column_is_an_error_for_the_frontier_only() -> None:
    df = lr_sweep({("a", 256, 4): -8.0}).drop(columns=["flops"])
    with pytest.raises(AnalysisError, match="missing required columns: flops"):
        loss_compute_frontier(df)
    report = fit_report(df, bootstrap=0)
    assert report.optimal_lr is not None and report.optimal_lr.reason is None
    assert "no shape has a completed run with a recorded flops value" in str(report.frontier.reason)


def test_empty_frame() -> None:
    df = lr_sweep({("a", 256, 4): -8.0}).iloc[:0]
    res = optimal_lr(df)
    assert str(res.reason) == "not enough data for the optimal LR because there are no trials"
    assert res.to_frame().empty
    assert str(transfer_drift(res).reason).startswith("not enough data for transfer drift")
    report = fit_report(df)
    assert report.failures == {}
    assert_json_safe(report.to_dict())
    assert set(report.tables()) == {
        "optimal_lr",
        "transfer",
        "transfer_check",
        "frontier",
        "savings",
        "aspect_ratio",
        "chinchilla",
    }
    report.format_text()


def test_a_study_with_nothing_trained_yet_reports_not_enough_data_not_a_failure() -> None:
    """The frontier and L(N, D) key shapes by the tokens trained, a point column too: with no
    completed trial their empty table once held `tokens` twice, and both fits failed."""
    from hptransfer.analysis.study_report import study_fit_report

    df = lr_sweep({("a", 64, 2): -8.0, ("a", 128, 2): -8.0}).assign(status="pending")
    df["stage"] = ["tune", "transfer"] * (len(df) // 2) + ["tune"] * (len(df) % 2)
    report = study_fit_report(df, bootstrap=0)
    assert report.failures == {}
    assert "not enough data" in str(report.frontier.reason)
    assert "not enough data" in str(report.chinchilla.reason)


def test_all_diverged() -> None:
    df = lr_sweep({("a", 256, 4): -8.0})
    df["status"] = "diverged"
    res = optimal_lr(df)
    assert str(res.reason) == (
        f"not enough data for the optimal LR because all {len(df)} finished trials diverged"
    )
    report = fit_report(df, bootstrap=10)
    assert report.failures == {}
    assert_json_safe(report.to_dict())


def test_one_shape_all_diverged_among_good_ones() -> None:
    good = lr_sweep({("a", 256, 4): -8.0})
    bad = lr_sweep({("a", 512, 4): -8.0}, seeds=1)
    bad["status"] = "diverged"
    res = optimal_lr(pd.concat([good, bad], ignore_index=True), bootstrap=0)
    row = res.shapes.set_index("width").loc[512]
    assert row["reason"] == (
        "not enough data for the optimal LR of arm=a, width=512, depth=4, sigma_base=0.02 "
        f"because all {len(LOG2_GRID)} trials of this shape diverged"
    )
    assert math.isnan(row["lr_opt"]) and not row["reliable"]
    assert res.reason is None


def test_too_few_lrs_gives_a_reason() -> None:
    df = lr_sweep({("a", 256, 4): -8.0}, grid=np.array([-9.0, -8.0]))
    res = optimal_lr(df, bootstrap=0)
    assert (
        "only 2 LR(s) have a completed run (the quadratic fit needs at least 3)"
        in (res.shapes.iloc[0]["reason"])
    )
    assert str(res.reason).startswith("not enough data for the optimal LR because no shape")


def test_nan_axes_and_losses_are_dropped_with_warnings() -> None:
    df = lr_sweep({("a", 256, 4): -8.0})
    df.loc[0, "width"] = np.nan
    df.loc[1, "lr"] = -1.0
    df.loc[2, "final_val_loss"] = np.nan
    res = optimal_lr(df, bootstrap=0)
    assert any("dropped 2 trials" in w for w in res.warnings)
    assert any("1 completed trials have a NaN/inf final_val_loss" in w for w in res.warnings)
    assert res.shapes.iloc[0]["n_diverged"] == 1
    report = fit_report(df, bootstrap=0)
    assert report.failures == {}
    assert_json_safe(report.to_dict())


# ------------------------------------------------------------------------ full report


def test_fit_report_end_to_end() -> None:
    rng = np.random.default_rng(9)
    rows = []
    arms = {"gpt/mup": ("mup", -0.5), "gpt/completep": ("completep", 0.0)}
    for arm, (param, depth_drift) in arms.items():
        for w in (128, 256, 512):
            for d in (2, 4, 8, 16):
                n = 12.0 * w * w * d
                for tpp in (10.0, 40.0):
                    v = -8.0 + depth_drift * math.log2(d / 2)
                    base = 1.69 + 406.4 / n**0.34 + 410.7 / (tpp * n) ** 0.28
                    for x in np.arange(-12.0, -4.5, 1.0):
                        for s in range(2):
                            rows.append(
                                {
                                    "arm": arm,
                                    "parameterization": param,
                                    "width": w,
                                    "depth": d,
                                    "lr": 2.0**x,
                                    "seed": s,
                                    "tokens": tpp * n,
                                    "tpp": tpp,
                                    "flops": 6 * n * tpp * n,
                                    "params_non_embedding": n,
                                    "final_val_loss": base
                                    + 0.03 * (x - v) ** 2
                                    + rng.normal(0, 0.002),
                                    "extra_column": "ignored",
                                }
                            )
    df = trial_frame(rows)
    # Training horizon (tokens per parameter) is a sweep axis: η* is fitted per horizon.
    report = fit_report(df, bootstrap=20, seed=1, extra_keys=["tpp"])
    assert report.failures == {}
    assert report.reference_arm == "gpt/mup"  # picked because its parameterization is µP
    tables = report.tables()
    assert list(tables) == [
        "optimal_lr",
        "transfer",
        "transfer_check",
        "frontier",
        "savings",
        "aspect_ratio",
        "chinchilla",
    ]
    transfer = tables["transfer"].set_index(["arm", "axis", "tpp"])
    assert len(transfer) == 2 * 2 * 2
    transfer = transfer.xs(40.0, level="tpp")
    assert transfer.loc[("gpt/completep", "depth"), "verdict"] == "transfers"
    assert transfer.loc[("gpt/mup", "depth"), "verdict"] == "drifts"
    assert transfer.loc[("gpt/mup", "depth"), "slope"] == pytest.approx(-0.5, abs=0.05)
    chin = tables["chinchilla"].set_index("arm")
    assert chin.loc["gpt/completep", "alpha"] == pytest.approx(0.34, abs=0.05)
    # both arms follow one loss law at their best LRs: no savings either way, at every loss
    savings = tables["savings"]
    assert len(savings) == 20 and set(savings["reference"]) == {"gpt/mup"}
    assert (savings["savings"].abs() < 0.02).all(), savings["savings"]
    assert ((savings["ci_low"] <= 0) & (savings["ci_high"] >= 0)).all()
    payload = report.to_dict()
    assert_json_safe(payload)
    assert payload["analyses"]["optimal_lr"]["shapes"][0]["trial_ids"]
    text = report.format_text()
    for title in ("Optimal LR per shape", "Transfer drift", "FLOP savings", "Chinchilla fit"):
        assert title in text


def test_default_reference_is_the_baseline_parameterization() -> None:
    # savings are quoted against the paper's baselines: µP when present, else SP
    def arms(*pairs: tuple[str, str]) -> pd.DataFrame:
        frames = []
        for arm, param in pairs:
            frame = lr_sweep({(arm, 64, 2): -7.0}, seeds=1)
            frame["parameterization"] = param
            frames.append(frame)
        return pd.concat(frames, ignore_index=True)

    sp_cp = fit_report(arms(("a/completep", "completep"), ("b/sp", "sp")), bootstrap=0)
    assert sp_cp.reference_arm == "b/sp"
    assert "using the SP arm b/sp" in " ".join(sp_cp.warnings)
    all_three = arms(("a/completep", "completep"), ("b/sp", "sp"), ("c/mup", "mup"))
    assert fit_report(all_three, bootstrap=0).reference_arm == "c/mup"
    neither = arms(("b/completep", "completep"), ("a/depth", "depth_mup"))
    assert fit_report(neither, bootstrap=0).reference_arm == "a/depth"


def test_band_reaching_the_tested_edge_is_not_reliable() -> None:
    # a shallow bowl (minimum at N:L = 8, inside): its 1 % band runs past the widest shape,
    # so the band's upper end is the grid's edge, not a measurement
    rows = []
    for w, d in [(16, 16), (24, 7), (32, 4), (48, 2), (64, 1)]:
        u = math.log(w / d) - math.log(8)
        rows.append({"arm": "sp", "width": w, "depth": d, "lr": 1e-3,
                     "params_non_embedding": 50_000.0,
                     "final_val_loss": 3.0 + 0.003 * u**2 + 0.0005 * u**3})
    row = optimal_aspect_ratio(trial_frame(rows)).to_frame().iloc[0]
    assert row["edge"] is None and row["nl_opt"] == pytest.approx(8.0, rel=0.02)
    assert row["nl_within_high"] == pytest.approx(64.0)
    assert not row["reliable"] and any("band reaches" in w for w in row["warnings"])


def _aspect_rows(shapes: list[tuple[int, int]], loss_of_u) -> list[dict]:
    """Two seeds per shape at ±0.001 of `loss_of_u(u)`, u = log(N:L) - log 8, every shape
    ~50k params: the noise is measured, so N:L has a CI, and only the rules decide."""
    return [{"arm": "sp", "width": w, "depth": d, "lr": 1e-3, "seed": s,
             "params_non_embedding": 50_000.0,
             "final_val_loss": loss_of_u(math.log(w / d) - math.log(8)) + 0.001 * (2 * s - 1)}
            for w, d in shapes for s in range(2)]


def test_four_aspect_ratios_are_not_reliable_five_are() -> None:
    """A bowl at N:L = 8 whose 1 % band lies inside the tested range: with 4 ratios the cubic
    has no residual to check it by, so only the fifth ratio makes it reliable."""
    def bowl(u: float) -> float:
        return 3.0 + 0.05 * u**2

    four = [(16, 16), (32, 4), (48, 2), (64, 1)]
    row = optimal_aspect_ratio(trial_frame(_aspect_rows(four, bowl))).to_frame().iloc[0]
    assert row["edge"] is None and row["nl_opt"] == pytest.approx(8.0, rel=0.02)
    assert 1.0 < row["nl_within_low"] and row["nl_within_high"] < 64.0
    assert np.isfinite(row["nl_ci_low"]) and np.isfinite(row["nl_ci_high"])
    assert not row["reliable"]
    assert any("4 aspect ratios" in w for w in row["warnings"])
    five = optimal_aspect_ratio(trial_frame(_aspect_rows(four + [(24, 7)], bowl)))
    assert five.to_frame().iloc[0]["reliable"]


def test_a_band_reaching_one_edge_only_is_not_reliable() -> None:
    """Loss rises steeply deeper than N:L = 8 and gently wider (0.01 u² - 0.002 u³): the 1 %
    band ends inside on the deep side and runs into the widest shape on the other."""
    shapes = [(16, 16), (24, 7), (32, 4), (48, 2), (64, 1)]
    rows = _aspect_rows(shapes, lambda u: 3.0 + 0.01 * u**2 - 0.002 * u**3)
    row = optimal_aspect_ratio(trial_frame(rows)).to_frame().iloc[0]
    assert row["edge"] is None and row["nl_opt"] == pytest.approx(8.0, rel=0.05)
    assert row["nl_within_low"] > 1.5 and row["nl_within_high"] == pytest.approx(64.0)
    assert np.isfinite(row["nl_ci_low"]) and np.isfinite(row["nl_ci_high"])
    assert not row["reliable"] and any("band reaches" in w for w in row["warnings"])


@pytest.mark.parametrize("shallowest, advice", [(1, "no wider shape exists"),
                                                (2, "run wider (larger N:L) shapes")])
def test_an_optimum_at_the_widest_shape_says_whether_a_wider_one_exists(shallowest: int,
                                                                      advice: str) -> None:
    # loss falls all the way to the widest shape: at depth 1 nothing wider exists at this
    # size, so the report must call N:L a bound instead of asking for wider shapes
    rows = []
    for d in (24, 12, 6, 3, shallowest):
        w = round(math.sqrt(7_000 * 24 / d))
        rows.append({"arm": "sp", "width": w, "depth": d, "lr": 1e-3,
                     "params_non_embedding": 12 * w * w * d,
                     "final_val_loss": 3.0 - 0.05 * math.log(w / d)})
    row = optimal_aspect_ratio(trial_frame(rows)).to_frame().iloc[0]
    assert row["edge"] == "high" and not row["reliable"]
    notes = " ".join(row["warnings"])
    assert advice in notes
    assert ("is a bound" in notes) == (shallowest == 1)


def test_a_shape_with_no_completed_run_is_named_as_left_out_of_the_frontier() -> None:
    """A ladder shape that diverged at every LR tried is absent from its arm's frontier (and
    so from its savings): the frontier, the report and its text say which one."""
    rows = []
    for width in (32, 64, 128, 256):
        for x in (-10, -9, -8):
            diverged = width == 128
            rows.append({"arm": "cp", "width": width, "depth": 2, "lr": 2.0**x,
                         "status": "diverged" if diverged else "completed",
                         "final_val_loss": np.nan if diverged else
                         2.0 + 100 * (6.0 * width**2 * 1e6) ** -0.3 + 0.01 * (x + 9) ** 2,
                         "flops": 6.0 * width**2 * 1e6})
    frame = trial_frame(rows)
    frontier = loss_compute_frontier(frame, bootstrap=0)
    assert frontier.left_out == ["arm cp, width 128, depth 2: no completed run (3 diverged); "
                                 "left out of the loss-vs-compute frontier"]
    assert sorted(frontier.points["width"]) == [32, 64, 256]
    report = fit_report(frame, bootstrap=0)
    assert frontier.left_out[0] in report.warnings
    assert f"warning: {frontier.left_out[0]}" in report.format_text()
