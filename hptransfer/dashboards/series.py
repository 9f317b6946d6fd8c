"""Plain series for the figures, extracted from the analysis results.

Both renderers (Plotly for the pages, matplotlib for the MLflow PNGs) draw from these, so the
choice of what goes in a panel is made once, here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from hptransfer.analysis import AspectRatioResult, FrontierResult, OptimalLRResult, SavingsResult


@dataclass
class Eta:
    """η* of one curve: log2 LR, the fitted loss there, and its CI (NaN when none)."""

    log2_lr: float
    loss: float
    ci_low: float
    ci_high: float
    reliable: bool


@dataclass
class Curve:
    """Loss vs log2 LR of one shape; `diverged_x` holds LRs where every run diverged."""

    label: str
    level: int
    x: list[float]
    y: list[float]
    err: list[float]
    hover: list[str]
    diverged_x: list[float]
    eta: Eta | None
    # trials a search pruned (stopped early, not in the curve): log2 LR and the step
    pruned: list[tuple[float, int | None]] = field(default_factory=list)


@dataclass
class LRPanel:
    """The curves of one arm along one axis (`vary`) with the other axis held at `fixed`."""

    arm: str
    vary: str
    fixed_name: str
    fixed: int | None
    curves: list[Curve]
    note: str | None = None

    @property
    def title(self) -> str:
        what = "depths" if self.vary == "depth" else "widths"
        return f"{self.arm}: {what} at {self.fixed_name}={self.fixed}"


@dataclass
class ArmPanels:
    arm: str
    by_depth: LRPanel
    by_width: LRPanel
    sigma_note: str | None = None


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _pick_level(curves: pd.DataFrame, fixed: str, vary: str) -> int | None:
    """The `fixed` value run at the most `vary` values (ties: the smallest, usually the base)."""
    if curves.empty:
        return None
    spread = curves.groupby(fixed)[vary].nunique()
    best = spread[spread == spread.max()].index
    return int(min(best))


def _pick_sigma(shapes: pd.DataFrame) -> tuple[float | None, str | None]:
    sigmas = sorted(shapes["sigma_base"].dropna().unique().tolist())
    if len(sigmas) <= 1:
        return (sigmas[0] if sigmas else None), None
    losses = shapes["best_loss"].to_numpy(dtype=float)
    if np.isfinite(losses).any():
        sigma = float(shapes["sigma_base"].to_numpy()[int(np.nanargmin(losses))])
    else:
        sigma = float(sigmas[0])
    return sigma, f"σ_base = {sigma:g} shown (the best of {len(sigmas)} tested)"


def _eta(row: pd.Series | None) -> Eta | None:
    if row is None or not _finite(row.get("log2_lr_opt")):
        return None
    return Eta(
        float(row["log2_lr_opt"]),
        float(row["loss_at_opt"]),
        float(row["log2_ci_low"]) if _finite(row.get("log2_ci_low")) else float("nan"),
        float(row["log2_ci_high"]) if _finite(row.get("log2_ci_high")) else float("nan"),
        bool(row.get("reliable", False)),
    )


def _curve(cells: pd.DataFrame, shape: pd.Series | None, label: str, level: int) -> Curve:
    cells = cells.sort_values("log2_lr")
    has = np.isfinite(cells["mean_loss"].to_numpy(dtype=float))
    dead = ~has & (cells["n_diverged"].to_numpy() > 0)
    done = cells[has]
    hover = [
        f"{label}<br>lr=2^{x:.2f} ({lr:.3g})<br>loss {y:.4f}"
        f"<br>{int(n)} completed, {int(d)} diverged"
        for x, lr, y, n, d in zip(
            done["log2_lr"], done["lr"], done["mean_loss"], done["n_completed"],
            done["n_diverged"], strict=True,
        )
    ]
    return Curve(
        label=label,
        level=level,
        x=done["log2_lr"].astype(float).tolist(),
        y=done["mean_loss"].astype(float).tolist(),
        err=done["std_loss"].astype(float).tolist(),
        hover=hover,
        diverged_x=cells.loc[dead, "log2_lr"].astype(float).tolist(),
        eta=_eta(shape),
        pruned=_pruned(shape),
    )


def _pruned(shape: pd.Series | None) -> list[tuple[float, int | None]]:
    stops = shape.get("pruned") if shape is not None else None
    if not isinstance(stops, list):
        return []
    return [(math.log2(p["lr"]), p["step"]) for p in stops]


def _panel(
    arm: str, curves: pd.DataFrame, shapes: pd.DataFrame, vary: str, fixed_name: str
) -> LRPanel:
    fixed = _pick_level(curves, fixed_name, vary)
    if fixed is None:
        return LRPanel(arm, vary, fixed_name, None, [], "no trial of this arm has finished yet")
    sub = curves[curves[fixed_name] == fixed]
    prefix = "L" if vary == "depth" else "N"
    out = []
    for level, cells in sub.groupby(vary, sort=True):
        match = shapes[(shapes[vary] == level) & (shapes[fixed_name] == fixed)]
        shape = match.iloc[0] if len(match) else None
        out.append(_curve(cells, shape, f"{prefix}={int(level)}", int(level)))
    note = None
    if len(out) == 1:
        note = f"only one {vary} was run at {fixed_name}={fixed}"
    return LRPanel(arm, vary, fixed_name, fixed, out, note)


def lr_panels(opt: OptimalLRResult) -> list[ArmPanels]:
    """Per arm, the CompleteP Fig. 1 layout: depths at one width, widths at one depth."""
    out = []
    curves, shapes = opt.curves, opt.shapes
    for arm in sorted(shapes["arm"].unique().tolist()) if len(shapes) else []:
        arm_shapes = shapes[shapes["arm"] == arm]
        sigma, sigma_note = _pick_sigma(arm_shapes)
        arm_curves = curves[curves["arm"] == arm]
        if sigma is not None:
            arm_curves = arm_curves[np.isclose(arm_curves["sigma_base"].astype(float), sigma)]
            arm_shapes = arm_shapes[np.isclose(arm_shapes["sigma_base"].astype(float), sigma)]
        out.append(
            ArmPanels(
                str(arm),
                _panel(str(arm), arm_curves, arm_shapes, "depth", "width"),
                _panel(str(arm), arm_curves, arm_shapes, "width", "depth"),
                sigma_note,
            )
        )
    return out


# ---------------------------------------------------------------- compute fits


@dataclass
class FrontierArm:
    arm: str
    flops: list[float]
    loss: list[float]
    on_frontier: list[bool]
    hover: list[str]
    fit_x: list[float] = field(default_factory=list)
    fit_y: list[float] = field(default_factory=list)
    fit_label: str | None = None
    reason: str | None = None


def frontier_series(result: FrontierResult) -> list[FrontierArm]:
    points = result.points
    arms = sorted(set(result.fits) | set(result.reasons) | set(points["arm"].astype(str)))
    out = []
    for arm in arms:
        pts = points[points["arm"].astype(str) == arm].sort_values("flops")
        item = FrontierArm(
            arm=arm,
            flops=pts["flops"].astype(float).tolist(),
            loss=pts["loss"].astype(float).tolist(),
            on_frontier=pts["on_frontier"].astype(bool).tolist(),
            hover=[
                f"{arm} N={int(w)} L={int(d)}<br>lr {lr:.3g}<br>loss {v:.4f}<br>{c:.3g} FLOPs"
                for w, d, lr, v, c in zip(
                    pts["width"], pts["depth"], pts["best_lr"], pts["loss"], pts["flops"],
                    strict=True,
                )
            ],
        )
        fit = result.fits.get(arm)
        if fit is not None and fit.ok and len(pts):
            lo, hi = float(pts["flops"].min()), float(pts["flops"].max())
            grid = np.geomspace(lo, hi, 60) if hi > lo else np.array([lo])
            item.fit_x = grid.tolist()
            item.fit_y = np.asarray(fit.predict(grid), dtype=float).tolist()
            item.fit_label = f"{arm}: L = {fit.E:.3g} + {fit.A:.3g}·C^-{fit.b:.3g}"
        else:
            why = result.reasons.get(arm) or (fit.reason if fit is not None else None)
            item.reason = str(why) if why else None
        out.append(item)
    return out


@dataclass
class SavingsBand:
    arm: str
    reference: str
    loss: list[float]
    savings: list[float]
    ci_low: list[float]
    ci_high: list[float]
    reason: str | None
    warnings: list[str]


def savings_series(result: SavingsResult) -> list[SavingsBand]:
    out = []
    # keyed "arm" or, for a study's comparisons over µP, "arm|reference": label by the arm
    for _, comp in sorted(result.comparisons.items()):
        table = comp.table
        if len(table):
            table = table[np.isfinite(table["savings"].to_numpy(dtype=float))]
        out.append(
            SavingsBand(
                arm=comp.arm,
                reference=comp.reference,
                loss=table["loss"].astype(float).tolist() if len(table) else [],
                savings=table["savings"].astype(float).tolist() if len(table) else [],
                ci_low=table["ci_low"].astype(float).tolist() if len(table) else [],
                ci_high=table["ci_high"].astype(float).tolist() if len(table) else [],
                reason=str(comp.reason) if comp.reason else None,
                warnings=list(comp.warnings),
            )
        )
    return out


@dataclass
class AspectGroup:
    """One size group of one arm: points, the fitted cubic in log N:L, optimum and band."""

    arm: str
    params: float
    aspect: list[float]
    loss: list[float]
    hover: list[str]
    curve_x: list[float] = field(default_factory=list)
    curve_y: list[float] = field(default_factory=list)
    nl_opt: float = float("nan")
    loss_opt: float = float("nan")
    band: tuple[float, float] = (float("nan"), float("nan"))
    reliable: bool = False
    reason: str | None = None

    @property
    def label(self) -> str:
        return f"{self.arm} @ {self.params:.3g} params"


def aspect_series(result: AspectRatioResult) -> list[AspectGroup]:
    out = []
    for _, row in result.groups.iterrows():
        inputs = row["inputs"] or []
        aspect = [float(p["aspect"]) for p in inputs]
        group = AspectGroup(
            arm=str(row["arm"]),
            params=float(row["params_median"]),
            aspect=aspect,
            loss=[float(p["loss"]) for p in inputs],
            hover=[f"N={p['width']} L={p['depth']}<br>N:L {p['aspect']:.3g}" for p in inputs],
            reason=row["reason"] if isinstance(row["reason"], str) else None,
            reliable=bool(row["reliable"]),
        )
        coef = row.get("coefficients")
        if group.reason is None and isinstance(coef, list) and len(aspect) >= 2:
            # The analysis fitted the cubic on log(N:L) centred on the mean of its inputs.
            logs = np.log(np.asarray(aspect))
            grid = np.linspace(logs.min(), logs.max(), 80)
            group.curve_x = np.exp(grid).tolist()
            group.curve_y = np.polyval(coef, grid - logs.mean()).tolist()
            group.nl_opt = float(row["nl_opt"])
            group.loss_opt = float(row["loss_opt"])
            group.band = (float(row["nl_within_low"]), float(row["nl_within_high"]))
        out.append(group)
    return out
