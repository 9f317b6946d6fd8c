"""`fit_report`: every analysis on one trial frame, as tables, JSON-safe dict or CLI text."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import pandas as pd

from hptransfer.contracts.sizes import SIZE_TOLERANCE
from hptransfer.jsonsafe import json_safe

from .aspect_ratio import AspectRatioResult, optimal_aspect_ratio
from .chinchilla import ChinchillaResult, chinchilla_fit
from .errors import AnalysisError
from .frontier import FrontierResult, loss_compute_frontier
from .noise import ETA_CI_LOG2
from .optimal_lr import OptimalLRResult, as_optimal, budgets_vary, optimal_lr
from .savings import SavingsResult, flop_savings
from .staged import TransferCheckResult
from .stats import single_threaded_blas
from .targets import target_lines
from .transfer import TransferResult, transfer_drift
from .trials import CORE_COLUMNS, MUP_LABELS, SP_LABELS, Trials, prepare_trials

TABLE_NAMES: tuple[str, ...] = (
    "optimal_lr",
    "transfer",
    "transfer_check",
    "frontier",
    "savings",
    "aspect_ratio",
    "chinchilla",
)
# Parameterization labels taken as µP when picking a default reference arm (the paper's).

T = TypeVar("T")


@dataclass
class FitReport:
    """All analyses of one sweep. Analyses that could not run are None (see `failures`)."""

    n_trials: int = 0
    status_counts: dict[str, int] = field(default_factory=dict)
    reference_arm: str | None = None
    bootstrap: int = 0
    seed: int | None = 0
    error: str | None = None
    warnings: list[str] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)
    optimal_lr: OptimalLRResult | None = None
    transfer: TransferResult | None = None
    frontier: FrontierResult | None = None
    savings: SavingsResult | None = None
    aspect_ratio: AspectRatioResult | None = None
    chinchilla: ChinchillaResult | None = None
    # a staged study's report: the transfer check, and the stage each analysis came from
    transfer_check: TransferCheckResult | None = None
    stages: dict[str, str] = field(default_factory=dict)
    # a study's stage targets as its planner left them (met or not, trials spent on each;
    # coordinator/targets.py), in stage order; empty without targets
    targets: list[dict[str, Any]] = field(default_factory=list)

    def results(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in TABLE_NAMES}

    def tables(self) -> dict[str, pd.DataFrame]:
        """One DataFrame per analysis, keyed by TABLE_NAMES; when it did not run, empty with
        the columns its text table shows (so `table["reliable"]` works either way)."""
        return {
            name: result.to_frame() if result is not None
            else pd.DataFrame(columns=_TEXT_COLUMNS[name])
            for name, result in self.results().items()
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe (NaN/inf become None): `json.dumps(..., allow_nan=False)` works."""
        return json_safe(
            {
                "n_trials": self.n_trials,
                "status_counts": self.status_counts,
                "reference_arm": self.reference_arm,
                "bootstrap": self.bootstrap,
                "seed": self.seed,
                "error": self.error,
                "warnings": self.warnings,
                "failures": self.failures,
                "stages": self.stages,
                "headline": headline(self) if self.stages else None,
                "targets": self.targets,
                "analyses": {
                    name: result.to_dict() if result is not None else None
                    for name, result in self.results().items()
                },
            }
        )

    def format_text(self, max_notes: int = 12) -> str:
        """Readable tables for a terminal; unreliable numbers are shown rounded, with '~'."""
        return _format_report(self, max_notes)


def _choose_reference(trials: Trials) -> tuple[str | None, str | None]:
    frame = trials.frame
    arms = sorted(frame["arm"].unique().tolist())
    if not arms:
        return None, None
    pairs = frame[["arm", "parameterization"]].drop_duplicates()
    labels = pairs["parameterization"].str.lower()
    # the paper's baselines: savings are quoted against µP, else against SP
    for baseline, name in ((MUP_LABELS, "µP"), (SP_LABELS, "SP")):
        found = sorted(set(pairs["arm"].to_numpy()[labels.isin(baseline).to_numpy(bool)]))
        if len(found) == 1:
            return found[0], f"no reference arm given; using the {name} arm {found[0]}"
    return arms[0], f"no reference arm given; using {arms[0]} (first by name)"


