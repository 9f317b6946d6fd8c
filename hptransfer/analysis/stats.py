"""Small statistical helpers shared by the fits."""

from __future__ import annotations

import warnings

import numpy as np


def percentile_ci(samples: np.ndarray, level: float = 0.95, axis: int = 0) -> np.ndarray:
    """Equal-tailed percentile interval over `axis`; NaN samples (failed refits) are skipped."""
    tail = 100.0 * (1.0 - level) / 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN slices give NaN, that is fine
        return np.nanpercentile(samples, [tail, 100.0 - tail], axis=axis)


def bootstrap_indices(
    rng: np.random.Generator, n: int, n_resamples: int, min_unique: int
) -> list[np.ndarray]:
    """Resamples of range(n) with replacement, skipping ones with too few distinct points."""
    draws = rng.integers(0, n, size=(n_resamples, n))
    return [idx for idx in draws if np.unique(idx).size >= min_unique]
