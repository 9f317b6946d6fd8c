"""FLOP savings of an arm over a reference arm at matched loss, from the two power-law fits."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from hptransfer.jsonsafe import frame_records, json_safe

from .errors import NotEnoughData
from .frontier import FrontierResult, loss_compute_frontier
from .optimal_lr import OptimalLRResult
from .powerlaw import PowerLawFit
from .serialize import analysis_dict, with_none
from .stats import percentile_ci
from .trials import Trials

_TABLE_COLUMNS = [
    "loss", "compute_arm", "compute_ref", "savings", "ci_low", "ci_high", "reliable", "note",
]
# A savings CI whose compute ratio C_arm/C_ref (= 1 - savings) spans more than this factor
# says nothing about which arm is cheaper: such a row is shown but not `reliable`.
MAX_CI_RATIO_SPAN = 4.0
ZERO_INSIDE = ("the CI includes 0: which arm needs less compute at this loss is not "
               "resolved (more seeds or shapes narrow it)")
# Fewer distinct bootstrap values than this cannot give percentile tails (2.5 % of 10 is
# already a fraction of one draw).
MIN_DISTINCT_REFITS = 10


@dataclass
class SavingsComparison:
    """savings(L) = 1 - C_arm(L) / C_ref(L) on a grid of losses both fits cover.

    Each table row has its own `reliable` (both fits reliable, the row's CI usable, see
    `row_ci_problem`, and excluding 0: which arm is cheaper is known); the comparison is
    `reliable` when its headline row is."""

    arm: str
    reference: str
    table: pd.DataFrame
    loss_range: tuple[float, float]
    reliable: bool = False
    warnings: list[str] = field(default_factory=list)
    reason: NotEnoughData | None = None
    no_ci: str | None = None  # why the savings have no confidence interval (never zero width)

    def headline(self) -> dict[str, Any]:
        """The savings at the middle of the loss range both fits cover, with its CI."""
        out: dict[str, Any] = {"arm": self.arm, "reference": self.reference,
                               "reliable": self.reliable, "no_ci": self.no_ci,
                               "reason": str(self.reason) if self.reason else None}
        if self.table.empty:
            return json_safe({**out, "loss": None, "savings": None})
        h = _headline_index(self.table["savings"].notna().to_numpy())
        if h < 0:
            return json_safe({**out, "loss": None, "savings": None})
        row = self.table.iloc[h]
        return json_safe({**out, **{k: row[k] for k in ("loss", "savings", "ci_low",
                                                         "ci_high", "note")}})

    def to_frame(self) -> pd.DataFrame:
        out = self.table.copy()
        out.insert(0, "reference", self.reference)
        out.insert(0, "arm", self.arm)
        return out

    def to_dict(self) -> dict[str, Any]:
        return json_safe(
            {
                "arm": self.arm,
                "reference": self.reference,
                "loss_range": list(self.loss_range),
                "reliable": self.reliable,
                "warnings": self.warnings,
                "reason": self.reason,
                "no_ci": self.no_ci,
                "headline": self.headline(),
                "table": frame_records(self.table),
            }
        )


def compare_fits(
    arm_fit: PowerLawFit,
    ref_fit: PowerLawFit,
    *,
    arm: str = "arm",
    reference: str = "reference",
    losses: Sequence[float] | np.ndarray | None = None,
    n_grid: int = 20,
    ci: float = 0.95,
) -> SavingsComparison:
    """Invert both fits at matched losses; never extrapolates beyond the observed losses.

    The usable range is the intersection of the two observed loss ranges, above both
    asymptotes E. Requested `losses` outside it get no value and a note saying why.
    """
    what = f"FLOP savings of {arm} vs {reference}"
    empty = pd.DataFrame(columns=_TABLE_COLUMNS)
    nan_range = (float("nan"), float("nan"))
    for name, fit in ((arm, arm_fit), (reference, ref_fit)):
        if not fit.ok:
            because = f"arm {name} has no loss-vs-compute fit ({fit.reason})"
            return SavingsComparison(
                arm, reference, empty, nan_range, reason=NotEnoughData(what, because)
            )
    lo, hi, because = _common_loss_range(arm_fit, ref_fit, arm, reference)
    if because is not None:
        return SavingsComparison(
            arm, reference, empty, (lo, hi), reason=NotEnoughData(what, because)
        )

    grid = np.linspace(lo, hi, n_grid) if losses is None else np.asarray(losses, dtype=float)
    inside = (grid >= lo) & (grid <= hi)
    note = np.where(
        inside,
        None,
        f"outside the loss range both fits cover [{lo:.4g}, {hi:.4g}]; refusing to extrapolate",
    )
    c_arm = np.where(inside, arm_fit.compute_for_loss(grid), np.nan)
    c_ref = np.where(inside, ref_fit.compute_for_loss(grid), np.nan)
    savings = 1.0 - c_arm / c_ref
    ci_lo, ci_hi, row_problem, no_ci = _savings_ci(arm_fit, ref_fit, grid, inside, savings, ci)

    warnings: list[str] = []
    if no_ci is not None:
        warnings.append(f"savings have no confidence interval: {no_ci}")
    fits_reliable = bool(arm_fit.reliable and ref_fit.reliable)
    for i in np.flatnonzero(inside):
        if no_ci is None and row_problem[i] is None and not (ci_lo[i] > 0 or ci_hi[i] < 0):
            row_problem[i] = ZERO_INSIDE
            note[i] = ZERO_INSIDE
        elif no_ci is None and row_problem[i] is not None:
            note[i] = f"CI not usable: {row_problem[i]}"
    row_ok = inside & (no_ci is None) & fits_reliable & np.array(
        [p is None for p in row_problem], dtype=bool)
    table = pd.DataFrame(
        {
            "loss": grid,
            "compute_arm": c_arm,
            "compute_ref": c_ref,
            "savings": savings,
            "ci_low": ci_lo,
            "ci_high": ci_hi,
            "reliable": row_ok,
            "note": note,
        }
    )
    table = with_none(table, ["note"])
    reason = None
    if not inside.any():
        because = (
            f"every requested loss is outside the range both fits cover [{lo:.4g}, "
            f"{hi:.4g}]; refusing to extrapolate"
        )
        reason = NotEnoughData(what, because)
    if not fits_reliable:
        warnings.append("at least one of the two power-law fits is unreliable")
    # reliable needs a real, usable CI at the headline loss: a point estimate alone, or an
    # interval that is unbounded or spans a factor > MAX_CI_RATIO_SPAN, does not say how sure
    h = _headline_index(np.isfinite(savings))
    if h >= 0 and row_problem[h] is not None:
        warnings.append(f"the headline savings: {ZERO_INSIDE}" if row_problem[h] == ZERO_INSIDE
                        else f"the headline savings' CI is not usable: {row_problem[h]}")
    reliable = reason is None and h >= 0 and bool(row_ok[h])
    return SavingsComparison(arm, reference, table, (lo, hi), reliable, warnings, reason, no_ci)


def _common_loss_range(
    arm_fit: PowerLawFit, ref_fit: PowerLawFit, arm: str, reference: str
) -> tuple[float, float, str | None]:
    """The losses both fits observed, above both asymptotes, and why there are none (None
    when there are)."""
    a_lo, a_hi = arm_fit.loss_range
    r_lo, r_hi = ref_fit.loss_range
    floor = max(arm_fit.E, ref_fit.E)
    lo, hi = max(a_lo, r_lo), min(a_hi, r_hi)
    if lo <= floor:
        lo = float(np.nextafter(floor, np.inf))
    if lo < hi:
        return lo, hi, None
    return lo, hi, (
        f"the observed loss ranges do not overlap above both asymptotes ({arm}: "
        f"[{a_lo:.4g}, {a_hi:.4g}], {reference}: [{r_lo:.4g}, {r_hi:.4g}], "
        f"E = {arm_fit.E:.4g} / {ref_fit.E:.4g}); refusing to extrapolate"
    )


def _savings_ci(
    arm_fit: PowerLawFit, ref_fit: PowerLawFit, grid: np.ndarray, inside: np.ndarray,
    savings: np.ndarray, ci: float,
) -> tuple[np.ndarray, np.ndarray, list[str | None], str | None]:
    """The savings' bootstrap CI per loss (NaN where none), why each row's CI is not usable
    (None when it is), and why there is no CI at all (None when there is one)."""
    boot_arm = arm_fit.boot_compute_for_loss(grid)
    boot_ref = ref_fit.boot_compute_for_loss(grid)
    m = min(len(boot_arm), len(boot_ref))
    row_problem: list[str | None] = [None] * len(grid)
    if m == 0:
        nan = np.full(grid.shape, np.nan)
        return nan, nan, row_problem, "no bootstrap refits (bootstrap is off)"
    # Pairing the i-th refits is a valid draw: arms fitted alone were resampled
    # independently; arms of a shared-E fit have their i-th refits from one joint resample.
    with np.errstate(all="ignore"):
        samples = 1.0 - boot_arm[:m] / boot_ref[:m]
    ci_lo, ci_hi = percentile_ci(samples, ci)
    no_ci = _no_ci_reason(samples[:, inside], ci_lo[inside], ci_hi[inside])
    if no_ci is not None:
        # an interval of zero width would read as certainty: show none, say why
        nan = np.full(grid.shape, np.nan)
        return nan, nan, row_problem, no_ci
    for i in np.flatnonzero(inside):
        why, hide = row_ci_problem(samples[:, i], savings[i], ci_lo[i], ci_hi[i], ci)
        row_problem[i] = why
        if hide:  # no interval rather than a meaningless or unbounded one
            ci_lo[i] = ci_hi[i] = np.nan
    return np.where(inside, ci_lo, np.nan), np.where(inside, ci_hi, np.nan), row_problem, None


def _headline_index(inside: np.ndarray) -> int:
    """Row of the headline: the middle of the rows with a savings value."""
    idx = np.flatnonzero(inside)
    return int(idx[len(idx) // 2]) if idx.size else -1


def row_ci_problem(
    col: np.ndarray, estimate: float, lo: float, hi: float, ci: float
) -> tuple[str | None, bool]:
    """Why one loss's savings CI is not usable (None when it is), and whether to hide it.

    `col` holds that loss's bootstrap savings: -inf where the arm's refit has its asymptote
    above the loss (its compute there is unbounded), 1 where the reference's has, NaN where
    both have (or a refit failed); the percentiles `lo`, `hi` rank them all. Hidden:
    unbounded, non-finite, too few distinct values, zero width. Shown but not reliable: wider
    than MAX_CI_RATIO_SPAN in compute ratio, or not containing its own estimate."""
    lost = float(np.mean(~np.isfinite(col))) if col.size else 1.0
    if lost > (1.0 - ci) / 2.0:
        # more refits than one tail holds have no finite value: that tail is unbounded
        return (f"{lost:.0%} of bootstrap refits put an asymptote above this loss, so the "
                "interval is unbounded"), True
    finite = col[np.isfinite(col)]
    distinct = int(np.unique(np.round(finite, 9)).size)
    if distinct < MIN_DISTINCT_REFITS:
        return f"only {distinct} distinct bootstrap values", True
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "the interval is not finite", True
    if hi - lo <= 1e-9:
        return "every bootstrap refit gives the same savings (zero width is not real)", True
    # savings < 1 always (compute is positive); 1 - savings is the compute ratio
    span = (1.0 - lo) / (1.0 - hi) if hi < 1.0 else math.inf
    if span > MAX_CI_RATIO_SPAN:
        return (f"the CI spans a factor {span:.3g} in compute ratio C_arm/C_ref (more than "
                f"{MAX_CI_RATIO_SPAN:g})"), False
    if not lo <= estimate <= hi:
        return "the estimate lies outside its own bootstrap CI (the refits are biased)", False
    return None, False


def _no_ci_reason(samples: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> str | None:
    """Why the bootstrap cannot give an interval here (None when it can)."""
    if samples.size == 0:
        return "no compared loss lies inside both fits"
    finite = samples[np.isfinite(samples).all(axis=1)]
    distinct = np.unique(np.round(finite, 9), axis=0).shape[0] if finite.size else 0
    if distinct < MIN_DISTINCT_REFITS:
        return (f"only {distinct} distinct bootstrap refits (the fits leave no residual "
                "spread to redraw: run more shapes or seeds)")
    width = hi - lo
    if not np.isfinite(width).any() or np.nanmax(width) <= 1e-9:
        return "every bootstrap refit gives the same savings: a zero-width interval is not real"
    return None


@dataclass
class SavingsResult:
    """Savings of every arm over `reference`."""

    reference: str | None
    comparisons: dict[str, SavingsComparison]
    reason: NotEnoughData | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def reliable(self) -> bool:
        return self.reason is None and all(c.reliable for c in self.comparisons.values())

    def to_frame(self) -> pd.DataFrame:
        frames = []
        for comp in self.comparisons.values():
            frame = comp.to_frame()
            if frame.empty:
                frame = pd.DataFrame([{"arm": comp.arm, "reference": comp.reference}])
            if "reliable" not in frame or frame["reliable"].isna().all():  # no table
                frame["reliable"] = comp.reliable
            frame["reliable"] = frame["reliable"].astype(bool)
            frame["reason"] = str(comp.reason) if comp.reason else None
            frames.append(frame)
        columns = ["arm", "reference", *_TABLE_COLUMNS, "reason"]
        if not frames:
            return pd.DataFrame(columns=columns)
        merged = pd.concat(frames, ignore_index=True).reindex(columns=columns)
        return with_none(merged, ["note", "reason"])

    def to_dict(self) -> dict[str, Any]:
        return analysis_dict(
            "savings",
            self,
            first={"reference": self.reference},
            comparisons={k: v.to_dict() for k, v in self.comparisons.items()},
        )


def flop_savings(
    data: pd.DataFrame | Trials | OptimalLRResult | FrontierResult,
    reference_arm: str | None = None,
    *,
    losses: Sequence[float] | np.ndarray | None = None,
    n_grid: int = 20,
    bootstrap: int = 200,
    seed: int | None = 0,
    ci: float = 0.95,
) -> SavingsResult:
    """Savings of each arm over `reference_arm` (default: the first arm by name)."""
    if isinstance(data, FrontierResult):
        frontier = data
    else:
        frontier = loss_compute_frontier(data, bootstrap=bootstrap, seed=seed, ci=ci)
    warnings = list(frontier.warnings)
    arms = sorted(set(frontier.fits) | set(frontier.reasons))
    what = "FLOP savings"
    if not arms:
        reason = frontier.reason or NotEnoughData(what, "there are no arms")
        return SavingsResult(reference_arm, {}, NotEnoughData(what, reason.because), warnings)
    if reference_arm is None:
        reference_arm = arms[0]
        warnings.append(f"no reference arm given; using {reference_arm}")
    if reference_arm not in arms:
        because = f"the reference arm {reference_arm!r} is not among the arms ({', '.join(arms)})"
        return SavingsResult(reference_arm, {}, NotEnoughData(what, because), warnings)
    others = [a for a in arms if a != reference_arm]
    if not others:
        because = f"there is only one arm ({reference_arm}) to compare"
        return SavingsResult(reference_arm, {}, NotEnoughData(what, because), warnings)

    nan_fit = PowerLawFit(*(4 * [float("nan")]), np.empty(0), np.empty(0), np.empty(0))
    comparisons = {}
    for arm in others:
        arm_fit = frontier.fits.get(arm) or _missing(nan_fit, frontier, arm)
        ref_fit = frontier.fits.get(reference_arm) or _missing(nan_fit, frontier, reference_arm)
        comparisons[arm] = compare_fits(
            arm_fit, ref_fit, arm=arm, reference=reference_arm, losses=losses, n_grid=n_grid, ci=ci
        )
    reason = None
    if all(c.reason is not None for c in comparisons.values()):
        reason = NotEnoughData(what, "; ".join(str(c.reason) for c in comparisons.values()))
    return SavingsResult(reference_arm, comparisons, reason, warnings)


def _missing(template: PowerLawFit, frontier: FrontierResult, arm: str) -> PowerLawFit:
    why = frontier.reasons.get(arm) or NotEnoughData(f"the fit of arm {arm}", "it has no points")
    return PowerLawFit(**{**template.__dict__, "reason": why})