def fit_report(
    df: pd.DataFrame,
    reference_arm: str | None = None,
    *,
    bootstrap: int = 200,
    seed: int | None = 0,
    ci: float = 0.95,
    extra_keys: Sequence[str] = (),
    transfer_tolerance: float = 0.1,
    size_tolerance: float = SIZE_TOLERANCE,
    within: float = 0.01,
    n_grid: int = 20,
    neighbours: int = 2,
    max_ci_log2: float = ETA_CI_LOG2,
) -> FitReport:
    """Run every analysis. Never raises on bad data: problems become reasons and warnings.

    `bootstrap` resamples (0 turns all bootstraps off) and `seed` make the CIs reproducible.
    `reference_arm` defaults to the arm whose parameterization is µP, else SP, else the first arm.
    `neighbours`: completed LRs each side of the best in η*'s quadratic (2 for grids; 1 for
    searches, whose LRs crowd around η* and thin out far away, where a wider window lets the
    far, asymmetric tail pull the vertex). `max_ci_log2`: the widest η* CI (half-width,
    octaves) that is reliable.
    """
    report = FitReport(bootstrap=bootstrap, seed=seed)
    try:
        trials = prepare_trials(df, (*CORE_COLUMNS, *extra_keys))
    except AnalysisError as exc:
        report.error = str(exc)
        report.n_trials = len(df) if isinstance(df, pd.DataFrame) else 0
        return report
    report.n_trials = trials.n_input
    report.status_counts = trials.status_counts
    missing = [c for c in ("flops", "tokens", "params_non_embedding") if c not in df.columns]
    if missing:
        report.warnings.append(f"columns missing, dependent fits skipped: {', '.join(missing)}")

    def run(name: str, fn: Callable[[], T]) -> T | None:
        # A bug in one analysis must not take the whole report (and the CLI) down with it.
        try:
            return fn()
        except Exception as exc:
            report.failures[name] = f"{type(exc).__name__}: {exc}"
            return None

    with single_threaded_blas():
        opt = run(
            "optimal_lr",
            lambda: optimal_lr(
                trials, bootstrap=bootstrap, seed=seed, ci=ci, extra_keys=extra_keys,
                neighbours=neighbours, max_ci_log2=max_ci_log2,
            ),
        )
        report.optimal_lr = opt
        if opt is None:
            return report
        report.warnings.extend(opt.warnings)
        report.transfer = run(
            "transfer", lambda: transfer_drift(opt, ci=ci, tolerance=transfer_tolerance)
        )
        # the compute fits take each shape at each of its budgets as a point of its own
        points = opt
        if not extra_keys and budgets_vary(trials):
            points = run("best_points", lambda: as_optimal(trials))
            if points is None:
                return report
        if points is not opt:
            report.warnings.extend(w for w in points.warnings if w not in opt.warnings)
        frontier = run(
            "frontier",
            lambda: loss_compute_frontier(points, bootstrap=bootstrap, seed=seed, ci=ci))
        report.frontier = frontier
        if frontier is not None:
            report.warnings.extend(frontier.left_out)
        if reference_arm is None:
            reference_arm, note = _choose_reference(trials)
            if note and trials.frame["arm"].nunique() > 1:
                report.warnings.append(note)
        report.reference_arm = reference_arm
        if frontier is not None:
            report.savings = run(
                "savings", lambda: flop_savings(frontier, reference_arm, n_grid=n_grid, ci=ci)
            )
        report.aspect_ratio = run(
            "aspect_ratio",
            lambda: optimal_aspect_ratio(points, tolerance=size_tolerance, within=within,
                                         bootstrap=bootstrap, seed=seed, ci=ci),
        )
        if report.aspect_ratio is not None:  # in the text too, not only the JSON
            report.warnings.extend(report.aspect_ratio.set_aside)
        report.chinchilla = run(
            "chinchilla", lambda: chinchilla_fit(points, bootstrap=bootstrap, seed=seed, ci=ci)
        )
    return report


# ---------------------------------------------------------------- text rendering

