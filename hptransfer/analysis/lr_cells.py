"""Trials collapsed to (shape, LR) cells: the padded (shape x LR) matrices the η* fits run
on, with each cell's seed count and spread (the seed noise η*'s CI comes from)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from .stats import snap_runs
from .trials import DIVERGED, OK

# what a shape's point carries besides its loss: the frontier and L(N, D) fit on these
POINT_COLUMNS: tuple[str, ...] = ("flops", "tokens", "params_non_embedding", "params_embedding")


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
    ok_ids_by_cell: tuple[np.ndarray, np.ndarray, np.ndarray]
    ok_ids_by_shape: list[np.ndarray]
    # each completed trial's cell, seed and loss: the losses paired by seed across LRs
    ok_cell: np.ndarray
    ok_seed: np.ndarray
    ok_loss: np.ndarray
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
        ok_ids_by_cell=(ids, start, n_ok),
        ok_ids_by_shape=ok_ids,
        ok_cell=cell[ok],
        ok_seed=frame["seed"].to_numpy(dtype=float)[order][ok],
        ok_loss=loss[ok],
        n_shapes=n_shapes,
        n_cols=int(cell_col.max()) + 1,
    )


def matrix(cells: Cells, values: np.ndarray, fill: float = np.nan) -> np.ndarray:
    out = np.full((cells.n_shapes, cells.n_cols), fill, dtype=float)
    out[cells.cell_sid, cells.cell_col] = values
    return out
