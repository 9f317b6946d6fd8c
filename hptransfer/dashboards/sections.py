"""The fit sections of a sweep page: each is a figure/table or a "not enough data" box."""

from __future__ import annotations

import base64
import math
from pathlib import Path
from typing import Any

from hptransfer.analysis import FitReport

from . import figures
from .html import esc, fmt, nodata, notes, section, table
from .series import aspect_series, frontier_series, lr_panels, savings_series

_WHAT = {
    "optimal_lr": "the loss-vs-LR curves",
    "transfer": "transfer drift",
    "frontier": "the loss-vs-compute frontier",
    "savings": "FLOP savings",
    "aspect_ratio": "the compute-optimal N:L",
    "transfer_check": "the transfer check",
}


def unavailable(report: FitReport | None, name: str) -> str | None:
    """Why the analysis `name` has no result object at all (None when it has one)."""
    what = _WHAT[name]
    if report is None:
        return f"not enough data for {what} because the fits were not computed"
    if report.error:
        return f"not enough data for {what} because the trial table is unusable ({report.error})"
    if name in report.failures:
        return f"{what} could not be computed: the analysis failed ({report.failures[name]})"
    if getattr(report, name) is None:
        upstream = report.failures.get("optimal_lr") or report.failures.get("frontier")
        because = f"an earlier fit failed ({upstream})" if upstream else "it was not run"
        return f"not enough data for {what} because {because}"
    return None


def _palette(report: FitReport | None) -> dict[str, str]:
    opt = report.optimal_lr if report is not None else None
    arms = opt.shapes["arm"].astype(str).tolist() if opt is not None else []
    return figures.arm_palette(arms)


def _box(report: FitReport | None, name: str) -> str | None:
    why = unavailable(report, name)
    if why is None:
        reason = getattr(getattr(report, name), "reason", None)
        why = str(reason) if reason is not None else None
    return nodata(why) if why else None


def lr_section(report: FitReport | None) -> str:
    title = "Loss vs learning rate (η* marked ★; hollow ★ = unreliable)"
    box = unavailable(report, "optimal_lr")
    if box:
        return section(title, nodata(box), "lr")
    assert report is not None and report.optimal_lr is not None
    opt = report.optimal_lr
    panels = lr_panels(opt)
    parts = [
        '<p class="muted">One row per arm. Left: each depth at a fixed width; right: each '
        "width at a fixed depth. A flat η* across curves means the learning rate transfers."
        "</p>",
    ]
    if opt.reason is not None:
        parts.append(nodata(str(opt.reason)))
    if not any(p.by_depth.curves for p in panels):
        if opt.reason is None:
            parts.append(nodata("not enough data for the loss-vs-LR curves because no trial "
                                "has a completed loss yet"))
        return section(title, "".join(parts), "lr")
    for arm in panels:
        parts.append(f"<h3>{esc(arm.arm)}</h3>")
        if not arm.by_depth.curves:
            parts.append(nodata(f"not enough data for the LR curves of arm {arm.arm} because "
                                f"{arm.by_depth.note}"))
            continue
        parts.append(figures.to_div(figures.lr_figure(arm)))
        dead = any(c.diverged_x for p in (arm.by_depth, arm.by_width) for c in p.curves)
        cut = any(c.pruned for p in (arm.by_depth, arm.by_width) for c in p.curves)
        parts.append(notes([arm.sigma_note or "", arm.by_depth.note or "",
                            arm.by_width.note or "",
                            "✕ above the curves: every run at that LR diverged" if dead else "",
                            "▽ above the curves: a trial the search pruned (hover: its step); "
                            "not in the fit" if cut else ""]))
    shape_notes = [
        f"{r['arm']} N={r['width']} L={r['depth']}: {r['reason']}"
        for _, r in opt.shapes.iterrows() if isinstance(r.get("reason"), str)
    ]
    parts.append(notes([*shape_notes, *opt.warnings]))
    parts.append(_eta_table(report))
    return section(title, "".join(parts), "lr")