_TEXT_COLUMNS: dict[str, list[str]] = {
    "optimal_lr": [
        "arm",
        "width",
        "depth",
        "sigma_base",
        "n_completed",
        "n_diverged",
        "best_lr",
        "lr_opt",
        "lr_ci_low",
        "lr_ci_high",
        "ci_half_log2",
        "eta_noise_sd",
        "seeds_paired",
        "edge",
        "reliable",
    ],
    "transfer": [
        "arm",
        "sigma_base",
        "axis",
        "slope",
        "ci_low",
        "ci_high",
        "max_shift_log2",
        "verdict",
        "reliable",
    ],
    "frontier": [
        "arm",
        "n_points",
        "n_frontier",
        "E",
        "A",
        "b",
        "b_ci_low",
        "b_ci_high",
        "loss_min",
        "loss_max",
        "seed_noise_log",
        "reliable",
    ],
    "transfer_check": [
        "arm",
        "width",
        "depth",
        "lr_transferred",
        "lr_check",
        "shift_log2",
        "shift_ci_low",
        "shift_ci_high",
        "n_lrs",
        "edge",
        "reliable",
    ],
    "savings": ["arm", "reference", "loss", "savings", "ci_low", "ci_high", "reliable"],
    "aspect_ratio": [
        "arm",
        "params_median",
        "n_points",
        "nl_opt",
        "nl_within_low",
        "nl_within_high",
        "nl_ci_low",
        "nl_ci_high",
        "loss_opt",
        "edge",
        "reliable",
    ],
    "chinchilla": [
        "arm",
        "n_points",
        "E",
        "A",
        "B",
        "alpha",
        "beta",
        "alpha_ci_low",
        "alpha_ci_high",
        "beta_ci_low",
        "beta_ci_high",
        "n_exponent",
        "n_exponent_ci_low",
        "n_exponent_ci_high",
        "reliable",
    ],
}
_TITLES = {
    "optimal_lr": "Optimal LR per shape (η* from a quadratic in log2 lr)",
    "transfer": "Transfer drift (slope of log2 η* per doubling; ≈0 means the LR transfers)",
    "transfer_check": "Transfer check: shift of η* at the largest shape, log2(η*_check/η*_base)",
    "frontier": "Loss vs compute on the frontier: L(C) = E + A·C^-b",
    "savings": "FLOP savings at matched loss: 1 - C_arm/C_ref",
    "aspect_ratio": "Compute-optimal N:L at fixed non-embedding params",
    "chinchilla": "Chinchilla fit: L(N, D) = E + A/N^α + B/D^β",
}


# observed inputs, not estimates: printed exactly even on an unreliable row
_DATA_COLUMNS = frozenset({"sigma_base", "best_lr", "loss", "loss_min", "loss_max",
                           "compute_min", "compute_max"})


def _cell(value: Any, reliable: bool) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf"
        return f"{value:.4g}" if reliable else f"~{value:.2g}"
    return str(value)


def _render_table(frame: pd.DataFrame, columns: list[str]) -> str:
    columns = [c for c in columns if c in frame.columns]
    if frame.empty or not columns:
        return "  (no rows)"
    flags = frame["reliable"].tolist() if "reliable" in frame else [True] * len(frame)
    cells = [
        [_cell(row[c], bool(ok) or c in _DATA_COLUMNS) for c in columns]
        for (_, row), ok in zip(frame.iterrows(), flags, strict=True)
    ]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  " + "  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  " + "  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def _notes(frame: pd.DataFrame, keys: list[str], max_notes: int) -> list[str]:
    out: list[str] = []
    if frame.empty:
        return out
    keys = [k for k in keys if k in frame.columns]
    for _, row in frame.iterrows():
        label = " ".join(f"{k}={row[k]}" for k in keys)
        reason = row.get("reason")
        if isinstance(reason, str) and reason:
            out.append(f"{label}: {reason}")
        for note in row.get("warnings", None) or []:
            out.append(f"{label}: {note}")
    if len(out) > max_notes:
        out = out[:max_notes] + [f"... and {len(out) - max_notes} more"]
    return out


def _any_pruned(frame: pd.DataFrame) -> bool:
    return "n_pruned" in frame and bool((frame["n_pruned"].fillna(0) > 0).any())


