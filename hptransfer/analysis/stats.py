"""Small statistical helpers shared by the fits."""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import ParamSpec, TypeVar

import numpy as np

try:  # optional: present in most scientific stacks, not a hard dependency of this package
    from threadpoolctl import threadpool_limits
except ImportError:  # pragma: no cover - depends on the environment
    threadpool_limits = None


def percentile_ci(samples: np.ndarray, level: float = 0.95, axis: int = 0) -> np.ndarray:
    """Equal-tailed percentile interval over `axis`, shape (2, ...): numpy's linear
    percentile of the non-NaN samples (NaN: a failed refit, skipped), except that infinite
    samples keep their rank (numpy's interpolation turns a neighbouring infinity into NaN):
    a percentile that falls next to an infinity is that infinity."""
    x = np.sort(np.moveaxis(np.asarray(samples, dtype=float), axis, 0), axis=0)  # NaN last
    n = (~np.isnan(x)).sum(axis=0)
    tail = (1.0 - level) / 2.0
    out = np.full((2, *x.shape[1:]), np.nan)
    if x.shape[0] == 0:
        return out
    for k, q in enumerate((tail, 1.0 - tail)):
        h = np.maximum(n - 1, 0) * q
        below = np.floor(h).astype(int)
        t = h - below
        a = np.take_along_axis(x, below[None], axis=0)[0]
        b = np.take_along_axis(x, np.minimum(below + 1, np.maximum(n - 1, 0))[None], axis=0)[0]
        with np.errstate(invalid="ignore"):
            between = a + (b - a) * t
        # not both finite: -inf below stays -inf, else the +inf above (t > 0) is the value
        edge = np.where((t == 0) | np.isneginf(a), a, b)
        out[k] = np.where(np.isfinite(a) & np.isfinite(b), between, edge)
    out[:, n == 0] = np.nan
    return out


P = ParamSpec("P")
R = TypeVar("R")


def snap_runs(values: np.ndarray, groups: np.ndarray, gap: float) -> np.ndarray:
    """Each run of a group's sorted values whose neighbours are less than `gap` apart, set to
    the run's first (smallest) value: values that differ by rounding become equal, wherever
    they fall (fixed-width bins split two near values whenever a bin edge lies between)."""
    order = np.lexsort((values, groups))
    x, g = values[order], groups[order]
    new = np.ones(len(order), dtype=bool)
    new[1:] = (g[1:] != g[:-1]) | (np.diff(x) > gap)
    snapped = np.empty_like(values, dtype=float)
    snapped[order] = x[np.flatnonzero(new)][np.cumsum(new) - 1]
    return snapped

def single_threaded_blas() -> AbstractContextManager[object]:
    """Run BLAS single-threaded inside the block, when threadpoolctl is available.

    SciPy >= 1.15 L-BFGS-B calls LAPACK on tiny matrices; with a multi-threaded OpenBLAS on a
    busy machine each call can cost milliseconds (scipy issue #22438). One thread is fastest
    for these small fits.
    """
    if threadpool_limits is None:
        return nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


def single_threaded(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorator form of `single_threaded_blas` for whole fitting functions."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with single_threaded_blas():
            return fn(*args, **kwargs)

    return wrapper