def _eta_table(report: FitReport) -> str:
    assert report.optimal_lr is not None
    shapes = report.optimal_lr.shapes
    if shapes.empty:
        return ""
    rows = [
        [r["arm"], int(r["width"]), int(r["depth"]), float(r["sigma_base"]),
         int(r["n_completed"]), int(r["n_diverged"]), float(r["best_lr"]), float(r["lr_opt"]),
         f"[{fmt(r['lr_ci_low'])}, {fmt(r['lr_ci_high'])}]", r["edge"] or "",
         bool(r["reliable"]), _pruned_cell(r.get("pruned"))]
        for _, r in shapes.iterrows()
    ]
    head = ["arm", "width", "depth", "σ_base", "completed", "diverged", "best lr", "η*",
            "η* CI", "edge", "reliable", "pruned: LR @ step (not fitted)"]
    return f"<details><summary>η* per shape ({len(rows)} shapes)</summary>{table(head, rows)}" \
        "</details>"


def _pruned_cell(pruned: Any) -> str:
    """A search's stopped trials: each one's LR and the step it was pruned at."""
    if not isinstance(pruned, list) or not pruned:
        return ""
    return ", ".join(f"{fmt(p['lr'])} @ {p['step'] if p['step'] is not None else '?'}"
                     for p in pruned)


def transfer_section(report: FitReport | None) -> str:
    title = "Transfer drift: slope of log2 η* per doubling of width / depth"
    box = _box(report, "transfer")
    result = report.transfer if report else None
    if result is None or result.slopes.empty:
        return section(title, box or nodata("not enough data for transfer drift because no "
                                            "shape has a fitted η*"), "transfer")
    rows = []
    for _, r in result.slopes.iterrows():
        ci = f"[{fmt(r['ci_low'])}, {fmt(r['ci_high'])}]"
        verdict = r["verdict"] or "inconclusive"
        why = r["reason"] if isinstance(r["reason"], str) else "; ".join(r["warnings"] or [])
        rows.append([esc(r["arm"]), esc(fmt(r["sigma_base"])), esc(r["axis"]),
                     esc(fmt(r.get("slope"))), esc(ci), esc(fmt(r.get("n_shapes"))),
                     esc(fmt(r.get("max_shift_log2"))),
                     f'<span class="v-{esc(verdict)}">{esc(verdict)}</span>',
                     esc(fmt(bool(r["reliable"]))), esc(why)])
    head = ["arm", "σ_base", "axis", "slope", f"{result.ci_level:.0%} CI", "shapes",
            "max shift (log2)", "verdict", "reliable", "why / notes"]
    intro = (f'<p class="muted">"transfers": the whole CI lies within ±{result.tolerance:g} '
             'log2 per doubling; "drifts": the CI excludes 0 (SP across width shows about '
             "-1).</p>")
    return section(title, intro + (box or "") + table(head, rows, raw=True), "transfer")


def frontier_section(report: FitReport | None) -> str:
    title = "Loss vs compute: frontier and fitted power laws L(C) = E + A·C^-b"
    box = _box(report, "frontier")
    result = report.frontier if report else None
    if result is None or result.points.empty:
        return section(title, box or nodata("not enough data for the loss-vs-compute "
                                            "frontier because no shape has a FLOP count"),
                       "frontier")
    arms = frontier_series(result)
    rows = [
        [f.arm, f.n_points, f.n_frontier, *(_ci(f, n) for n in ("E", "A", "b")),
         "yes" if f.reliable else "no"]
        for f in result.to_frame().itertuples()
    ]
    reasons = [a.reason for a in arms if a.reason]
    warn = [*result.left_out, *(w for fit in result.fits.values() for w in fit.warnings)]
    fig = figures.frontier_figure(arms, _palette(report))
    body = (box or "") + figures.to_div(fig) + notes(reasons + warn)
    body += table(["arm", "shapes", "on frontier", "E", "A", "b", "reliable"], rows)
    return section(title, body, "frontier")


def _ci(row: Any, name: str) -> str:
    value = getattr(row, name)
    lo, hi = getattr(row, f"{name}_ci_low"), getattr(row, f"{name}_ci_high")
    if isinstance(lo, float) and math.isfinite(lo):
        return f"{fmt(value)} [{fmt(lo)}, {fmt(hi)}]"
    return fmt(value)


