"""The `reliable` rules of the frontier fit and the FLOP savings, on closed-form data.

Each rule is checked on inputs whose answer is known without the code under test: exact power
laws (E known), and bootstrap refits written down directly (so every savings sample, and so
every percentile interval, is a closed form)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from hptransfer.analysis import compare_fits, fit_power_law
from hptransfer.analysis.powerlaw import (
    E_ZERO_FRACTION,
    PowerLawFit,
    bound_problems,
    fit_problems,
)
from hptransfer.analysis.savings import MAX_CI_RATIO_SPAN, row_ci_problem

# ------------------------------------------------------------------ frontier: E at its bound

COMPUTE = np.logspace(12, 13.8, 6)  # 6 shapes over 1.8 decades (the demo's earlier ladder)


@pytest.mark.parametrize("A,b", [(25.0, 0.1), (21.0, 0.092), (32.0, 0.115), (8.0, 0.05)])
def test_exact_power_law_without_asymptote_is_never_reliable(A: float, b: float) -> None:
    # L = A·C^-b has E = 0: the optimiser stops somewhere above its bound (about 1e-7 here,
    # not at the bound itself); wherever it stops, E is not identified and the fit says so.
    fit = fit_power_law(COMPUTE, A * COMPUTE**-b, bootstrap=40, seed=0)
    assert fit.E < E_ZERO_FRACTION * fit.loss_range[0]
    assert not fit.reliable
    assert any("E is driven to 0" in w for w in fit.warnings)


def test_power_law_curving_below_zero_asymptote_is_not_reliable() -> None:
    # L = A·C^-b - d (d > 0) is best fitted with E pressed onto its bound
    fit = fit_power_law(COMPUTE, 25.0 * COMPUTE**-0.1 - 0.05, bootstrap=40, seed=0)
    assert not fit.reliable and any("E is driven to 0" in w for w in fit.warnings)


def test_exact_power_law_with_asymptote_is_reliable() -> None:
    c = np.logspace(17, 21, 9)
    fit = fit_power_law(c, 1.7 + 250.0 * c**-0.11, bootstrap=40, seed=0)
    assert fit.E == pytest.approx(1.7, rel=1e-3)
    assert fit.reliable, fit.warnings


@pytest.mark.parametrize(
    "E,b,flagged",
    [
        (2e-9, 0.1, "E is driven to 0"),      # the old rule's blind spot: near, not at, e^-20
        (1e-7, 0.1, "E is driven to 0"),
        (0.9e-3 * 2.0, 0.1, "E is driven to 0"),
        (0.9995 * 2.0, 0.1, "has not bent"),
        (1.0, 1.05e-4, "sits at its bound"),
        (1.0, 4.8, "sits at its bound"),
    ],
)
def test_bound_rule_flags_every_value_near_a_bound(E: float, b: float, flagged: str) -> None:
    problems = bound_problems(E, b, min_loss=2.0)
    assert any(flagged in p for p in problems), problems


@pytest.mark.parametrize("E,b", [(1.1e-3 * 2.0, 0.1), (1.0, 0.1), (1.99, 0.3), (0.5, 2.0)])
def test_bound_rule_passes_values_inside(E: float, b: float) -> None:
    assert bound_problems(E, b, min_loss=2.0) == []


# ------------------------------------------------------------------ savings: one row's CI


def test_row_ci_usable() -> None:
    col = np.linspace(0.1, 0.3, 40)
    assert row_ci_problem(col, 0.2, 0.105, 0.295, 0.95) == (None, False)


def test_row_ci_of_minus_5e7_is_too_wide_not_reliable() -> None:
    # the row the old rule called reliable: savings -0.42, CI [-5.04e7, +0.136]
    col = np.r_[np.linspace(-5.04e7, -1.0, 10), np.linspace(-0.9, 0.136, 30)]
    why, hide = row_ci_problem(col, -0.418, -5.039e7, 0.1358, 0.95)
    assert why is not None and "spans a factor" in why and not hide


def test_row_ci_width_bound_is_the_compute_ratio_span() -> None:
    col = np.linspace(-1.0, 0.6, 40)
    # compute ratio 1 - savings in [0.5, 1.9]: a factor 3.8 (inside the bound)
    assert row_ci_problem(col, 0.0, -0.9, 0.5, 0.95)[0] is None
    # [0.4, 2.0]: a factor 5 > MAX_CI_RATIO_SPAN
    assert MAX_CI_RATIO_SPAN < 5.0
    assert "spans a factor 5" in str(row_ci_problem(col, 0.0, -1.0, 0.6, 0.95)[0])


def test_row_ci_unbounded_tail_is_hidden() -> None:
    # 10 % of the refits put the asymptote above this loss: more than the 2.5 % tail
    col = np.r_[np.full(4, np.nan), np.linspace(0.1, 0.3, 36)]
    why, hide = row_ci_problem(col, 0.2, 0.11, 0.29, 0.95)
    assert hide and "unbounded" in str(why)


def test_row_ci_unbounded_once_more_refits_than_one_tail_are_lost() -> None:
    # 2 of 50 (4 %): more than the 2.5 % one tail of a 95 % interval holds, less than 5 %
    col = np.r_[np.full(2, np.nan), np.linspace(0.1, 0.3, 48)]
    why, hide = row_ci_problem(col, 0.2, 0.11, 0.29, 0.95)
    assert hide and "4% of bootstrap refits" in str(why) and "unbounded" in str(why)
    # 1 of 50 (2 %) fits inside the tail
    col = np.r_[np.full(1, np.nan), np.linspace(0.1, 0.3, 49)]
    assert row_ci_problem(col, 0.2, 0.11, 0.29, 0.95) == (None, False)


def test_row_ci_with_few_distinct_refits_is_hidden_never_zero_width() -> None:
    col = np.r_[np.full(30, 0.2), np.full(10, 0.25)]
    why, hide = row_ci_problem(col, 0.2, 0.2, 0.25, 0.95)
    assert hide and "2 distinct" in str(why)


def test_row_ci_not_containing_its_estimate() -> None:
    col = np.linspace(0.3, 0.5, 40)
    why, hide = row_ci_problem(col, 0.1, 0.305, 0.495, 0.95)
    assert "outside its own" in str(why) and not hide


def test_fit_rules_at_their_boundaries() -> None:
    """Fewer than 5 points, or compute spanning less than a decade: not reliable, and the
    reason given; 5 points over one decade pass both rules."""
    ci = {"b": (0.28, 0.32)}

    def problems(n: int, decades: float) -> list[str]:
        c = np.logspace(18, 18 + decades, n)
        return fit_problems(c, 2.0 + 50 * (c / 1e18) ** -0.3, 2.0, 0.3, ci)

    assert problems(5, 1.0) == []
    assert problems(4, 2.0) == ["only 4 points for 3 parameters: the fit is barely determined"]
    assert problems(6, 0.7) == ["compute spans only 0.70 decades; E and b trade off"]


# ------------------------------------------------------------------ savings: whole comparison


def _fit(
    E: float, A: float, b: float, boot_E: np.ndarray, loss: tuple[float, float]
) -> PowerLawFit:
    """A fit whose bootstrap refits differ only in E (given), so every refit's C(L) is
    (A / (L - E_i))^(1/b): closed form."""
    c_scale = 1e12
    a_scaled = A * c_scale**-b
    boot = np.column_stack([boot_E, np.full(boot_E.size, a_scaled), np.full(boot_E.size, b)])
    lo, hi = loss
    compute = (A / (np.array([lo, hi]) - E)) ** (1 / b)
    return PowerLawFit(E, A, b, c_scale, compute, np.array([hi, lo]), np.zeros(2),
                       boot_params=boot, reliable=True)


def _closed_form_samples(loss: float, ref_E: np.ndarray, arm_E: np.ndarray,
                         b: float, A_arm: float, A_ref: float) -> np.ndarray:
    with np.errstate(all="ignore"):
        c_arm = np.where(loss > arm_E, (A_arm / (loss - arm_E)) ** (1 / b), np.nan)
        c_ref = np.where(loss > ref_E, (A_ref / (loss - ref_E)) ** (1 / b), np.nan)
    return 1.0 - c_arm / c_ref


def test_savings_rows_follow_the_rules_against_closed_form_percentiles() -> None:
    b, A_arm, A_ref = 0.5, 20.0, 21.0
    arm_E = np.linspace(1.0, 1.4, 41)   # some refits' asymptote reaches the low losses
    ref_E = np.linspace(1.1, 1.2, 41)[::-1]
    arm = _fit(1.15, A_arm, b, arm_E, (1.35, 2.4))
    ref = _fit(1.15, A_ref, b, ref_E, (1.35, 2.4))
    comp = compare_fits(arm, ref, arm="a", reference="r", n_grid=12)
    t = comp.table
    assert comp.no_ci is None
    seen = set()
    for _, row in t.iterrows():
        col = _closed_form_samples(row["loss"], ref_E, arm_E, b, A_arm, A_ref)
        lost = np.mean(~np.isfinite(col))
        lo, hi = np.nanpercentile(col, [2.5, 97.5])
        est = 1.0 - (A_arm / A_ref) ** (1 / b)
        assert row["savings"] == pytest.approx(est, rel=1e-9)
        if lost > 0.025:
            seen.add("unbounded")
            assert math.isnan(row["ci_low"]) and not row["reliable"]
            assert "unbounded" in row["note"]
        elif (1 - lo) / (1 - hi) > MAX_CI_RATIO_SPAN:
            seen.add("wide")
            assert row["ci_low"] == pytest.approx(lo) and not row["reliable"]
            assert "spans a factor" in row["note"]
        else:
            seen.add("ok")
            assert row["ci_low"] == pytest.approx(lo) and row["ci_high"] == pytest.approx(hi)
            # reliable: the estimate inside its CI, and the CI on one side of 0
            excludes_zero = lo > 0 or hi < 0
            assert row["reliable"] == (lo <= est <= hi and excludes_zero)
            if lo <= est <= hi and not excludes_zero:
                seen.add("zero inside")
                assert "includes 0" in row["note"]
    assert {"unbounded", "wide", "ok"} <= seen  # the data exercises every branch
    head = comp.headline()
    mid = t[t["savings"].notna()].iloc[len(t) // 2]
    assert head["loss"] == pytest.approx(mid["loss"])
    assert comp.reliable == bool(mid["reliable"])


def test_savings_start_above_the_higher_asymptote() -> None:
    """The arm's asymptote (1.5) sits above its own lowest observed loss (1.45, a fit at its
    bound) and above the reference's (1.0): below 1.5 the arm never gets there at any
    compute, so the compared range starts above the higher E, and every row has a value."""
    boot = np.full(41, 1.5)
    arm = _fit(1.5, 20.0, 0.5, boot, (1.55, 2.4))
    arm.loss = np.array([2.4, 1.45])  # observed below its fitted E
    ref = _fit(1.0, 21.0, 0.5, np.full(41, 1.0), (1.2, 2.4))
    comp = compare_fits(arm, ref, arm="a", reference="r", n_grid=12)
    assert comp.loss_range[0] > 1.5 and comp.loss_range[1] == pytest.approx(2.4)
    assert comp.table["savings"].notna().all() and np.isfinite(comp.table["savings"]).all()


def test_savings_headline_with_unusable_ci_is_not_reliable() -> None:
    b = 0.1
    arm_E = np.linspace(0.5, 2.2, 41)  # wildly uncertain asymptote: unbounded at most losses
    comp = compare_fits(_fit(1.15, 20.0, b, arm_E, (1.35, 2.4)),
                        _fit(1.15, 21.0, b, np.linspace(1.1, 1.2, 41), (1.35, 2.4)),
                        arm="a", reference="r", n_grid=9)
    head = comp.headline()
    assert not comp.reliable and not head["reliable"]
    assert head["ci_low"] is None and "unbounded" in head["note"]
    assert any("headline savings' CI is not usable" in w for w in comp.warnings)


def _narrow(E: float, rising: bool = True) -> np.ndarray:
    """Refits whose E spreads by ±0.01 (the arm's falling where the reference's rise, so
    the i-th pair's savings differ): a CI far narrower than the savings."""
    spread = np.linspace(E - 0.01, E + 0.01, 41)
    return spread if rising else spread[::-1]


def test_savings_whose_ci_lies_below_zero_are_reliable() -> None:
    """The arm costs more (A 25 against 20 at b 0.5: savings 1 - 1.25² = -56 %): a CI
    wholly below 0 knows which arm is cheaper as well as one above it."""
    arm = _fit(1.15, 25.0, 0.5, _narrow(1.15, rising=False), (1.35, 2.4))
    ref = _fit(1.15, 20.0, 0.5, _narrow(1.15), (1.35, 2.4))
    comp = compare_fits(arm, ref, arm="a", reference="r", n_grid=5)
    head = comp.headline()
    assert head["savings"] == pytest.approx(1 - 1.25**2)
    assert head["ci_high"] < 0 and comp.reliable and comp.table["reliable"].all()
    assert comp.table["note"].isna().all()


def test_savings_of_an_unreliable_fit_are_never_reliable() -> None:
    arm = _fit(1.15, 25.0, 0.5, _narrow(1.15, rising=False), (1.35, 2.4))
    ref = _fit(1.15, 20.0, 0.5, _narrow(1.15), (1.35, 2.4))
    arm.reliable = False
    comp = compare_fits(arm, ref, arm="a", reference="r", n_grid=5)
    assert comp.headline()["ci_high"] < 0  # the CI alone would do
    assert not comp.reliable and not comp.table["reliable"].any()
    assert "at least one of the two power-law fits is unreliable" in comp.warnings


def test_the_headline_rows_ci_decides_not_any_rows() -> None:
    """Arm (E 1.0) and reference (E 1.2) cost the same at loss 1.875, the middle of 5 rows:
    C_arm/C_ref = (k (L - 1.2) / (L - 1.0))² with k = 0.875 / 0.675. The end rows' CIs
    exclude 0; the headline's holds it, so the comparison is not reliable."""
    k = 0.875 / 0.675
    arm = _fit(1.0, 20.0 * k, 0.5, _narrow(1.0, rising=False), (1.35, 2.4))
    ref = _fit(1.2, 20.0, 0.5, _narrow(1.2), (1.35, 2.4))
    comp = compare_fits(arm, ref, arm="a", reference="r", n_grid=5)
    t = comp.table
    assert t["loss"].iloc[2] == pytest.approx(1.875)
    assert t["savings"].iloc[2] == pytest.approx(0.0, abs=1e-12)
    assert t["savings"].iloc[0] == pytest.approx(1 - (k * 0.15 / 0.35) ** 2)
    assert t["reliable"].iloc[0] and not t["reliable"].iloc[2]
    assert not comp.reliable and not comp.headline()["reliable"]


def test_a_ci_from_fewer_than_ten_distinct_refits_is_hidden() -> None:
    col = np.repeat(np.linspace(0.1, 0.3, 5), 40)
    why, hide = row_ci_problem(col, 0.2, 0.1, 0.3, 0.95)
    assert hide and why == "only 5 distinct bootstrap values"
    assert row_ci_problem(np.linspace(0.1, 0.3, 10), 0.2, 0.1, 0.3, 0.95) == (None, False)


def test_savings_frame_of_a_comparison_without_rows() -> None:
    from hptransfer.analysis.savings import SavingsResult

    c = np.logspace(17, 21, 9)
    far = fit_power_law(c, 5.0 + 250.0 * c**-0.11, bootstrap=0)
    near = fit_power_law(c, 1.75 + 260.0 * c**-0.105, bootstrap=0)
    comp = compare_fits(far, near, arm="far", reference="near")
    assert comp.table.empty and comp.reason is not None
    frame = SavingsResult("near", {"far": comp}).to_frame()
    assert list(frame["arm"]) == ["far"] and frame["reliable"].tolist() == [False]
    assert "do not overlap" in frame["reason"].iloc[0]


# ------------------------------------------------------------------ Chinchilla: E and exponents


def test_chinchilla_without_asymptote_is_not_reliable() -> None:
    # L = A/N^α + B/D^β has E = 0: the fit presses E onto its bound (e^-10), which the data
    # cannot tell from 0; the same rule as the power law's
    from hptransfer.analysis import fit_chinchilla

    n, d = (g.ravel() for g in np.meshgrid(np.logspace(7, 10, 6), np.logspace(9, 12, 6)))
    fit = fit_chinchilla(n, d, 400.0 / n**0.34 + 410.0 / d**0.28, bootstrap=20, seed=0)
    assert fit.E < E_ZERO_FRACTION * float(fit.loss.min())
    assert not fit.reliable and any("E is driven to 0" in w for w in fit.warnings)


def test_exponent_ci_rule_is_shared() -> None:
    from hptransfer.analysis.fit_result import MAX_EXPONENT_CI_FACTOR, exponent_ci_problem

    assert exponent_ci_problem("alpha", {"alpha": (1.0, MAX_EXPONENT_CI_FACTOR)}) is None
    why = exponent_ci_problem("alpha", {"alpha": (0.1, 0.1 * MAX_EXPONENT_CI_FACTOR * 1.01)})
    assert why is not None and "alpha" in why
    assert exponent_ci_problem("beta", {"alpha": (0.01, 1.0)}) is None  # no CI: no verdict


# ------------------------------------------------------------------ percentiles with infinities


def _ranked_percentile(col: np.ndarray, q: float) -> float:
    """numpy's linear percentile by hand, on a plain sorted list with infinities ranked:
    a percentile next to an infinity is that infinity."""
    x = sorted(float(v) for v in col if not math.isnan(v))
    h = (len(x) - 1) * q
    i = math.floor(h)
    t = h - i
    if t == 0:
        return x[i]
    a, b = x[i], x[i + 1]
    if math.isinf(a) or math.isinf(b):
        return a if a == -math.inf else b
    return a + (b - a) * t


def test_percentile_ci_is_numpys_on_finite_samples() -> None:
    from hptransfer.analysis.stats import percentile_ci

    rng = np.random.default_rng(0)
    for shape, axis in (((57,), 0), ((40, 7), 0), ((5, 33), 1), ((1, 4), 0)):
        x = rng.standard_normal(shape)
        x[rng.random(shape) < 0.1] = np.nan
        for level in (0.95, 0.9, 0.5):
            tail = 50 * (1 - level)
            with warnings.catch_warnings():  # an all-NaN column: NaN, as expected
                warnings.simplefilter("ignore", RuntimeWarning)
                expect = np.nanpercentile(x, [tail, 100 - tail], axis=axis)
            assert np.allclose(percentile_ci(x, level, axis=axis), expect, equal_nan=True)
    with np.errstate(all="ignore"):
        assert np.isnan(percentile_ci(np.full((4, 2), np.nan))).all()
    assert percentile_ci(np.empty((0, 3))).shape == (2, 3)


@pytest.mark.parametrize("neg, pos", [(1, 0), (2, 0), (3, 0), (0, 1), (0, 3), (1, 1), (4, 4)])
def test_percentile_ci_ranks_infinite_samples(neg: int, pos: int) -> None:
    from hptransfer.analysis.stats import percentile_ci

    col = np.concatenate([np.full(neg, -np.inf), np.linspace(0, 1, 100 - neg - pos),
                          np.full(pos, np.inf), [np.nan]])
    lo, hi = percentile_ci(col, 0.95)
    assert lo == pytest.approx(_ranked_percentile(col, 0.025), rel=1e-12)
    assert hi == pytest.approx(_ranked_percentile(col, 0.975), rel=1e-12)
    assert (lo == -np.inf) == (neg >= 3) and (hi == np.inf) == (pos >= 3)


def test_a_refit_that_never_reaches_the_loss_keeps_its_rank_in_the_savings_ci() -> None:
    # 1 of 41 arm refits has its asymptote above the low losses (1/41 < the 2.5 % tail: the
    # CI is shown), as has 1 of 41 reference refits: their savings there are -inf (the arm's
    # compute is unbounded) and 1 (the reference's is); dropping them would narrow the CI
    b, A_arm, A_ref = 0.5, 20.0, 21.0
    arm_E = np.append(np.linspace(1.0, 1.1, 40), 1.6)
    ref_E = np.append(np.linspace(1.1, 1.2, 40)[::-1], 1.6)[np.r_[1:41, 0]]
    comp = compare_fits(_fit(1.05, A_arm, b, arm_E, (1.35, 2.4)),
                        _fit(1.15, A_ref, b, ref_E, (1.35, 2.4)),
                        arm="a", reference="r", n_grid=12)
    checked = 0
    for _, row in comp.table.iterrows():
        loss = row["loss"]
        with np.errstate(all="ignore"):
            c_arm = np.where(loss > arm_E, (A_arm / (loss - arm_E)) ** (1 / b), np.inf)
            c_ref = np.where(loss > ref_E, (A_ref / (loss - ref_E)) ** (1 / b), np.inf)
            col = 1.0 - c_arm / c_ref
        if loss < 1.6:  # each unreachable refit has its own sample: -inf, and 1
            assert np.isneginf(col).sum() == 1 and (col == 1.0).sum() == 1
            assert row["ci_low"] == pytest.approx(_ranked_percentile(col, 0.025))
            assert row["ci_high"] == pytest.approx(_ranked_percentile(col, 0.975))
            kept = col[np.isfinite(col) & (col < 1)]  # what dropping them gave
            assert row["ci_low"] < np.percentile(kept, 2.5)
            assert row["ci_high"] > np.percentile(kept, 97.5)
            checked += 1
    assert checked >= 2