def _pruned_lines(frame: pd.DataFrame) -> list[str]:
    """One line per shape with pruned trials: each one's LR and the step it stopped at."""
    if not _any_pruned(frame):
        return []
    lines = ["  pruned trials (stopped early, so not in the fit): LR @ step"]
    for _, row in frame[frame["n_pruned"] > 0].iterrows():
        stops = ", ".join(
            f"2^{math.log2(p['lr']):.2f} @ {p['step'] if p['step'] is not None else '?'}"
            for p in row["pruned"]
        )
        lines.append(f"    {row['arm']} width={row['width']} depth={row['depth']}: {stops}")
    return lines


def _format_report(report: FitReport, max_notes: int) -> str:
    counts = ", ".join(f"{k}: {v}" for k, v in sorted(report.status_counts.items()))
    lines = [f"hptransfer fit report: {report.n_trials} trials ({counts or 'none'})"]
    if report.error:
        lines.append(f"ERROR: {report.error}")
        return "\n".join(lines)
    lines.append(f"reference arm: {report.reference_arm}; bootstrap resamples: {report.bootstrap}")
    lines += [f"warning: {w}" for w in dict.fromkeys(report.warnings)]
    lines += [f"FAILED {name}: {msg}" for name, msg in report.failures.items()]
    tables = report.tables()
    if report.stages:
        lines += ["", "== Headline (each number from the stage in [brackets]) =="]
        lines += [f"  {line}" for line in headline_lines(report)]
    if report.targets:
        lines += ["", "== Targets (trials the study added until each was met, or its cap "
                  "spent) =="]
        lines += [f"  {line}" for line in target_lines(report.targets)]
    for name in TABLE_NAMES:
        result = getattr(report, name)
        if result is None and (name in report.stages) != bool(report.stages):
            continue  # study-only analyses in a plain sweep, or the reverse
        source = f" [from stage: {report.stages[name]}]" if name in report.stages else ""
        lines += ["", f"== {_TITLES[name]}{source} =="]
        if result is None:
            lines.append("  (not run)")
            continue
        frame = tables[name]
        if name == "savings" and not frame.empty:
            # A few evenly spaced losses per arm are enough to read; the dict has the grid.
            pos = frame.groupby("arm").cumcount().to_numpy()
            step = (frame.groupby("arm")["arm"].transform("size").to_numpy() // 5).clip(1)
            frame = frame[pos % step == 0]
        if name == "aspect_ratio" and not frame.empty:
            # Sizes run at fewer than 4 aspect ratios are expected in most sweeps: count them.
            unfitted = frame["reason"].notna().to_numpy()
            if unfitted.any():
                lines.append(
                    f"  {int(unfitted.sum())} size groups have fewer than 4 aspect "
                    "ratios and were not fitted"
                )
            frame = frame[~unfitted]
        if getattr(result, "reason", None) is not None:
            lines.append(f"  {result.reason}")
        columns = _TEXT_COLUMNS[name]
        if name == "optimal_lr" and _any_pruned(frame):
            columns = [*columns[:6], "n_pruned", *columns[6:]]
        lines.append(_render_table(frame, columns))
        if name == "optimal_lr":
            lines += _pruned_lines(frame)
        keys = ["arm", "width", "depth", "axis", "params_median"]
        if name == "savings":
            lines += [f"  * {c.arm} vs {c.reference}: no CI ({c.no_ci})"
                      for c in result.comparisons.values() if c.no_ci]
        if name == "savings":
            notes = [
                f"arm={a}: {c.reason or w}"
                for a, c in result.comparisons.items()
                for w in (c.warnings if c.reason is None else [None])
            ]
        else:
            notes = _notes(frame, keys, max_notes)
        lines += [f"  * {n}" for n in notes]
    return "\n".join(lines)


# ---------------------------------------------------------------- study headline


def _num(v: Any) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return float("nan")
    return f


def headline(report: FitReport) -> dict[str, Any]:
    """The study's headline numbers, each with the stage it came from and `reliable`."""
    out: dict[str, Any] = {"eta_star": [], "transfer_shift": [], "frontier": [],
                           "savings": [], "aspect_ratio": []}
    if report.optimal_lr is not None and not report.optimal_lr.shapes.empty:
        shapes = report.optimal_lr.shapes
        shapes = shapes[np.isfinite(shapes["best_loss"].to_numpy(dtype=float))]
        for _, r in shapes.sort_values("best_loss").drop_duplicates("arm").iterrows():
            out["eta_star"].append({
                "arm": r["arm"], "width": int(r["width"]), "depth": int(r["depth"]),
                "sigma_base": r["sigma_base"], "lr": r["lr_opt"], "log2_lr": r["log2_lr_opt"],
                "log2_ci_low": r["log2_ci_low"], "log2_ci_high": r["log2_ci_high"],
                "no_ci": _no_ci(r["log2_ci_low"], r["log2_ci_high"], "η*"),
                "noise_sd": r["noise_sd"], "eta_noise_sd": r["eta_noise_sd"],
                "seeds_paired": bool(r["seeds_paired"]), "reliable": bool(r["reliable"]),
                "reason": _why(r), "stage": "tune"})
    if report.transfer_check is not None:
        for _, r in report.transfer_check.table.iterrows():
            out["transfer_shift"].append({
                "arm": r["arm"], "width": int(r["width"]), "depth": int(r["depth"]),
                "shift_log2": r["shift_log2"], "ci_low": r["shift_ci_low"],
                "ci_high": r["shift_ci_high"],
                "no_ci": _no_ci(r["shift_ci_low"], r["shift_ci_high"], "the shift"),
                "reliable": bool(r["reliable"]), "reason": r["reason"],
                "stage": "tune + check"})
    if report.frontier is not None:
        for arm, fit in report.frontier.fits.items():
            b_ci = fit.ci.get("b", (float("nan"), float("nan")))
            out["frontier"].append({"arm": arm, "E": fit.E, "A": fit.A, "b": fit.b,
                                    "b_ci_low": b_ci[0], "b_ci_high": b_ci[1],
                                    "n_points": int(fit.compute.size),
                                    "shared_E": bool(fit.shared_asymptote),
                                    "seed_noise_log": fit.seed_noise,
                                    "reliable": bool(fit.reliable), "stage": "transfer"})
    if report.savings is not None:
        for c in report.savings.comparisons.values():
            out["savings"].append({**c.headline(), "stage": "transfer"})
    if report.aspect_ratio is not None and not report.aspect_ratio.groups.empty:
        g = report.aspect_ratio.groups
        for _, r in g[g["reason"].isna()].iterrows():
            out["aspect_ratio"].append({
                "arm": r["arm"], "params": r["params_median"], "nl_opt": r["nl_opt"],
                "nl_within_low": r["nl_within_low"], "nl_within_high": r["nl_within_high"],
                "nl_ci_low": r["nl_ci_low"], "nl_ci_high": r["nl_ci_high"],
                "within": report.aspect_ratio.within,
                "reliable": bool(r["reliable"]), "stage": "aspect_ratio"})
    out["targets"] = report.targets  # each stage target: met or not, trials spent on it
    return json_safe(out)


def _ok(flag: bool) -> str:
    return "" if flag else "  (NOT reliable)"


def _why(row: pd.Series) -> str | None:
    """Why a η* row is not reliable: its reason, else its warnings (None when reliable)."""
    if bool(row["reliable"]):
        return None
    if isinstance(row.get("reason"), str) and row["reason"]:
        return str(row["reason"])
    return "; ".join(row.get("warnings") or []) or None


def _no_ci(low: Any, high: Any, what: str) -> str | None:
    """Why a headline number's CI endpoints are null in JSON (None: it has a CI): an
    unbounded CI (an infinite endpoint) and a missing one (NaN) both serialize as null."""
    lo, hi = _num(low), _num(high)
    if math.isnan(lo) or math.isnan(hi):
        return f"{what} has no CI (one seed per fitted LR, or no fit)"
    if math.isinf(lo) or math.isinf(hi):
        return (f"{what}'s CI is unbounded: the loss curvature is within the seed noise "
                "(add seeds or LRs further out)")
    return None


def _ci_missing(no_ci: str | None) -> str:
    """', CI unbounded' or ', no CI': the headline's endpoints are null either way (JSON-safe),
    its `no_ci` says which."""
    return ", CI unbounded" if no_ci and "unbounded" in no_ci else ", no CI"


def _log2_ci(low: Any, high: Any, no_ci: str | None) -> str:
    """' [2^a, 2^b]' (octaves), ', CI unbounded' or ', no CI'."""
    lo, hi = _num(low), _num(high)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return _ci_missing(no_ci)
    return f", CI [2^{lo:.2f}, 2^{hi:.2f}]"


def headline_lines(report: FitReport) -> list[str]:
    h = headline(report)
    lines = []
    for r in h["eta_star"]:
        why = f": {r['reason']}" if r.get("reason") else ""
        ci = _log2_ci(r.get("log2_ci_low"), r.get("log2_ci_high"), r.get("no_ci"))
        lines.append(f"η* {r['arm']} at N={r['width']} L={r['depth']}: {_num(r['lr']):.4g} "
                     f"(log2 {_num(r['log2_lr']):+.2f}{ci}) [tune]"
                     f"{_ok(r['reliable'])}{why}")
    for r in h["transfer_shift"]:
        why = f": {r['reason']}" if r["reason"] else ""
        lo, hi = _num(r.get("ci_low")), _num(r.get("ci_high"))
        ci = (f", CI [{lo:+.2f}, {hi:+.2f}]" if math.isfinite(lo) and math.isfinite(hi)
              else _ci_missing(r.get("no_ci")))
        lines.append(f"transfer shift {r['arm']} at N={r['width']} L={r['depth']}: "
                     f"{_num(r['shift_log2']):+.2f} octaves{ci} [tune + check]"
                     f"{_ok(r['reliable'])}{why}")
    for r in h["frontier"]:
        shared = ", E shared by all arms" if r.get("shared_E") else ""
        b_ci = (f", b CI [{_num(r['b_ci_low']):.3f}, {_num(r['b_ci_high']):.3f}]"
                if math.isfinite(_num(r.get("b_ci_low"))) else "")
        noise = _num(r.get("seed_noise_log"))
        seeds = (f", seed noise {noise:.2%} of the loss" if noise > 0
                 else ", one seed: noise unmeasured" if math.isnan(noise) else "")
        lines.append(f"frontier {r['arm']}: L(C) = {_num(r['E']):.3f} + {_num(r['A']):.3g}"
                     f"·C^-{_num(r['b']):.3f} ({r['n_points']} points{b_ci}{shared}{seeds}) "
                     f"[transfer]{_ok(r['reliable'])}")
    for r in h["savings"]:
        if r.get("savings") is None:
            lines.append(f"savings {r['arm']} over {r['reference']}: none "
                         f"({r.get('reason')}) [transfer]")
            continue
        ci = (f"CI [{r['ci_low']:+.1%}, {r['ci_high']:+.1%}]" if r.get("ci_low") is not None
              else f"no CI: {r.get('no_ci') or r.get('note')}")
        lines.append(f"FLOP savings {r['arm']} over {r['reference']} at loss "
                     f"{r['loss']:.3f}: {r['savings']:+.1%}, {ci} [transfer]{_ok(r['reliable'])}")
    for r in h["aspect_ratio"]:
        band = f"within {r.get('within', 0.01):.0%}"  # the loss band the N:L range spans
        nl_lo, nl_hi = _num(r.get("nl_ci_low")), _num(r.get("nl_ci_high"))
        nl_ci = (f", CI {nl_lo:.3g}-{nl_hi:.3g}" if not (math.isnan(nl_lo) or math.isnan(nl_hi))
                 else ", no CI")
        lines.append(f"compute-optimal N:L {r['arm']} at ~{_num(r['params']):.3g} params: "
                     f"{_num(r['nl_opt']):.3g} ({band}: {_num(r['nl_within_low']):.3g}"
                     f"-{_num(r['nl_within_high']):.3g}{nl_ci}) [aspect_ratio]"
                     f"{_ok(r['reliable'])}")
    return lines or ["(no results yet)"]
