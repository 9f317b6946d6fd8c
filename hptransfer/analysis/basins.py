"""Rival basins: a loss-vs-LR curve with a second dip as deep as its best.

A parabola around the best LR describes one basin. When another LR, with a worse one
between it and the best, trained about as well as the best, the curve has two basins, and
which one holds η* is a coin toss of the noise: a fit around either is a guess. Short
budgets at small widths do this (SP 64 x 1 after 100 steps dips at 2^-7.5 and again at
2^-4, the second 0.2 worse; an Optuna search whose first batch sampled 2^-9, 2^-6.5 and
2^-4 at losses within 0.004 of each other refined around 2^-4 and called it η*, which
trained 0.35 worse than the grid's best). `optimal_lr` marks such a fit unreliable and
the Optuna search refines around the rival as it did around the best.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# a rival basin's bottom is within this fraction of the best loss, and the LRs between it
# and the best rise more than that above both: smaller dips are one basin's noise
RIVAL_TOLERANCE = 0.01


def rival_basins(log2_lr: Sequence[float] | np.ndarray, loss: Sequence[float] | np.ndarray,
                 tolerance: float = RIVAL_TOLERANCE) -> list[int]:
    """Indices of the LRs that trained within `tolerance` (relative) of the best loss with an
    LR between them and the best that trained worse than both by more than that, lowest loss
    first. `log2_lr` ascending; a NaN loss (no completed run) is skipped."""
    x = np.asarray(log2_lr, dtype=float)
    y = np.asarray(loss, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"log2_lr and loss must be two 1-d arrays of one length, got "
                         f"{x.shape} and {y.shape}")
    if np.any(np.diff(x) < 0):
        raise ValueError("log2_lr must be ascending")
    finite = np.flatnonzero(np.isfinite(y))
    if finite.size < 3:
        return []
    best = finite[np.argmin(y[finite])]
    margin = tolerance * abs(y[best])
    rivals = []
    for side in (finite[finite > best], finite[finite < best][::-1]):  # outward from best
        highest = -np.inf  # the worst loss between the best and the LR at hand
        for i in side:
            if y[i] <= y[best] + margin and highest > max(y[i], y[best]) + margin:
                rivals.append(int(i))
            highest = max(highest, y[i])
    return sorted(rivals, key=lambda i: (y[i], i))
