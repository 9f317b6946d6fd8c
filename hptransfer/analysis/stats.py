"""Small statistical helpers shared by the fits."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import ParamSpec, TypeVar

import numpy as np

try:  # optional: present in most scientific stacks, not a hard dependency of this package
    from threadpoolctl import threadpool_limits
except ImportError:  # pragma: no cover - depends on the environment
    threadpool_limits = None


def percentile_ci(samples: np.ndarray, level: float = 0.95, axis: int = 0) -> np.ndarray:
    """Equal-tailed percentile interval over `axis`; NaN samples (failed refits) are skipped."""
    tail = 100.0 * (1.0 - level) / 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices give NaN, that is fine
        return np.nanpercentile(samples, [tail, 100.0 - tail], axis=axis)


P = ParamSpec("P")
R = TypeVar("R")


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
