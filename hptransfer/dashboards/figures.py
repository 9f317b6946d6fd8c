"""Plotly figures drawn from the series; each returns a `go.Figure` (HTML is made elsewhere)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative, sample_colorscale
from plotly.subplots import make_subplots

from .series import ArmPanels, AspectGroup, FrontierArm, LRPanel, SavingsBand

ARM_COLORS = qualitative.D3
LAYOUT = dict(template="plotly_white", margin=dict(l=60, r=20, t=50, b=60), font=dict(size=12))


def arm_palette(arms: Iterable[str]) -> dict[str, str]:
    """One colour per arm, the same in every figure of a page (arms sorted by name)."""
    return {arm: ARM_COLORS[i % len(ARM_COLORS)] for i, arm in enumerate(sorted(set(arms)))}


def _color(palette: dict[str, str], arm: str) -> str:
    return palette.get(arm) or ARM_COLORS[len(palette) % len(ARM_COLORS)]


def _ramp(n: int) -> list[str]:
    # Viridis without its pale yellow end, which vanishes on white.
    return sample_colorscale("Viridis", np.linspace(0.0, 0.85, n).tolist()) if n > 1 else [
        "rgb(59, 82, 139)"
    ]


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def _y_range(panel: LRPanel) -> tuple[float, float, float, float]:
    """Axis range with headroom above the curves, where fully diverged LRs (✕) and pruned
    trials (▽) are marked: one row per curve and kind (base height + index * step), so
    coinciding marks stay visible."""
    ys = [y for c in panel.curves for y in _finite(c.y)]
    ys += [c.eta.loss for c in panel.curves if c.eta and math.isfinite(c.eta.loss)]
    lo, hi = (min(ys), max(ys)) if ys else (0.0, 1.0)
    pad = 0.08 * (hi - lo) if hi > lo else 0.05 * max(abs(hi), 1.0)
    rows = sum(1 for c in panel.curves if c.diverged_x) + sum(1 for c in panel.curves if c.pruned)
    step = 0.35 * pad
    top = hi + 1.2 * pad
    return lo - pad, top + max(rows, 1) * step + 0.6 * pad, top, step


def _add_panel(fig: go.Figure, panel: LRPanel, col: int) -> None:
    legend = "legend" if col == 1 else "legend2"
    lo, hi, top, step = _y_range(panel)
    colors = _ramp(len(panel.curves))
    stack = 0
    for curve, color in zip(panel.curves, colors, strict=True):
        group = f"{panel.vary}-{curve.level}"
        err = [e if math.isfinite(e) else 0.0 for e in curve.err]
        fig.add_trace(
            go.Scatter(
                x=curve.x, y=curve.y, mode="lines+markers", name=curve.label,
                legendgroup=group, legend=legend, line=dict(color=color, width=2),
                marker=dict(size=6, color=color), hovertext=curve.hover, hoverinfo="text",
                error_y=dict(type="data", array=err, visible=any(err), thickness=1, width=2),
            ),
            row=1, col=col,
        )
        if curve.eta is not None:
            eta = curve.eta
            has_ci = math.isfinite(eta.ci_low) and math.isfinite(eta.ci_high)
            ci = f"<br>CI 2^[{eta.ci_low:.2f}, {eta.ci_high:.2f}]" if has_ci else ""
            flag = "" if eta.reliable else "<br>(unreliable: see the notes)"
            fig.add_trace(
                go.Scatter(
                    x=[eta.log2_lr], y=[eta.loss], mode="markers", showlegend=False,
                    legendgroup=group, legend=legend,
                    marker=dict(symbol="star" if eta.reliable else "star-open", size=15,
                                color=color, line=dict(color="black", width=1)),
                    error_x=dict(type="data", symmetric=False, visible=has_ci,
                                 array=[eta.ci_high - eta.log2_lr] if has_ci else [0],
                                 arrayminus=[eta.log2_lr - eta.ci_low] if has_ci else [0]),
                    hovertext=[f"η* of {curve.label}: 2^{eta.log2_lr:.2f} "
                               f"({2 ** eta.log2_lr:.3g}){ci}{flag}"],
                    hoverinfo="text",
                ),
                row=1, col=col,
            )
        if curve.diverged_x:
            fig.add_trace(
                go.Scatter(
                    x=curve.diverged_x, y=[top + stack * step] * len(curve.diverged_x),
                    mode="markers",
                    showlegend=False, legendgroup=group, legend=legend,
                    marker=dict(symbol="x", size=10, color=color, line=dict(width=1)),
                    hovertext=[f"{curve.label}: every run diverged at lr=2^{x:.2f}"
                               for x in curve.diverged_x],
                    hoverinfo="text",
                ),
                row=1, col=col,
            )
            stack += 1
        if curve.pruned:
            fig.add_trace(
                go.Scatter(
                    x=[x for x, _ in curve.pruned], y=[top + stack * step] * len(curve.pruned),
                    mode="markers", showlegend=False, legendgroup=group, legend=legend,
                    marker=dict(symbol="triangle-down-open", size=10, color=color),
                    hovertext=[f"{curve.label}: pruned at step {s} (lr=2^{x:.2f}); "
                               "not in the fit" for x, s in curve.pruned],
                    hoverinfo="text",
                ),
                row=1, col=col,
            )
            stack += 1
    fig.update_yaxes(range=[lo, hi], row=1, col=col)


def lr_figure(panels: ArmPanels) -> go.Figure:
    """One arm's row of CompleteP Fig. 1: loss vs log2 LR per depth (left), per width (right)."""
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.08,
                        subplot_titles=(panels.by_depth.title, panels.by_width.title))
    _add_panel(fig, panels.by_depth, 1)
    _add_panel(fig, panels.by_width, 2)
    fig.update_xaxes(title_text="log2 learning rate", dtick=1)
    fig.update_yaxes(title_text="final validation loss", col=1)
    legend = dict(orientation="h", yanchor="top", y=-0.22, font=dict(size=11))
    fig.update_layout(
        **LAYOUT, height=430,
        legend=dict(legend, x=0.0, title_text="depth L"),
        legend2=dict(legend, x=0.54, title_text="width N"),
    )
    fig.update_layout(margin=dict(b=110))
    return fig


