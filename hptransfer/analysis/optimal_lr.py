"""Optimal learning rate per shape: a quadratic in log2(lr) around the best grid point
(the fit itself is in parabola.py), with its CI from the seed noise (noise.py).

η* is `reliable` when its fit is `sound` (vertex inside the fitted LRs, convex, off the grid's
edge, one basin) and `informative`: its CI is no wider than ±`max_ci_log2` octaves and the
bracket's losses rise on both sides of the best LR by more than the seed noise. One seed per
LR measures no noise, so gives no CI: not reliable, and `reason` says so.

Everything is computed for all shapes at once on padded (shape x LR) matrices, so the cost
grows with the number of trials through a few numpy passes, not a Python loop per trial.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from hptransfer.jsonsafe import frame_records

from .basins import RIVAL_TOLERANCE, rival_basins
from .errors import NotEnoughData
from .lr_cells import POINT_COLUMNS, Cells, build_cells, matrix
from .noise import (
    ETA_CI_LOG2,
    bracket_rise,
    coefficient_cov,
    paired_sd,
    pooled_sd,
    t_quantile,
    vertex_ci,
)
from .parabola import ParabolaFits, fit_parabolas
from .serialize import analysis_dict
from .trials import CORE_COLUMNS, IGNORED, OK, Trials, prepare_trials

SHAPE_KEYS: tuple[str, ...] = ("arm", "width", "depth", "sigma_base")
_WHAT = "the optimal LR"


@dataclass
class OptimalLRResult:
    """η* per shape. `shapes` has one row per shape, `curves` one row per shape x LR."""

    shapes: pd.DataFrame
    curves: pd.DataFrame
    keys: tuple[str, ...]
    reason: NotEnoughData | None = None
    warnings: list[str] = field(default_factory=list)
    bootstrap: int = 0
    ci_level: float = 0.95
    max_ci_log2: float = ETA_CI_LOG2

    @property
    def reliable(self) -> bool:
        return self.reason is None and bool(self.shapes["reliable"].all())

    def to_frame(self) -> pd.DataFrame:
        return self.shapes.copy()

    def to_dict(self) -> dict[str, Any]:
        return analysis_dict(
            "optimal_lr",
            self,
            first={"keys": list(self.keys)},
            bootstrap=self.bootstrap,
            ci_level=self.ci_level,
            max_ci_log2=self.max_ci_log2,
            shapes=frame_records(self.shapes),
        )

    def best_points(self) -> pd.DataFrame:
        """Per (arm, width, depth, extra keys): the shape row with the lowest observed loss.

        This is "each shape at its best LR" (and best sigma_base) used by the compute fits.
        """
        point_keys = [k for k in self.keys if k != "sigma_base"]
        rows = self.shapes[np.isfinite(self.shapes["best_loss"].to_numpy(dtype=float))]
        rows = rows.sort_values("best_loss", kind="stable")
        return (
            rows.drop_duplicates(subset=point_keys).sort_values(point_keys).reset_index(drop=True)
        )


def _label(row: dict[str, Any]) -> str:
    parts = [f"{k}={row[k]}" for k in row]
    return ", ".join(parts)


def _fmt(value: float) -> str:
    return f"{value:.3g}"


def _shape_notes(
    *,
    edge: str | None,
    best_lr: float,
    concave: bool,
    clamped: bool,
    lr_opt: float,
    div_best: int,
    runs_best: int,
    div_next: int,
    runs_next: int,
    rival: tuple[float, float] | None,
    best_loss: float,
) -> list[str]:
    """Human-readable warnings for one shape's η*."""
    notes: list[str] = []
    if edge == "low":
        notes.append(f"best LR is the lowest tested: extend the LR grid below {_fmt(best_lr)}")
    elif edge == "high":
        notes.append(f"best LR is the highest tested: extend the LR grid above {_fmt(best_lr)}")
    if concave:
        notes.append(
            "loss is not convex around the best LR (the parabola opens downward); "
            "η* set to the best grid LR"
        )
    if clamped:
        notes.append(
            f"the parabola's vertex lies outside the fitted LRs; η* clamped to {_fmt(lr_opt)}"
        )
    if rival is not None:
        rival_lr, rival_loss = rival
        notes.append(
            f"two basins: LR {_fmt(rival_lr)} trained to {rival_loss:.4g}, within "
            f"{RIVAL_TOLERANCE:.0%} of the best LR {_fmt(best_lr)}'s {best_loss:.4g}, with "
            "worse LRs between them; η* could be in either: try LRs around both (or more "
            "seeds, a longer budget)"
        )
    if div_best > 0:
        notes.append(
            f"the best LR diverged in {div_best} of {runs_best} runs; its mean loss covers the "
            "survivors only"
        )
    if div_next > 0:
        notes.append(
            f"the next LR above the best diverged in {div_next} of {runs_next} runs: η* is "
            "close to the stability limit"
        )
    return notes


