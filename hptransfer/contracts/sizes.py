"""What counts as one model size, for the spec (an aspect_ratio stage's shapes must share
one) and the N:L fit (which compares shapes within a size): sizes within ±SIZE_TOLERANCE of
their group's median non-embedding parameter count."""

from __future__ import annotations

from collections.abc import Iterable
from statistics import median

SIZE_TOLERANCE = 0.15
# the cubic in log(N/L) has four coefficients
MIN_ASPECT_RATIOS = 4


def group_by_size(params: Iterable[float], tolerance: float = SIZE_TOLERANCE) -> list[int]:
    """Label sizes so every member of a group is within ±tolerance of the group's median.

    Greedy over sorted sizes: a size joins the current group while that still holds.
    """
    values = [float(p) for p in params]
    labels = [0] * len(values)
    group, members = 0, []
    for i in sorted(range(len(values)), key=values.__getitem__):
        trial = [*members, values[i]]
        mid = median(trial)
        if members and not (min(trial) >= (1 - tolerance) * mid
                            and max(trial) <= (1 + tolerance) * mid):
            group += 1
            trial = [values[i]]
        members = trial
        labels[i] = group
    return labels
