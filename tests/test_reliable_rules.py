"""Each rule that keeps η*, a transfer shift, a drift slope or a stage target from being
called reliable, one at a time: a frame where that rule alone decides, so deleting or
loosening it fails here (a mutation run found each of these rules deletable with the rest of
the suite still green). Losses are closed-form bowls, noise from seeded draws or exact
±d pairs; every expected value is computed here, not read from the code under test."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from hptransfer.analysis import optimal_lr
from hptransfer.analysis.noise import log_noise_floor, vertex_ci
from hptransfer.analysis.staged import transfer_check
from hptransfer.analysis.targets import eta_check, shift_check
from hptransfer.analysis.transfer import transfer_drift


def _row(stage: str, width: int, depth: int, log2_lr: float, seed: int, loss: float,
         sigma: float = 0.02, arm: str = "gpt/sp") -> dict:
    return {"trial_id": f"{stage}-{arm}-{width}x{depth}-{sigma}-{log2_lr}-{seed}", "arm": arm,
            "width": width, "depth": depth, "lr": 2.0**log2_lr, "sigma_base": sigma,
            "seed": seed, "status": "completed", "final_val_loss": loss, "stage": stage}


def _study(rng: np.random.Generator, noise: float = 0.004) -> pd.DataFrame:
    """η* tuned at 32x2 over 4 seeds (vertex 2^-8) and bracketed at 64x2 over 3 seeds
    (vertex 2^-8.3): the two η*s carry different degrees of freedom (12 and 8)."""
    rows = [_row("tune", 32, 2, k, s, 3 + 0.02 * (k + 8) ** 2 + noise * rng.standard_normal())
            for s in range(4) for k in range(-11, -4)]
    rows += [_row("check", 64, 2, k, s, 3 + 0.02 * (k + 8.3) ** 2
                  + noise * rng.standard_normal())
             for s in range(3) for k in (-10, -9, -8, -7, -6)]
    return pd.DataFrame(rows)


def test_a_shift_whose_combined_ci_is_too_wide_is_not_reliable_though_both_etas_are() -> None:
    df = _study(np.random.default_rng(3))
    default = transfer_check(df)
    wide = default.table.iloc[0]
    assert wide["reliable"], wide["reason"]
    half = float(wide["shift_ci_half"])
    base = default.base_fit.shapes.iloc[0]
    check = default.check_fit.shapes.iloc[0]
    assert check["eta_noise_dof"] == 8 and base["eta_noise_dof"] == 12
    widest_eta = max(base["ci_half_log2"], check["ci_half_log2"])
    assert widest_eta < half  # the shift's CI adds the two

    between = (widest_eta + half) / 2
    tight = transfer_check(df, max_ci_log2=between)
    assert tight.base_fit.shapes.iloc[0]["reliable"] and tight.check_fit.shapes.iloc[0]["reliable"]
    row = tight.table.iloc[0]
    assert not row["reliable"] and "CIs add" in row["reason"]
    # a CI exactly as wide as asked is narrow enough
    assert transfer_check(df, max_ci_log2=half).table.iloc[0]["reliable"]


def test_the_shift_ci_takes_each_etas_own_degrees_of_freedom() -> None:
    """Welch-Satterthwaite from scipy's t: the check's 8 dof with the check's half-width, the
    base's 12 with the base's (swapped, the interval moves)."""
    from scipy import stats

    df = _study(np.random.default_rng(5))
    result = transfer_check(df)
    row, b, c = (result.table.iloc[0], result.base_fit.shapes.iloc[0],
                 result.check_fit.shapes.iloc[0])
    eta_b, eta_c = b["log2_lr_opt"], c["log2_lr_opt"]
    dofs = (c["eta_noise_dof"], b["eta_noise_dof"])
    assert dofs == (8, 12)

    def half(widths: tuple[float, float]) -> float:
        se = [w / stats.t.ppf(0.975, d) for w, d in zip(widths, dofs, strict=True)]
        dof = sum(x**2 for x in se) ** 2 / sum(x**4 / d for x, d in zip(se, dofs, strict=True))
        return stats.t.ppf(0.975, dof) * math.hypot(*se)

    shift = eta_c - eta_b
    low = shift - half((eta_c - c["log2_ci_low"], b["log2_ci_high"] - eta_b))
    high = shift + half((c["log2_ci_high"] - eta_c, eta_b - b["log2_ci_low"]))
    assert row["shift_ci_low"] == pytest.approx(low, rel=1e-9)
    assert row["shift_ci_high"] == pytest.approx(high, rel=1e-9)


def test_the_transferred_eta_is_the_base_shapes_best_sigma() -> None:
    """Two σ at the base: η* of the σ with the lower best loss is the one transferred."""
    rows = [_row("tune", 32, 2, k, s, 3.1 + 0.05 * (k + 7) ** 2 + 0.001 * s, sigma=0.04)
            for s in range(2) for k in range(-11, -3)]
    rows += [_row("tune", 32, 2, k, s, 3.0 + 0.05 * (k + 8) ** 2 + 0.001 * s)
             for s in range(2) for k in range(-11, -3)]
    rows += [_row("check", 64, 2, k, s, 3.0 + 0.05 * (k + 8) ** 2 + 0.001 * s)
             for s in range(2) for k in (-10, -9, -8, -7, -6)]
    row = transfer_check(pd.DataFrame(rows)).table.iloc[0]
    assert math.log2(row["lr_transferred"]) == pytest.approx(-8.0, abs=1e-6)


def test_the_bracket_rise_is_read_inside_the_fitted_window_only() -> None:
    """Nine LRs, a fit on the best and one each side (neighbours=1): the window rises c =
    0.0005 around 2^-8, less than the noise, while LRs two octaves out sit 0.9 higher. The
    bracket is flat where η* is fitted, whatever the far LRs do."""
    c, d = 0.0005, 0.002
    rows = []
    for i, k in enumerate(range(-12, -3)):
        bowl = c * (k + 8) ** 2 if abs(k + 8) <= 1 else 0.9
        # two seeds at ±d, the sign alternating by LR: exact means, measured noise
        rows += [_row("tune", 64, 2, k, s, 3 + bowl + d * (-1) ** (s + i)) for s in range(2)]
    fit = optimal_lr(pd.DataFrame(rows), neighbours=1).shapes.iloc[0]
    assert fit["n_fit_points"] == 3 and fit["log2_lr_opt"] == pytest.approx(-8.0)
    assert fit["bracket_rise"] == pytest.approx(c)
    assert fit["bracket_rise"] < fit["bracket_noise"]
    assert not fit["informative"] and not fit["reliable"]


def test_a_concave_bracket_has_no_ci() -> None:
    """Losses high in the middle of the fitted window: the parabola's vertex is a maximum,
    so Fieller's interval (around that maximum) is not η*'s."""
    shape = (3.005, 3.04, 3.0, 3.04, 3.005)
    rows = [_row("tune", 64, 2, k, s, loss + 0.001 * (s - 1) * (-1) ** i)
            for i, (k, loss) in enumerate(zip(range(-10, -5), shape, strict=True))
            for s in range(3)]
    fit = optimal_lr(pd.DataFrame(rows)).shapes.iloc[0]
    assert fit["concave"] and not fit["sound"] and not fit["reliable"]
    assert math.isnan(fit["log2_ci_low"]) and math.isnan(fit["log2_ci_high"])
    assert math.isnan(fit["ci_half_log2"])


def test_an_eta_ci_exactly_as_wide_as_asked_is_informative() -> None:
    rng = np.random.default_rng(9)
    df = pd.DataFrame([_row("tune", 64, 2, k, s, 3 + 0.05 * (k + 8.2) ** 2
                            + 0.01 * rng.standard_normal())
                       for s in range(3) for k in range(-12, -4)])
    half = optimal_lr(df).shapes.iloc[0]["ci_half_log2"]
    assert 0 < half < 0.5
    assert optimal_lr(df, max_ci_log2=half).shapes.iloc[0]["informative"]
    assert not optimal_lr(df, max_ci_log2=half * (1 - 1e-9)).shapes.iloc[0]["informative"]


def test_a_drift_slope_through_two_shapes_has_no_ci_and_is_not_reliable() -> None:
    """Two widths, each η* reliable: a line through two points has no residual, so no CI."""
    rng = np.random.default_rng(1)
    rows = [_row("tune", w, 2, k, s, 3 + 0.05 * (k - v) ** 2 + 0.003 * rng.standard_normal())
            for w, v in ((64, -8.0), (128, -9.0)) for s in range(3) for k in range(-13, -4)]
    fits = optimal_lr(pd.DataFrame(rows))
    assert fits.shapes["reliable"].all()
    (slope,) = [r for _, r in transfer_drift(fits).slopes.iterrows() if r["axis"] == "width"]
    assert slope["slope"] == pytest.approx(-1.0, abs=0.1) and slope["dof"] == 0
    assert math.isnan(slope["ci_low"]) and not slope["reliable"]
    assert any("no residual degrees of freedom" in w for w in slope["warnings"])


def test_a_shift_beyond_the_bracket_misses_its_target_however_narrow() -> None:
    row = {"arm": "gpt/sp", "width": 64, "depth": 8, "edge": "high", "shift_ci_half": 0.01}
    check = shift_check(row, 0.5)
    assert not check.met and "bound" in check.why
    assert shift_check({**row, "edge": None}, 0.5).met


def test_an_eta_target_needs_a_rise_above_the_noise_not_equal_to_it() -> None:
    row = {"arm": "gpt/sp", "sound": True, "eta_noise_dof": 4, "ci_half_log2": 0.1,
           "bracket_rise": 0.05, "bracket_noise": 0.05}
    assert not eta_check(row, 0.5).met
    assert not eta_check({**row, "bracket_rise": math.nan}, 0.5).met
    assert eta_check({**row, "bracket_rise": 0.0501}, 0.5).met


def test_the_log_noise_floor_against_hand_computed_values() -> None:
    # one point: sd 0.02 over 4 seeds at loss 2 -> 0.02 / (sqrt(4) * 2) on the log scale
    assert log_noise_floor(np.array([0.02]), np.array([3]), np.array([4]),
                           np.array([2.0])) == (pytest.approx(0.005), 3)
    # two points pool their 3 + 3 degrees of freedom; a point without a spread adds none
    floor, dof = log_noise_floor(np.array([0.01, 0.03, math.nan]), np.array([3, 3, 0]),
                                 np.array([4, 4, 1]), np.array([1.0, 1.0, 1.0]))
    pooled = math.sqrt((0.01**2 + 0.03**2) / 2)
    assert dof == 6
    assert floor == pytest.approx(math.sqrt((2 * (pooled / 2) ** 2 + pooled**2) / 3))


def test_vertex_ci_without_a_t_quantile_is_unknown() -> None:
    cov = np.diag([0.0, 1e-4, 1e-4])[None]
    lo, hi = vertex_ci(np.array([0.02]), np.array([0.05]), cov, np.array([math.nan]))
    assert math.isnan(lo[0]) and math.isnan(hi[0])


def test_an_unsound_eta_says_why_in_its_warnings_not_as_a_noise_reason() -> None:
    """Best LR at the grid's lowest: η* is not reliable because it is off the edge, not
    because of the noise, and its reason does not say the latter (the warnings say why)."""
    rng = np.random.default_rng(2)
    df = pd.DataFrame([_row("tune", 64, 2, k, s, 3 + 0.05 * (k + 14) ** 2
                            + 0.01 * rng.standard_normal())
                       for s in range(2) for k in range(-12, -6)])
    fit = optimal_lr(df).shapes.iloc[0]
    assert not fit["sound"] and not fit["reliable"] and fit["edge"] == "low"
    assert fit["reason"] is None
    assert any("lowest tested" in w for w in fit["warnings"])