def _empty_result(
    keys: tuple[str, ...], reason: NotEnoughData, warnings: list[str], bootstrap: int, ci: float,
    max_ci_log2: float,
) -> OptimalLRResult:
    # a key may also be a point column (per_budget keys on tokens): one column each
    shapes = pd.DataFrame(columns=[*keys, *(c for c in _SHAPE_COLUMNS if c not in keys)])
    curves = pd.DataFrame(columns=[*keys, *(c for c in _CURVE_COLUMNS if c not in keys)])
    for col in ("reliable", "sound", "informative"):
        shapes[col] = shapes[col].astype(bool)
    shapes["best_loss"] = shapes["best_loss"].astype(float)
    return OptimalLRResult(shapes, curves, keys, reason, warnings, bootstrap, ci, max_ci_log2)


_SHAPE_COLUMNS = (
    "n_lrs", "n_completed", "n_diverged", "n_seeds", "best_lr", "best_loss", "lr_opt",
    "log2_lr_opt", "lr_ci_low", "lr_ci_high", "log2_ci_low", "log2_ci_high", "ci_half_log2",
    "noise_sd", "noise_dof", "eta_noise_sd", "eta_noise_dof", "seeds_paired", "bracket_rise",
    "bracket_noise", "loss_at_opt",
    "curvature", "n_fit_points", "edge", "clamped", "concave", "rival_lr", "sound",
    "informative", "reliable", "reason",
    "warnings", "fit_lrs", "residuals", *POINT_COLUMNS, "best_trial_ids", "trial_ids",
    "n_pruned", "pruned",
)
_CURVE_COLUMNS = (
    "lr", "log2_lr", "mean_loss", "std_loss", "n_completed", "n_diverged", "in_fit", "residual",
)


def _pruned_by_shape(
    frame: pd.DataFrame, key_frame: pd.DataFrame, keys: tuple[str, ...]
) -> list[list[dict[str, Any]]]:
    """Per shape (rows of key_frame): its pruned trials as {lr, step, trial_id}, by LR.

    Pruned trials stopped early, so they are not in the fit (their loss is at another
    step); they are listed so a search's report shows what was stopped, and when.
    """
    out: list[list[dict[str, Any]]] = [[] for _ in range(len(key_frame))]
    pruned = frame[frame["status"].to_numpy() == "pruned"]
    if pruned.empty:
        return out
    index = key_frame.assign(shape_row=np.arange(len(key_frame)))
    matched = pruned[[*keys, "lr", "steps", "trial_id"]].astype(
        {k: index[k].dtype for k in keys}
    ).merge(index, on=list(keys), how="inner").sort_values(["shape_row", "lr"], kind="stable")
    for row in matched.itertuples(index=False):
        step = float(row.steps)
        out[int(row.shape_row)].append(
            {"lr": float(row.lr), "step": int(step) if np.isfinite(step) else None,
             "trial_id": str(row.trial_id)}
        )
    return out


