"""Static PNGs (matplotlib) of the two key figures, for MLflow where no JavaScript runs."""

from __future__ import annotations

import io
import math
from typing import Any

from hptransfer.analysis import FitReport

from .series import FrontierArm, LRPanel, frontier_series, lr_panels


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=False)  # no display on servers and Ray workers
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    _pyplot().close(fig)
    return buf.getvalue()


def _draw_panel(ax: Any, panel: LRPanel) -> None:
    import matplotlib

    cmap = matplotlib.colormaps["viridis"]
    n = len(panel.curves)
    ys = [y for c in panel.curves for y in c.y if math.isfinite(y)]
    top = max(ys) if ys else 1.0
    for i, curve in enumerate(panel.curves):
        color = cmap(0.85 * i / max(n - 1, 1))
        ax.plot(curve.x, curve.y, marker="o", ms=3, lw=1.5, color=color, label=curve.label)
        if curve.diverged_x:
            ax.plot(curve.diverged_x, [top] * len(curve.diverged_x), "x", color=color, ms=7)
        if curve.eta is not None:
            # hollow star: η* exists but is unreliable (grid edge, clamped, concave, two basins)
            solid = curve.eta.reliable
            ax.plot([curve.eta.log2_lr], [curve.eta.loss], marker="*", ms=13, color=color,
                    mfc=color if solid else "none", mec="black" if solid else color, mew=0.8)
    ax.set_title(panel.title, fontsize=9)
    ax.set_xlabel("log2 learning rate")
    ax.grid(True, alpha=0.3)
    if panel.curves:
        ax.legend(fontsize=7, title=panel.vary, title_fontsize=7)


def lr_png(report: FitReport) -> bytes | None:
    """CompleteP Fig. 1 layout: a row per arm (depths | widths); None when nothing finished."""
    if report.optimal_lr is None:
        return None
    arms = [a for a in lr_panels(report.optimal_lr) if a.by_depth.curves]
    if not arms:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(len(arms), 2, figsize=(11, 3.6 * len(arms)), squeeze=False,
                             layout="constrained")
    for row, arm in zip(axes, arms, strict=True):
        _draw_panel(row[0], arm.by_depth)
        _draw_panel(row[1], arm.by_width)
        row[0].set_ylabel("final validation loss")
    fig.suptitle("loss vs learning rate (★ = η*, × = all runs diverged)", fontsize=10)
    return _png(fig)


def _draw_frontier(ax: Any, arms: list[FrontierArm]) -> None:
    import matplotlib

    colors = matplotlib.colormaps["tab10"]
    for i, arm in enumerate(arms):
        color = colors(i % 10)
        on = [k for k, f in enumerate(arm.on_frontier) if f]
        off = [k for k, f in enumerate(arm.on_frontier) if not f]
        ax.scatter([arm.flops[k] for k in on], [arm.loss[k] for k in on], color=color,
                   s=28, label=f"{arm.arm} (frontier)")
        ax.scatter([arm.flops[k] for k in off], [arm.loss[k] for k in off], s=20,
                   facecolors="none", edgecolors=color)
        if arm.fit_x:
            ax.plot(arm.fit_x, arm.fit_y, "--", color=color, label=arm.fit_label)


def frontier_png(report: FitReport) -> bytes | None:
    """Loss vs FLOPs with the fitted power laws; None when no shape has a FLOP count."""
    if report.frontier is None or report.frontier.points.empty:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), layout="constrained")
    _draw_frontier(ax, frontier_series(report.frontier))
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("final validation loss (best LR)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("loss vs compute: frontier and L(C) = E + A·C^-b", fontsize=10)
    return _png(fig)
