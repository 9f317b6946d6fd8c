"""Whether a study stage's target is met, read off its fits: the one definition the study's
planner (which adds trials until it is met) and its report share.

- tune   `eta_ci_log2`: η* of the arm at the base shape has a sound fit, a CI (from the seed
         noise) of half-width at most the target, and a bracket whose losses rise above the
         noise on both sides of the best LR.
- check  `shift_ci_log2`: the transfer shift at a check shape has a CI (base's and check's
         together) of half-width at most the target, and is an estimate, not a bound.
- transfer `savings_excludes_zero`: the savings headline row's CI excludes 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pandas as pd


@dataclass(frozen=True)
class TargetCheck:
    """One headline number against its target: `value` is the CI half-width (octaves) for
    η* and the shift, the CI's distance from 0 for savings (negative: it straddles 0)."""

    item: str
    met: bool
    value: float
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"item": self.item, "met": self.met,
                "value": self.value if math.isfinite(self.value) else None, "why": self.why}


def _f(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def eta_check(row: pd.Series | dict[str, Any], width: float) -> TargetCheck:
    """η* of one shape (an `optimal_lr` shapes row) against ±`width` octaves."""
    item = str(row["arm"])
    half, rise, noise = _f(row["ci_half_log2"]), _f(row["bracket_rise"]), _f(row["bracket_noise"])
    if not bool(row["sound"]):
        return TargetCheck(item, False, half, "the fit is not sound: " + (
            "; ".join(row.get("warnings") or []) or str(row.get("reason") or "no η*")))
    if _f(row["eta_noise_dof"]) < 1:
        return TargetCheck(item, False, half, "one seed per LR: no noise measured, no CI")
    if not rise > noise:
        return TargetCheck(item, False, half, f"bracket flat within the noise (rises "
                                              f"{rise:.3g}, noise {noise:.3g})")
    return _width_check(item, half, width)


def _width_check(item: str, half: float, width: float) -> TargetCheck:
    if not math.isfinite(half):
        return TargetCheck(item, False, half, "CI unbounded (the curvature is within the "
                                              "noise)")
    if not half <= width:
        return TargetCheck(item, False, half, f"CI ±{half:.2f} octave > ±{width:g}")
    return TargetCheck(item, True, half, f"CI ±{half:.2f} octave <= ±{width:g}")


def shift_check(row: pd.Series | dict[str, Any], width: float) -> TargetCheck:
    """The transfer shift at one check shape (a `transfer_check` table row)."""
    item = f"{row['arm']} {int(row['width'])}x{int(row['depth'])}"
    half = _f(row.get("shift_ci_half"))
    if isinstance(row.get("edge"), str):
        return TargetCheck(item, False, half, f"η* is beyond the bracket's {row['edge']} "
                                              "edge: the shift is a bound")
    if math.isnan(half):
        return TargetCheck(item, False, half, "the shift has no CI (one seed per LR)")
    return _width_check(item, half, width)


def savings_check(head: dict[str, Any]) -> TargetCheck:
    """One savings comparison's headline (`SavingsComparison.headline()`)."""
    item = f"{head['arm']} over {head['reference']}"
    lo, hi = _f(head.get("ci_low")), _f(head.get("ci_high"))
    if head.get("savings") is None or math.isnan(lo) or math.isnan(hi):
        return TargetCheck(item, False, math.nan, "no CI: " + str(
            head.get("no_ci") or head.get("reason") or head.get("note") or "one seed"))
    gap = max(lo, -hi)  # > 0: the CI is on one side of 0
    if gap > 0:
        return TargetCheck(item, True, gap, f"CI [{lo:+.1%}, {hi:+.1%}] excludes 0")
    return TargetCheck(item, False, gap, f"CI [{lo:+.1%}, {hi:+.1%}] straddles 0")


def target_lines(targets: list[dict[str, Any]]) -> list[str]:
    """The report's lines for a study's targets (the study state's `targets`, as
    `coordinator.targets.summary` lays them out)."""
    lines = []
    for t in targets:
        items = t.get("items") or []
        met = [i for i in items if i.get("met")]
        state = ("met" if items and len(met) == len(items) else
                 "in progress" if not t.get("final") else "NOT met")
        flops = (f" ({float(t.get('spent_flops') or 0):.3g} of "
                 f"{float(t['max_extra_flops']):.3g} FLOPs)"
                 if t.get("max_extra_flops") is not None else "")
        lines.append(f"target stages.{t['stage']}.{t['target']}: {state} "
                     f"({len(met)} of {len(items)}); spent {t['spent']} of "
                     f"{t['max_extra_trials']} extra trials{flops} in {t['rounds']} "
                     f"round(s)" + (f"; {t['outcome']}" if t.get("outcome") else "")
                     + (f" [stopped by {t['stopped_by']}]" if t.get("stopped_by") else ""))
        lines += [f"  {'ok ' if i.get('met') else 'NO '} {i['item']}: {i['why']}"
                  for i in items]
    return lines