def frontier_figure(arms: list[FrontierArm], palette: dict[str, str]) -> go.Figure:
    """Every shape at its best LR (frontier filled), with each arm's fitted power law."""
    fig = go.Figure()
    for arm in arms:
        color = _color(palette, arm.arm)
        for on, suffix in ((True, "frontier"), (False, "off frontier")):
            idx = [k for k, f in enumerate(arm.on_frontier) if f == on]
            if not idx:
                continue
            fig.add_trace(go.Scatter(
                x=[arm.flops[k] for k in idx], y=[arm.loss[k] for k in idx], mode="markers",
                name=f"{arm.arm} ({suffix})", legendgroup=arm.arm,
                marker=dict(size=9 if on else 7, color=color if on else "white",
                            opacity=1.0 if on else 0.7, line=dict(color=color, width=1.5)),
                hovertext=[arm.hover[k] for k in idx], hoverinfo="text",
            ))
        if arm.fit_x:
            fig.add_trace(go.Scatter(
                x=arm.fit_x, y=arm.fit_y, mode="lines", name=arm.fit_label,
                legendgroup=arm.arm, line=dict(color=color, width=2, dash="dash"),
            ))
    fig.update_xaxes(type="log", title_text="training FLOPs", exponentformat="SI")
    fig.update_yaxes(title_text="final validation loss (best LR)")
    fig.update_layout(**LAYOUT, height=460, legend=dict(orientation="v", x=1.01, y=1.0))
    return fig


def _rgba(color: str, alpha: float) -> str:
    if color.startswith("#") and len(color) == 7:
        r, g, b = (int(color[i : i + 2], 16) for i in (1, 3, 5))
        return f"rgba({r},{g},{b},{alpha})"
    return color


def _savings_range(bands: list[SavingsBand]) -> list[float]:
    """y range in %: the CI band, but never more than 100 points beyond the curve, so one
    wild bootstrap tail cannot flatten the curve (savings are at most 100 % anyway)."""
    line = [100.0 * v for b in bands for v in _finite(b.savings)]
    if not line:
        return [-100.0, 100.0]
    band = line + [100.0 * v for b in bands for v in _finite(b.ci_low + b.ci_high)]
    lo = max(min(band), min(line) - 100.0)
    hi = min(max(band), max(max(line) + 100.0, 0.0), 100.0)
    lo, hi = min(lo, 0.0), max(hi, 0.0)  # keep the zero line in view
    pad = 0.05 * (hi - lo) or 5.0
    return [lo - pad, hi + pad]


def savings_figure(bands: list[SavingsBand], palette: dict[str, str]) -> go.Figure:
    """1 - C_arm/C_ref at matched loss, with the bootstrap CI as a shaded band."""
    fig = go.Figure()
    seen: set[str] = set()
    for band in (b for b in bands if b.loss):
        color = _color(palette, band.arm)
        group = f"{band.arm} vs {band.reference}"  # an arm may be compared to two references
        dash = "dash" if band.arm in seen else "solid"  # its second one (over µP) dashed
        seen.add(band.arm)
        pct = [100.0 * v for v in band.savings]
        ci = [(lo, hi) for lo, hi in zip(band.ci_low, band.ci_high, strict=True)
              if math.isfinite(lo) and math.isfinite(hi)]
        if len(ci) == len(band.loss):
            fig.add_trace(go.Scatter(
                x=band.loss + band.loss[::-1],
                y=[100.0 * h for _, h in ci] + [100.0 * lo for lo, _ in ci][::-1],
                fill="toself", mode="lines", line=dict(width=0), hoverinfo="skip",
                fillcolor=_rgba(color, 0.18), name=f"{group}: CI", legendgroup=group,
            ))
        fig.add_trace(go.Scatter(
            x=band.loss, y=pct, mode="lines+markers", legendgroup=group,
            name=group, line=dict(color=color, width=2, dash=dash),
            marker=dict(size=4), hovertemplate="loss %{x:.4f}<br>savings %{y:.1f}%<extra></extra>",
        ))
    fig.add_hline(y=0.0, line=dict(color="#888", width=1, dash="dot"))
    fig.update_yaxes(range=_savings_range(bands))
    fig.update_xaxes(title_text="matched validation loss")
    fig.update_yaxes(title_text="FLOP savings vs reference", ticksuffix="%")
    fig.update_layout(**LAYOUT, height=420, legend=dict(orientation="h", y=-0.2))
    return fig


