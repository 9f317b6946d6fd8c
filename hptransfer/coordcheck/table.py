"""Coord-check result as a text table: mean|act| at the last step, the slope at every step,
the median and verdict per module, then the reasons and notes."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .result import CoordCheckResult


def format_table(result: CoordCheckResult) -> str:
    r, verdict = result, result.verdict
    last = r.steps
    modules = r.modules()
    lines = [f"coord check: {r.label}, lr={r.lr:g}, data={r.data_source}"]
    lines.append(f"mean |activation| at step {last}")
    lines.append(f"{'module':<16}" + "".join(f"{r.axis[0]}={s:<9}" for s in r.sizes))
    for m in modules:
        vals = "".join(f"{_fmt(r.value(s, last, m)):<11}" for s in r.sizes)
        lines.append(f"{m:<16}{vals}")
    lines.append("")
    lines.append(
        f"log2-log2 slope per doubling of {r.axis}; fail: |median over steps >= "
        f"{verdict.min_step} - expected| > {verdict.threshold:g}"
    )
    head = "".join(f"t={t:<6}" for t in range(1, last + 1))
    lines.append(f"{'module':<16}{head}{'median':<9}verdict")
    for m in modules:
        vals = "".join(f"{r.slope(m, t):<+8.2f}" for t in range(1, last + 1))
        med_s = verdict.median_text(m) or "-"
        lines.append(f"{m:<16}{vals}{med_s:<9}{verdict.modules.get(m, '?')}")
    lines.append("")
    lines.append("PASSED" if verdict.passed else "FAILED")
    lines.extend(f"  - {reason}" for reason in verdict.reasons)
    lines.extend(f"  note: {n}" for n in verdict.notes)
    return "\n".join(lines)


def _fmt(v: float) -> str:
    return f"{v:.3e}" if math.isfinite(v) else str(v)