def savings_section(report: FitReport | None) -> str:
    title = "FLOP savings at matched loss: 1 − C_arm / C_reference"
    box = _box(report, "savings")
    result = report.savings if report else None
    bands = savings_series(result) if result is not None else []
    if not any(b.loss for b in bands):
        return section(title, box or nodata("not enough data for FLOP savings because no "
                                            "pair of arms has overlapping fits"), "savings")
    ref = f'<p class="muted">Reference arm: {esc(result.reference if result else "")}.</p>'
    extra = [b.reason for b in bands if b.reason] + [w for b in bands for w in b.warnings]
    fig = figures.savings_figure(bands, _palette(report))
    no_ci = [f"{c.arm} vs {c.reference}: no CI because {c.no_ci}"
             for c in (result.comparisons.values() if result else []) if c.no_ci]
    body = ref + figures.to_div(fig) + notes(no_ci + extra)
    return section(title, body, "savings")


def aspect_section(report: FitReport | None) -> str:
    result = report.aspect_ratio if report else None
    band = f"{result.within:.0%}" if result is not None else "1 %"
    title = f"Compute-optimal aspect ratio N:L (cubic fit in log N:L, within-{band} band)"
    box = _box(report, "aspect_ratio")
    groups = aspect_series(result) if result is not None else []
    fitted = [g for g in groups if g.curve_x]
    if not fitted:
        return section(title, box or nodata("not enough data for the compute-optimal N:L "
                                            "because no size group was fitted"), "aspect")
    assert result is not None
    skipped = len(groups) - len(fitted)
    extra = [f"{skipped} size groups have fewer than 4 aspect ratios and are not drawn"
             if skipped else ""]
    extra += [w for _, r in result.groups.iterrows() for w in (r["warnings"] or [])]
    fig = figures.aspect_figure(fitted, result.within, _palette(report))
    body = figures.to_div(fig) + notes(extra)
    return section(title, body, "aspect")


def coordcheck_section(folder: Path | None, limit: int = 6) -> str:
    title = "Coordinate checks"
    images = sorted(folder.glob("*.png"), key=lambda p: p.stat().st_mtime, reverse=True) \
        if folder is not None and folder.is_dir() else []
    if not images:
        # named as the user knows it: a served page does not show the server's paths
        return section(title, nodata(
            "no coord-check plot found under $HPT_HOME/coordcheck; make one with "
            "`hpt coordcheck --axis depth` (and --axis width), which puts its plot there",
            "No coordinate check yet"), "coordcheck")
    parts = []
    for path in images[:limit]:
        data = base64.b64encode(path.read_bytes()).decode("ascii")
        parts.append(f'<h3>{esc(path.name)}</h3><img class="cc" alt="{esc(path.name)}" '
                     f'src="data:image/png;base64,{data}">')
    return section(title, "".join(parts), "coordcheck")


def headline_section(report: FitReport | None) -> str:
    """A study's headline numbers, each with the stage it came from."""
    from hptransfer.analysis.report import headline_lines

    title = "Study headline (each number from the stage in [brackets])"
    if report is None or not report.stages:
        return section(title, nodata("not enough data for the headline because the fits "
                                     "were not computed"), "headline")
    items = "".join(f"<li>{esc(line)}</li>" for line in headline_lines(report))
    return section(title, f'<ul class="headline">{items}</ul>', "headline")


def check_section(report: FitReport | None) -> str:
    title = "Transfer check [stages tune + check]: the LR bracket at the largest shape"
    box = _box(report, "transfer_check")
    result = report.transfer_check if report else None
    if result is None or result.table.empty:
        return section(title, box or nodata("not enough data for the transfer check because "
                                            "no check trial has finished"), "check")
    intro = ('<p class="muted">Loss vs LR at the check shape; dashed line: η* transferred '
             "from the base shape; star: η* measured here (hollow = not reliable). Shift = "
             "log2(η*_here / η*_transferred); 0 means the LR transferred.</p>")
    fig = figures.check_figure(result.curves, result.table, _palette(report))
    rows = [[r["arm"], int(r["width"]), int(r["depth"]), fmt(r["lr_transferred"]),
             fmt(r["lr_check"]), fmt(r["shift_log2"]),
             f"[{fmt(r['shift_ci_low'])}, {fmt(r['shift_ci_high'])}]",
             "yes" if r["reliable"] else "no", r["reason"] or ""]
            for _, r in result.table.iterrows()]
    head = ["arm", "width", "depth", "η* transferred", "η* here", "shift (log2)",
            "shift CI (log2, seed noise)", "reliable", "why"]
    return section(title, intro + (box or "") + figures.to_div(fig) + table(head, rows),
                   "check")