def optimal_lr(
    data: pd.DataFrame | Trials,
    *,
    bootstrap: int = 200,
    seed: int | None = 0,
    ci: float = 0.95,
    extra_keys: Sequence[str] = (),
    neighbours: int = 2,
    max_ci_log2: float = ETA_CI_LOG2,
) -> OptimalLRResult:
    """η* for every shape (arm x width x depth x sigma_base, plus `extra_keys`).

    Loss is averaged over seeds per LR (diverged runs excluded but counted), the best LR is
    taken, and a quadratic in log2(lr) is fitted on it and up to `neighbours` LRs each side.
    The CI (level `ci`) is Fieller's for the vertex, from the seed noise pooled over the
    fitted LRs (`noise.vertex_ci`): exact for Gaussian noise, so it needs no resamples
    (`bootstrap` and `seed` are kept for the callers that pass them to every fit). η* is
    `reliable` only when its CI's half-width is at most `max_ci_log2` octaves and the
    bracket rises above the seed noise on both sides (see the module docstring).
    """
    keys = (*SHAPE_KEYS, *extra_keys)
    trials = data if isinstance(data, Trials) else prepare_trials(data, (*CORE_COLUMNS, *keys))
    warnings = list(trials.warnings)
    frame = trials.frame[trials.frame["outcome"].to_numpy() != IGNORED]
    because = _nothing_to_fit(trials, frame)
    if because is not None:
        return _empty_result(keys, NotEnoughData(_WHAT, because), warnings, bootstrap, ci,
                             max_ci_log2)

    sweep = _fit_sweep(build_cells(frame, keys), neighbours)
    noise = _noise_ci(sweep, ci, max_ci_log2)
    flags = _shape_flags(sweep, noise)
    shapes = _shape_table(sweep, flags, noise)
    _add_shape_lists(shapes, sweep, flags, noise)
    pruned = _pruned_by_shape(trials.frame, sweep.cells.key_frame, keys)
    shapes["n_pruned"] = np.array([len(p) for p in pruned], dtype=np.int64)
    shapes["pruned"] = pd.Series(pruned, dtype=object)
    warnings += _summary_warnings(sweep, flags)
    return OptimalLRResult(shapes, _curves(sweep.cells, sweep.fits), keys,
                           _no_fit_reason(sweep), warnings, bootstrap, ci, max_ci_log2)


@dataclass
class _Sweep:
    """Every shape's LR sweep as padded (shape x LR) matrices, and its parabola fit."""

    cells: Cells
    x: np.ndarray  # log2(lr)
    means: np.ndarray
    lr: np.ndarray
    n_ok: np.ndarray
    n_div: np.ndarray
    fits: ParabolaFits
    rows: np.ndarray
    n_lrs: np.ndarray
    n_seeds: np.ndarray
    std: np.ndarray  # each LR's sample std over its seeds (NaN under 2 seeds)
    n_with_loss: np.ndarray  # LRs with a completed run


def _fit_sweep(cells: Cells, neighbours: int) -> _Sweep:
    x = matrix(cells, cells.log2_lr)
    means = matrix(cells, cells.mean)
    fits = fit_parabolas(x, means, neighbours)
    n_ok = matrix(cells, cells.n_ok, 0.0)
    return _Sweep(
        cells, x, means, matrix(cells, cells.lr), n_ok, matrix(cells, cells.n_div, 0.0), fits,
        rows=np.arange(cells.n_shapes),
        n_lrs=np.isfinite(x).sum(axis=1),
        n_seeds=n_ok.max(axis=1).astype(int),
        std=matrix(cells, cells.std),
        n_with_loss=(n_ok > 0).sum(axis=1),
    )


@dataclass
class _Noise:
    """Per shape: the seed noise of its fitted LRs, η*'s CI from it, and whether η* is
    informative (`why`: the reason it is not, for a sound fit; None when it is). `sd`, `dof`:
    the loss noise of one point (the seeds' spread per LR, pooled); `eta_sd`, `eta_dof`: the
    noise η*'s CI and the bracket's rises are judged by, the same or, where `paired`, the
    spread left once each seed's shift of the whole curve is taken out."""

    sd: np.ndarray
    dof: np.ndarray
    eta_sd: np.ndarray
    eta_dof: np.ndarray
    paired: np.ndarray
    log2_ci: np.ndarray  # rows low, high; NaN without a CI, ±inf when unbounded
    half: np.ndarray
    rise: np.ndarray
    rise_noise: np.ndarray
    informative: np.ndarray
    why: list[str | None]


