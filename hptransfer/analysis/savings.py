"""FLOP savings of an arm over a reference arm at matched loss, from the two power-law fits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from .errors import NotEnoughData
from .frontier import FrontierResult, loss_compute_frontier
from .optimal_lr import OptimalLRResult
from .powerlaw import PowerLawFit
from .serialize import analysis_dict, frame_records, json_safe, with_none
from .stats import percentile_ci
from .trials import Trials

_TABLE_COLUMNS = ["loss", "compute_arm", "compute_ref", "savings", "ci_low", "ci_high", "note"]


@dataclass
class SavingsComparison:
    """savings(L) = 1 - C_arm(L) / C_ref(L) on a grid of losses both fits cover."""

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
        inside = self.table[self.table["savings"].notna()] if not self.table.empty else None
        if inside is None or inside.empty:
            return json_safe({**out, "loss": None, "savings": None})
        row = inside.iloc[len(inside) // 2]
        return json_safe({**out, **{k: row[k] for k in ("loss", "savings", "ci_low",
                                                         "ci_high")}})

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
    a_lo, a_hi = arm_fit.loss_range
    r_lo, r_hi = ref_fit.loss_range
    floor = max(arm_fit.E, ref_fit.E)
    lo, hi = max(a_lo, r_lo), min(a_hi, r_hi)
    if lo <= floor:
        lo = float(np.nextafter(floor, np.inf))
    if not lo < hi:
        because = (
            f"the observed loss ranges do not overlap above both asymptotes ({arm}: "
            f"[{a_lo:.4g}, {a_hi:.4g}], {reference}: [{r_lo:.4g}, {r_hi:.4g}], "
            f"E = {arm_fit.E:.4g} / {ref_fit.E:.4g}); refusing to extrapolate"
        )
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

    warnings: list[str] = []
    boot_arm = arm_fit.boot_compute_for_loss(grid)
    boot_ref = ref_fit.boot_compute_for_loss(grid)
    m = min(len(boot_arm), len(boot_ref))
    ci_lo = ci_hi = np.full(grid.shape, np.nan)
    no_ci = None
    if m > 0:
        # Each arm was resampled independently, so pairing the i-th refits is a valid draw.
        with np.errstate(all="ignore"):
            samples = 1.0 - boot_arm[:m] / boot_ref[:m]
        lost = float(np.mean(~np.isfinite(samples[:, inside]))) if inside.any() else 0.0
        if lost > 0.05:
            warnings.append(
                f"{lost:.0%} of bootstrap refits put the asymptote above the "
                "compared losses; the CI ignores them"
            )
        ci_lo, ci_hi = percentile_ci(samples, ci)
        ci_lo = np.where(inside, ci_lo, np.nan)
        ci_hi = np.where(inside, ci_hi, np.nan)
        no_ci = _no_ci_reason(samples[:, inside], ci_lo[inside], ci_hi[inside])
    else:
        no_ci = ("no bootstrap refits (bootstrap off, or no resample of the frontier points "
                 "had 3 distinct points)")
    if no_ci is not None:
        # an interval of zero width would read as certainty: show none, say why
        ci_lo = ci_hi = np.full(grid.shape, np.nan)
        warnings.append(f"savings have no confidence interval: {no_ci}")
    table = pd.DataFrame(
        {
            "loss": grid,
            "compute_arm": c_arm,
            "compute_ref": c_ref,
            "savings": savings,
            "ci_low": ci_lo,
            "ci_high": ci_hi,
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
    # reliable also needs a real CI: a point estimate alone does not say how sure it is
    reliable = reason is None and arm_fit.reliable and ref_fit.reliable and no_ci is None
    if not (arm_fit.reliable and ref_fit.reliable):
        warnings.append("at least one of the two power-law fits is unreliable")
    return SavingsComparison(arm, reference, table, (lo, hi), reliable, warnings, reason, no_ci)


_MIN_DISTINCT_REFITS = 10


def _no_ci_reason(samples: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> str | None:
    """Why the bootstrap cannot give an interval here (None when it can)."""
    if samples.size == 0:
        return "no compared loss lies inside both fits"
    finite = samples[np.isfinite(samples).all(axis=1)]
    distinct = np.unique(np.round(finite, 9), axis=0).shape[0] if finite.size else 0
    if distinct < _MIN_DISTINCT_REFITS:
        return (f"only {distinct} distinct bootstrap refits (too few frontier points to "
                "resample; run more shapes or seeds)")
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
            frame["reliable"] = comp.reliable
            frame["reason"] = str(comp.reason) if comp.reason else None
            frames.append(frame)
        columns = ["arm", "reference", *_TABLE_COLUMNS, "reliable", "reason"]
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