def aspect_figure(
    groups: list[AspectGroup], within: float, palette: dict[str, str]
) -> go.Figure:
    """Loss vs N:L at fixed size: the cubic, its optimum (star) and the within-1 % band.
    Size groups of one arm share its colour and differ by line dash."""
    fig = go.Figure()
    seen: dict[str, int] = {}
    for g in (x for x in groups if x.curve_x):
        color = _color(palette, g.arm)
        dash = ("solid", "dash", "dot", "dashdot")[seen.get(g.arm, 0) % 4]
        seen[g.arm] = seen.get(g.arm, 0) + 1
        fig.add_trace(go.Scatter(
            x=g.aspect, y=g.loss, mode="markers", name=g.label, legendgroup=g.label,
            marker=dict(size=8, color=color), hovertext=g.hover, hoverinfo="text",
        ))
        fig.add_trace(go.Scatter(
            x=g.curve_x, y=g.curve_y, mode="lines", name=f"{g.label}: cubic",
            legendgroup=g.label, line=dict(color=color, width=2, dash=dash), showlegend=False,
        ))
        lo, hi = g.band
        fig.add_vrect(x0=lo, x1=hi, fillcolor=color, opacity=0.12, line_width=0)
        fig.add_trace(go.Scatter(
            x=[lo, hi], y=[g.loss_opt * (1 + within)] * 2, mode="lines",
            line=dict(color=color, width=1, dash="dot"), legendgroup=g.label,
            name=f"{g.label}: within {within:.0%}", showlegend=False,
            hovertext=f"N:L within {within:.0%} of the best: [{lo:.3g}, {hi:.3g}]",
            hoverinfo="text",
        ))
        fig.add_trace(go.Scatter(
            x=[g.nl_opt], y=[g.loss_opt], mode="markers", legendgroup=g.label,
            name=f"{g.label}: optimum N:L {g.nl_opt:.3g}",
            marker=dict(symbol="star", size=15, color=color, line=dict(color="black", width=1)),
        ))
    fig.update_xaxes(type="log", title_text="aspect ratio N:L (width / depth)")
    fig.update_yaxes(title_text="final validation loss (best LR)")
    fig.update_layout(**LAYOUT, height=440, legend=dict(orientation="v", x=1.01, y=1.0))
    return fig


def check_figure(curves: pd.DataFrame, table: pd.DataFrame, palette: dict[str, str]
                 ) -> go.Figure:
    """The transfer check: loss vs LR of the bracket at the check shape, per arm, with the
    transferred η* as a dashed line and the bracket's own η* as a star."""
    fig = go.Figure()
    for _, row in table.iterrows():
        arm, w, d = row["arm"], row["width"], row["depth"]
        color = _color(palette, arm)
        pts = curves[(curves["arm"] == arm) & (curves["width"] == w) & (curves["depth"] == d)]
        pts = pts.sort_values("lr")
        label = f"{arm} N={w} L={d}"
        fig.add_trace(go.Scatter(
            x=pts["lr"].tolist(), y=pts["mean_loss"].tolist(), mode="lines+markers",
            name=label, legendgroup=label, line=dict(color=color, width=2)))
        lr_t = row.get("lr_transferred")
        if lr_t is not None and math.isfinite(float(lr_t)):
            fig.add_vline(x=float(lr_t), line=dict(color=color, width=1, dash="dash"))
            fig.add_trace(go.Scatter(
                x=[float(lr_t)], y=[float(pts["mean_loss"].min())] if len(pts) else [None],
                mode="markers", legendgroup=label, name=f"{label}: transferred η*",
                marker=dict(symbol="line-ns-open", size=14, color=color)))
        lr_c = row.get("lr_check")
        if lr_c is not None and math.isfinite(float(lr_c)) and len(pts):
            fig.add_trace(go.Scatter(
                x=[float(lr_c)], y=[float(pts["mean_loss"].min())], mode="markers",
                legendgroup=label,
                name=f"{label}: η* here (shift {float(row['shift_log2']):+.2f} octaves)",
                marker=dict(symbol="star" if row["reliable"] else "star-open", size=15,
                            color=color, line=dict(color="black", width=1))))
    fig.update_xaxes(type="log", exponentformat="power", title_text="learning rate")
    fig.update_yaxes(title_text="final validation loss")
    fig.update_layout(**LAYOUT, height=420, legend=dict(orientation="h", y=-0.25))
    return fig


def to_div(fig: go.Figure) -> str:
    """The figure as a <div> + script; plotly.js itself is loaded once by the page."""
    height = fig.layout.height or 450
    return fig.to_html(
        full_html=False, include_plotlyjs=False, default_height=f"{height}px",
        config={"displaylogo": False, "responsive": True},
    )