def _noise_ci(sweep: _Sweep, ci: float, max_ci_log2: float) -> _Noise:
    """η*'s CI from the seed noise of each shape's fitted LRs (Fieller's interval for the
    vertex of the OLS quadratic, t with the noise's degrees of freedom): paired by seed where
    every fitted LR ran the same seeds, else pooled per LR."""
    fits = sweep.fits
    # the noise of the LRs the parabola is fitted on (far LRs near divergence spread more)
    sd, dof = pooled_sd(sweep.std, sweep.n_ok, fits.window, axis=1)
    eta_sd, eta_dof, paired = _paired_noise(sweep.cells, fits.window)
    eta_sd, eta_dof = np.where(paired, eta_sd, sd), np.where(paired, eta_dof, dof)
    t = t_quantile(ci, eta_dof)
    window = fits.window & fits.fit_ok[:, None]
    dx = np.where(window, sweep.x - fits.x_best[:, None], 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        var = np.where(window, eta_sd[:, None] ** 2 / np.maximum(sweep.n_ok, 1), 0.0)
    cov = coefficient_cov(dx, window, var)
    lo, hi = vertex_ci(fits.coef[:, 1], fits.coef[:, 2], cov, t)
    has = fits.fit_ok & ~fits.concave
    log2_ci = np.where(has, np.stack([lo, hi]) + fits.x_best, np.nan)
    with np.errstate(invalid="ignore"):
        half = (log2_ci[1] - log2_ci[0]) / 2.0
    rise, rise_noise, rises = bracket_rise(
        np.where(np.isfinite(sweep.x), sweep.x, np.inf), sweep.means, sweep.n_ok, window,
        fits.best, eta_sd, t)
    informative = np.isfinite(half) & (half <= max_ci_log2) & rises
    why: list[str | None] = []
    for s in range(sweep.cells.n_shapes):
        why.append(None if informative[s] or not has[s] else _uninformative(
            float(eta_dof[s]), log2_ci[:, s], float(half[s]), float(rise[s]),
            float(rise_noise[s]), bool(rises[s]), ci, max_ci_log2))
    return _Noise(sd, dof, eta_sd, eta_dof, paired, log2_ci, half, rise, rise_noise,
                  informative, why)


def _paired_noise(cells: Cells, window: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per shape: `noise.paired_sd` of the completed runs at its fitted LRs, its degrees of
    freedom, and whether it applies (every fitted LR ran the same seeds, 2 or more)."""
    sid, col = cells.cell_sid[cells.ok_cell], cells.cell_col[cells.ok_cell]
    fitted = window[sid, col]
    sd, dof = paired_sd(cells.ok_loss[fitted], col[fitted], cells.ok_seed[fitted],
                        sid[fitted], cells.n_shapes)
    return sd, dof, dof > 0


def _uninformative(dof: float, log2_ci: np.ndarray, half: float, rise: float,
                   rise_noise: float, rises: bool, ci: float, max_ci_log2: float) -> str:
    """Why a sound η* is not informative: no CI, a bracket flat within the noise, or a CI
    wider than ±max_ci_log2 octaves."""
    if dof < 1:
        return ("one seed per fitted LR: the loss noise between seeds is not measured, so η* "
                "has no CI and is not reliable; run 2+ seeds per LR")
    if not rises:
        return (f"the bracket is flat within the seed noise: its losses rise {rise:.3g} "
                f"above the best LR's on its flatter side, not more than the noise "
                f"({rise_noise:.3g}, {ci:.0%}): the vertex is noise; add seeds or LRs "
                "further out")
    if not np.isfinite(half):
        return (f"η*'s {ci:.0%} CI is unbounded: the curvature is within the seed noise; "
                "add seeds or LRs further out")
    return (f"η*'s {ci:.0%} CI [2^{log2_ci[0]:.2f}, 2^{log2_ci[1]:.2f}] is ±{half:.2f} "
            f"octave, wider than the ±{max_ci_log2:g} asked (analysis.eta_ci_log2); add seeds")


@dataclass
class _Flags:
    """Per shape: what makes its η* doubtful, and where its best LR is."""

    edge: np.ndarray  # "low", "high" or None
    on_edge: np.ndarray
    rival_col: np.ndarray
    has_rival: np.ndarray
    sound: np.ndarray  # the fit itself: convex, vertex inside, off the edge, one basin
    reliable: np.ndarray  # sound and informative
    best_cell: np.ndarray
    best_lr: np.ndarray
    div_next: np.ndarray
    runs_next: np.ndarray


def _shape_flags(sweep: _Sweep, noise: _Noise) -> _Flags:
    fits, x, rows, cells = sweep.fits, sweep.x, sweep.rows, sweep.cells
    x_min = np.nanmin(x, axis=1)
    x_max = np.nanmax(x, axis=1)
    edge = np.where(
        ~fits.has_data | (sweep.n_lrs < 2),
        None,
        np.where(fits.x_best <= x_min, "low", np.where(fits.x_best >= x_max, "high", None)),
    )
    on_edge = np.array([e is not None for e in edge], dtype=bool)
    rival_col = _rival_columns(x, sweep.means)
    has_rival = rival_col >= 0
    sound = fits.fit_ok & ~fits.concave & ~fits.clamped & ~on_edge & ~has_rival
    # Divergence right above the best LR means η* sits near the stability limit.
    next_col = np.minimum(fits.best + 1, cells.n_cols - 1)
    has_next = (fits.best + 1 < cells.n_cols) & np.isfinite(x[rows, next_col])
    n_div, n_ok = sweep.n_div, sweep.n_ok
    return _Flags(
        edge, on_edge, rival_col, has_rival, sound, sound & noise.informative,
        best_cell=np.flatnonzero(cells.cell_col == 0)[rows] + fits.best,
        best_lr=sweep.lr[rows, fits.best],
        div_next=np.where(has_next, n_div[rows, next_col], 0),
        runs_next=np.where(has_next, n_div[rows, next_col] + n_ok[rows, next_col], 0),
    )


def _shape_table(sweep: _Sweep, flags: _Flags, noise: _Noise) -> pd.DataFrame:
    """The per-shape columns computed for all shapes at once (the lists come after)."""
    fits, has = sweep.fits, sweep.fits.has_data
    shapes = sweep.cells.key_frame.copy()
    shapes["n_lrs"] = sweep.n_lrs
    shapes["n_completed"] = sweep.n_ok.sum(axis=1).astype(int)
    shapes["n_diverged"] = sweep.n_div.sum(axis=1).astype(int)
    shapes["n_seeds"] = sweep.n_seeds
    shapes["best_lr"] = np.where(has, flags.best_lr, np.nan)
    shapes["best_loss"] = np.where(has, fits.y_best, np.nan)
    shapes["lr_opt"] = 2.0**fits.log2_opt
    shapes["log2_lr_opt"] = fits.log2_opt
    log2_ci = noise.log2_ci
    # an unbounded side has no LR (2^-inf would read as a CI ending at LR 0): NaN, null in
    # JSON, like the log2 endpoint beside it
    with np.errstate(over="ignore"):
        shapes["lr_ci_low"] = np.where(np.isfinite(log2_ci[0]), 2.0 ** log2_ci[0], np.nan)
        shapes["lr_ci_high"] = np.where(np.isfinite(log2_ci[1]), 2.0 ** log2_ci[1], np.nan)
    shapes["log2_ci_low"] = log2_ci[0]
    shapes["log2_ci_high"] = log2_ci[1]
    shapes["ci_half_log2"] = noise.half
    shapes["noise_sd"] = noise.sd
    shapes["noise_dof"] = noise.dof.astype(int)
    shapes["eta_noise_sd"] = noise.eta_sd
    shapes["eta_noise_dof"] = noise.eta_dof.astype(int)
    shapes["seeds_paired"] = noise.paired
    shapes["bracket_rise"] = np.where(np.isfinite(noise.rise), noise.rise, np.nan)
    shapes["bracket_noise"] = noise.rise_noise
    shapes["loss_at_opt"] = fits.loss_opt
    shapes["curvature"] = np.where(fits.fit_ok, fits.coef[:, 2], np.nan)
    shapes["n_fit_points"] = np.where(fits.fit_ok, fits.n_fit, 0)
    shapes["edge"] = pd.Series(flags.edge, dtype=object)
    shapes["clamped"] = fits.clamped
    shapes["concave"] = fits.concave
    shapes["rival_lr"] = np.where(
        flags.has_rival, sweep.lr[sweep.rows, np.maximum(flags.rival_col, 0)], np.nan)
    shapes["sound"] = flags.sound
    shapes["informative"] = noise.informative
    shapes["reliable"] = flags.reliable
    return shapes


def _add_shape_lists(
    shapes: pd.DataFrame, sweep: _Sweep, flags: _Flags, noise: _Noise
) -> None:
    """Add the columns that hold a text or a list per shape, and the best point's own
    columns after them. `reason`: why a shape has no η*, or why its sound η* is not
    informative (no CI, flat bracket, CI too wide); the warnings say why an unsound one
    is not reliable."""
    fits, n_ok_m, n_div_m, lr_m = sweep.fits, sweep.n_ok, sweep.n_div, sweep.lr
    ids, start, n_ok = sweep.cells.ok_ids_by_cell
    key_records = sweep.cells.key_frame.to_dict("records")
    lists: dict[str, list[Any]] = {
        "reason": [], "warnings": [], "fit_lrs": [], "residuals": [], "best_trial_ids": []}
    for s in range(sweep.cells.n_shapes):
        best = fits.best[s]
        lists["reason"].append(_shape_reason(
            _label(key_records[s]), bool(fits.has_data[s]), bool(fits.fit_ok[s]),
            int(n_div_m[s].sum()), int(sweep.n_with_loss[s]))
            or (noise.why[s] if flags.sound[s] else None))
        lists["warnings"].append(_shape_notes(
            edge=flags.edge[s],
            best_lr=float(flags.best_lr[s]),
            concave=bool(fits.concave[s]),
            clamped=bool(fits.clamped[s]),
            lr_opt=float(2.0 ** fits.log2_opt[s]),
            div_best=int(n_div_m[s, best]),
            runs_best=int(n_div_m[s, best] + n_ok_m[s, best]),
            div_next=int(flags.div_next[s]) if fits.has_data[s] else 0,
            runs_next=int(flags.runs_next[s]),
            rival=((float(lr_m[s, flags.rival_col[s]]), float(sweep.means[s, flags.rival_col[s]]))
                   if flags.has_rival[s] else None),
            best_loss=float(fits.y_best[s]),
        ))
        win = fits.window[s] & fits.fit_ok[s]
        lists["fit_lrs"].append(lr_m[s, win].tolist())
        lists["residuals"].append(fits.residuals[s, win].tolist())
        c = flags.best_cell[s]
        lists["best_trial_ids"].append(
            ids[start[c] : start[c] + n_ok[c]].tolist() if fits.has_data[s] else [])
    for col in ("reason", "warnings", "fit_lrs", "residuals"):
        shapes[col] = pd.Series(lists[col], dtype=object)
    for col in POINT_COLUMNS:
        shapes[col] = np.where(fits.has_data, sweep.cells.point_means[col][flags.best_cell],
                               np.nan)
    shapes["best_trial_ids"] = pd.Series(lists["best_trial_ids"], dtype=object)
    shapes["trial_ids"] = pd.Series(
        [a.tolist() for a in sweep.cells.ok_ids_by_shape], dtype=object)


def _no_fit_reason(sweep: _Sweep) -> NotEnoughData | None:
    """Why no shape has an η* at all (None when one has)."""
    if sweep.fits.fit_ok.any():
        return None
    return NotEnoughData(
        _WHAT,
        "no shape has at least 3 LRs with a completed run "
        f"(most LRs with a completed run in one shape: {int(sweep.n_with_loss.max())})",
    )


def _summary_warnings(sweep: _Sweep, flags: _Flags) -> list[str]:
    """The result's warnings on how many shapes are at the grid's edge or unreliable."""
    out: list[str] = []
    n_edge = int(flags.on_edge.sum())
    if n_edge:
        out.append(
            f"{n_edge} of {sweep.cells.n_shapes} shapes have their best LR at the edge of the "
            "LR grid"
        )
    n_bad = int((sweep.fits.fit_ok & ~flags.sound).sum())
    if n_bad:
        out.append(f"{n_bad} fitted shapes are unreliable (edge, clamped, concave or "
                   "two basins)")
    n_vague = int((flags.sound & ~flags.reliable).sum())
    if n_vague:
        out.append(f"{n_vague} sound η* fits are not reliable: no CI (one seed), a bracket "
                   "flat within the seed noise, or a CI wider than asked (see each reason)")
    return out


def _rival_columns(x: np.ndarray, means: np.ndarray) -> np.ndarray:
    """Per shape (row), the column of its lowest rival basin (basins.py), or -1. A row's
    LRs fill its first columns (the padding after them is NaN)."""
    out = np.full(len(x), -1, dtype=int)
    for s, (row_x, row_mean) in enumerate(zip(x, means, strict=True)):
        n = int(np.isfinite(row_x).sum())
        rivals = rival_basins(row_x[:n], row_mean[:n])
        if rivals:
            out[s] = rivals[0]
    return out


def _nothing_to_fit(trials: Trials, frame: pd.DataFrame) -> str | None:
    """Why no shape can be fitted at all (None when some trial completed)."""
    if trials.frame.empty:
        return "there are no trials"
    if frame.empty:
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(trials.status_counts.items()))
        return f"no trial has finished as completed or diverged ({counts})"
    if not (frame["outcome"].to_numpy() == OK).any():
        return f"all {len(frame)} finished trials diverged"
    return None


def _shape_reason(label: str, has_data: bool, fit_ok: bool, n_diverged: int,
                  n_with_loss: int) -> str | None:
    """Why one shape has no η* (None when it was fitted)."""
    what = f"the optimal LR of {label}"
    if not has_data:
        return NotEnoughData(what, f"all {n_diverged} trials of this shape diverged").message
    if not fit_ok:
        return NotEnoughData(
            what,
            f"only {n_with_loss} LR(s) have a completed run (the quadratic fit needs at least 3)",
        ).message
    return None


def _curves(cells: Cells, fits: ParabolaFits) -> pd.DataFrame:
    """One row per shape x LR: the mean loss curve and which points the fit used."""
    curves = cells.key_frame.iloc[cells.cell_sid].reset_index(drop=True)
    curves["lr"] = cells.lr
    curves["log2_lr"] = cells.log2_lr
    curves["mean_loss"] = cells.mean
    curves["std_loss"] = cells.std
    curves["n_completed"] = cells.n_ok
    curves["n_diverged"] = cells.n_div
    curves["in_fit"] = (fits.window & fits.fit_ok[:, None])[cells.cell_sid, cells.cell_col]
    curves["residual"] = fits.residuals[cells.cell_sid, cells.cell_col]
    return curves


def as_optimal(
    data: pd.DataFrame | Trials | OptimalLRResult, needs: Sequence[str] = ()
) -> OptimalLRResult:
    """Accept trials or an existing η* result; trials must also hold the columns in `needs`."""
    if isinstance(data, OptimalLRResult):
        return data
    if not isinstance(data, Trials):
        data = prepare_trials(data, (*CORE_COLUMNS, *needs))
    if not budgets_vary(data):
        return optimal_lr(data, bootstrap=0)
    # Averaged, a shape's runs at several budgets made one point at the mean tokens (a
    # Chinchilla fit then saw one D per N); each budget is its own point, as in a study
    result = per_budget(data)
    result.warnings.append("some shapes were trained at several token budgets: each budget is "
                           "a point of its own (a diverged run, stopped early, is apart too)")
    return result


def per_budget(trials: Trials) -> OptimalLRResult:
    """Best point per (arm, shape, tokens trained): a shape at two budgets is two points."""
    return optimal_lr(trials, bootstrap=0, extra_keys=("tokens",))


def budgets_vary(trials: Trials) -> bool:
    """Whether the completed runs of some shape differ in the tokens they trained."""
    frame = trials.frame
    done = frame[(frame["outcome"].to_numpy() == OK) & np.isfinite(frame["tokens"].to_numpy())]
    if done.empty:
        return False
    spread = done.groupby(list(SHAPE_KEYS), dropna=False)["tokens"].agg(["min", "max"])
    return bool((spread["max"] > spread["min"] * (1 + 1e-9)).any())
