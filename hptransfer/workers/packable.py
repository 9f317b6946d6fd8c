"""Which trials may train as one pack, and how a pack is split: what the coordinator groups
trials by (coordinator/packing.py) and run_trials checks and splits by (packed.py), torch-free
so that the coordinator does not load the trainer for them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from hptransfer.spec.trial import TrialSpec

T = TypeVar("T")

# the fields packed members may differ in; every other field defines the shared shape
PACKABLE_FIELDS = frozenset(
    {"lr", "sigma_base", "weight_decay", "eps", "seed", "schedule", "divergence_factor"}
)


def check_packable(specs: Sequence[TrialSpec]) -> None:
    """Raise ValueError naming the first field (other than PACKABLE_FIELDS) that differs."""
    if not specs:
        raise ValueError("run_trials needs at least one spec")
    first = specs[0].model_dump(exclude=set(PACKABLE_FIELDS))
    for i, spec in enumerate(specs[1:], start=1):
        other = spec.model_dump(exclude=set(PACKABLE_FIELDS))
        for key, value in first.items():
            if other[key] != value:
                raise ValueError(
                    f"specs 0 and {i} cannot be packed: field {key!r} differs ({value!r} vs "
                    f"{other[key]!r}); packed members may differ only in "
                    f"{', '.join(sorted(PACKABLE_FIELDS))}"
                )


def split_evenly(items: Sequence[T], cap: int) -> list[list[T]]:
    """`items` in the fewest consecutive packs of at most `cap` whose sizes differ by at
    most one."""
    n = -(-len(items) // max(1, cap))
    base, extra = divmod(len(items), n)
    packs, start = [], 0
    for i in range(n):
        size = base + (i < extra)
        packs.append(list(items[start:start + size]))
        start += size
    return packs
