"""Trials collapsed to (shape, LR) cells: the padded (shape x LR) matrices the η* fits run
on, and the seed bootstrap of η* over them (one numpy pass per chunk of resamples)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from .parabola import fit_parabolas
from .stats import snap_runs
from .trials import DIVERGED, OK

# what a shape's point carries besides its loss: the frontier and L(N, D) fit on these
POINT_COLUMNS: tuple[str, ...] = ("flops", "tokens", "params_non_embedding", "params_embedding")
# Resampled loss values held in memory at once during the bootstrap (bounds peak memory).
_BOOT_CHUNK_VALUES = 4_000_000


@dataclass
class Cells:
    """Trials collapsed to (shape, LR) cells, sorted by shape then LR."""

    key_frame: pd.DataFrame
    cell_sid: np.ndarray
    cell_col: np.ndarray
    lr: np.ndarray
    log2_lr: np.ndarray
    n_ok: np.ndarray
    n_div: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    point_means: dict[str, np.ndarray]
    seed_losses: np.ndarray
    ok_ids_by_cell: tuple[np.ndarray, np.ndarray, np.ndarray]
    ok_ids_by_shape: list[np.ndarray]
    n_shapes: int
    n_cols: int


# LRs of one shape this close (in octaves) are one grid point: a float32 round trip moves an
# LR by up to 6e-8 relative, and rounding log2(lr) to 6 decimals split such a pair into two
# cells whenever a rounding boundary fell between them (about 15 % of LRs)
LR_TOLERANCE_OCTAVES = 1e-4


def snapped_log2(lr: np.ndarray, sid: np.ndarray) -> np.ndarray:
    """log2(lr), each run of a shape's values less than LR_TOLERANCE_OCTAVES apart set to
    the run's first value."""
    return snap_runs(np.log2(lr), sid, LR_TOLERANCE_OCTAVES)


def build_cells(frame: pd.DataFrame, keys: tuple[str, ...]) -> Cells:
    grouped = frame.groupby(list(keys), sort=True, dropna=False)
    sid = grouped.ngroup().to_numpy()
    key_frame = grouped.size().index.to_frame(index=False)
    for k in ("width", "depth"):
        if np.all(np.mod(key_frame[k].to_numpy(dtype=float), 1) == 0):
            key_frame[k] = key_frame[k].astype(np.int64)
    n_shapes = len(key_frame)

    log2_lr = snapped_log2(frame["lr"].to_numpy(dtype=float), sid)
    outcome = frame["outcome"].to_numpy()
    order = np.lexsort((outcome, log2_lr, sid))  # OK rows first inside each cell
    sid_s, x_s, out_s = sid[order], log2_lr[order], outcome[order]
    new = np.ones(len(order), dtype=bool)
    new[1:] = (sid_s[1:] != sid_s[:-1]) | (x_s[1:] != x_s[:-1])
    start = np.flatnonzero(new)
    cell = np.cumsum(new) - 1
    n_cells = len(start)

    ok = out_s == OK
    loss = np.where(ok, frame["final_val_loss"].to_numpy(dtype=float)[order], 0.0)
    n_ok = np.bincount(cell, weights=ok, minlength=n_cells).astype(int)
    n_div = np.bincount(cell, weights=out_s == DIVERGED, minlength=n_cells).astype(int)
    sums = np.bincount(cell, weights=loss, minlength=n_cells)
    sq = np.bincount(cell, weights=loss**2, minlength=n_cells)
    with np.errstate(divide="ignore", invalid="ignore"):
        mean = np.where(n_ok > 0, sums / n_ok, np.nan)
        var = np.where(n_ok > 1, (sq - n_ok * mean**2) / (n_ok - 1), np.nan)
    std = np.sqrt(np.clip(var, 0.0, None))

    point_means: dict[str, np.ndarray] = {}
    for col in POINT_COLUMNS:
        v = frame[col].to_numpy(dtype=float)[order]
        good = ok & np.isfinite(v)
        cnt = np.bincount(cell, weights=good, minlength=n_cells)
        tot = np.bincount(cell, weights=np.where(good, v, 0.0), minlength=n_cells)
        with np.errstate(divide="ignore", invalid="ignore"):
            point_means[col] = np.where(cnt > 0, tot / cnt, np.nan)

    # Per-cell seed losses, padded, for resampling seeds in the bootstrap.
    pos = np.arange(len(order)) - start[cell]
    width = max(int(n_ok.max()), 1)
    seed_losses = np.zeros((n_cells, width))
    seed_losses[cell[ok], pos[ok]] = loss[ok]

    cell_sid = sid_s[start]
    first = np.flatnonzero(np.r_[True, cell_sid[1:] != cell_sid[:-1]])
    cell_col = np.arange(n_cells) - first[cell_sid]
    ids = frame["trial_id"].to_numpy(dtype=object)[order]
    # OK rows of one shape are contiguous after the sort: split them into per-shape id lists.
    ok_ids = np.split(ids[ok], np.cumsum(np.bincount(sid_s[ok], minlength=n_shapes))[:-1])
    return Cells(
        key_frame=key_frame,
        cell_sid=cell_sid,
        cell_col=cell_col,
        lr=frame["lr"].to_numpy(dtype=float)[order][start],
        log2_lr=x_s[start],
        n_ok=n_ok,
        n_div=n_div,
        mean=mean,
        std=std,
        point_means=point_means,
        seed_losses=seed_losses,
        ok_ids_by_cell=(ids, start, n_ok),
        ok_ids_by_shape=ok_ids,
        n_shapes=n_shapes,
        n_cols=int(cell_col.max()) + 1,
    )


def matrix(cells: Cells, values: np.ndarray, fill: float = np.nan) -> np.ndarray:
    out = np.full((cells.n_shapes, cells.n_cols), fill, dtype=float)
    out[cells.cell_sid, cells.cell_col] = values
    return out


def bootstrap_log2_opt(
    cells: Cells, x: np.ndarray, n_resamples: int, rng: np.random.Generator, neighbours: int
) -> np.ndarray:
    """η* (log2) refitted on seed-resampled mean losses; shape (n_resamples, n_shapes)."""
    n_cells, width = cells.seed_losses.shape
    n_ok = cells.n_ok
    chunk = max(1, _BOOT_CHUNK_VALUES // max(1, n_cells * width))
    cell_idx = np.arange(n_cells)[None, :, None]
    in_cell = np.arange(width)[None, :] < n_ok[:, None]
    inflation = np.sqrt(n_ok / np.maximum(n_ok - 1, 1))
    out = np.empty((n_resamples, cells.n_shapes))
    for begin in range(0, n_resamples, chunk):
        b = min(chunk, n_resamples - begin)
        # Resample the seeds of each LR independently (same count, with replacement).
        picks = (rng.random((b, n_cells, width)) * n_ok[None, :, None]).astype(np.intp)
        draws = np.where(in_cell[None], cells.seed_losses[cell_idx, picks], 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            means = np.where(n_ok > 0, draws.sum(axis=2) / n_ok, np.nan)
        # A resampled mean varies by s²(n-1)/n², not s²/n: widened by sqrt(n/(n-1)) about
        # the cell's mean, as the power-law bootstrap widens its residuals
        means = cells.mean + inflation * (means - cells.mean)
        y = np.full((b, cells.n_shapes, cells.n_cols), np.nan)
        y[:, cells.cell_sid, cells.cell_col] = means
        fits = fit_parabolas(
            np.tile(x, (b, 1)), y.reshape(b * cells.n_shapes, cells.n_cols), neighbours
        )
        out[begin : begin + b] = fits.log2_opt.reshape(b, cells.n_shapes)
    return out
