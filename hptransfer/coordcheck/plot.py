"""Coord-check result as a PNG: one panel per module, x = size (log2), y = mean|act| (log),
a line per step coloured by step."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .result import CoordCheckResult


def save_plot(result: CoordCheckResult, path: str | Path) -> Path:
    # matplotlib is imported here, not at module level: only plotting needs it.
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib import cm
    from matplotlib.colors import Normalize
    from matplotlib.ticker import NullFormatter

    r, verdict = result, result.verdict
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    modules = r.modules()
    fig, axes = plt.subplots(
        1, len(modules), figsize=(3.0 * len(modules) + 1.2, 3.4), squeeze=False,
        layout="constrained",
    )
    norm = Normalize(vmin=1, vmax=max(r.steps, 2))
    cmap = matplotlib.colormaps["viridis"]
    for ax, m in zip(axes[0], modules, strict=True):
        finite = []
        for t in range(1, r.steps + 1):
            ys = [r.value(s, t, m) for s in r.sizes]
            finite += [v for v in ys if math.isfinite(v) and v > 0]
            ax.plot(r.sizes, ys, marker="o", ms=3, lw=1.2, color=cmap(norm(t)))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        if finite:  # at least one decade, so a flat curve looks flat
            lo, hi = min(finite), max(finite)
            if hi / lo < 10.0:
                mid = math.sqrt(lo * hi)
                lo, hi = mid / math.sqrt(10.0), mid * math.sqrt(10.0)
            ax.set_ylim(lo / 1.15, hi * 1.15)
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(r.sizes)
        ax.set_xticklabels([str(s) for s in r.sizes], fontsize=7)
        ax.set_xlabel(r.axis)
        med = verdict.median_text(m)
        med_s = f", slope {med}" if med is not None else ""
        ax.set_title(f"{m} [{verdict.modules.get(m, '?')}{med_s}]", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("mean |activation|")
    mappable = cm.ScalarMappable(norm=norm, cmap=cmap)
    fig.colorbar(mappable, ax=list(axes[0]), label="step", fraction=0.02, pad=0.01)
    status = "passed" if verdict.passed else "failed"
    fig.suptitle(f"coord check: {r.label}, lr={r.lr:g} ({status})", fontsize=10)
    fig.savefig(path, dpi=90, format="png")  # at `path` as given: no suffix added
    plt.close(fig)
    return path
