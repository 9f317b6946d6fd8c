"""Which pending trials train together (`resources.pack`): one Ray task per pack.

A pack is trials of one shape: TrialSpecs equal in every field but `PACKABLE_FIELDS` (LR,
sigma, seed, schedule, ...), trained as one batched model by `workers/packed.run_trials`.
Packing is only a way of running trials: every member keeps its own row, attempts and
result, so this module only decides the grouping.
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from hptransfer.workers.packed import PACKABLE_FIELDS

from .spec import SweepSpec

# `pack: auto` on the CPU, from benchmarks/packing.py (packed vs sequential trials/s, K=8, same
# threads, on a shared 2-core machine): 1.30-1.75x at width 64 and 1.02-1.34x at 128 over
# several runs (1.23-1.56x at the demo's widths 16-40 on one thread, K=3-5), but 0.94-1.21x
# at 256 on two threads and 0.89x there on one, so the CPU packs shapes up to 128 wide
# (README, Performance, has the latest figures and their ceiling).
CPU_PACK_MAX_WIDTH = 128
CPU_PACK = 8
CPU_GAIN = 1.3  # packed/sequential trials/s there: a pack of n costs n / CPU_GAIN trials
# `pack: auto` on CUDA, from benchmarks/gpu_check.py on one H200 (bf16, compiled, batch 32 x
# 512 tokens, depth 4, 2026-12-04; steady tokens/s of a pack against one trial alone): K=8
# gave 3.48x at width 128, 3.78x and 3.87x at 256 (two runs) and 1.60x at 512 (K=4 there:
# 1.49x); K=16 4.22x at 256; K=4 at 1024 1.02x, one trial alone already reaching 42 % MFU
# there. (widest shape, K, gain): the gain up to 256 is K=8's, the smaller of those measured.
CUDA_PACKS = ((256, 16, 3.5), (512, 8, 1.5))


def on_gpu(spec: SweepSpec) -> bool:
    """Whether the sweep's tasks train on a GPU (Ray gives them one and may use it)."""
    return spec.resources.gpus > 0 and spec.fixed.device != "cpu"


def _measured(width: int, gpu: bool) -> tuple[int, float]:
    """(K, gain) for a shape of this width on this kind of device: the pack `auto` picks and
    its measured packed/sequential trials/s; (1, 1.0) where packing did not pay."""
    if gpu:
        return next(((k, gain) for widest, k, gain in CUDA_PACKS if width <= widest), (1, 1.0))
    return (CPU_PACK, CPU_GAIN) if width <= CPU_PACK_MAX_WIDTH else (1, 1.0)


def auto_pack(width: int, gpu: bool) -> int:
    """The pack size `auto` picks for a shape of this width on this kind of device."""
    return _measured(width, gpu)[0]


def pack_size(spec: SweepSpec, width: int) -> int:
    """The most trials of one shape that the sweep's spec lets one task train."""
    pack = spec.resources.pack
    return auto_pack(width, on_gpu(spec)) if pack == "auto" else int(pack)


def pack_gain(width: int, gpu: bool) -> float:
    """Measured packed/sequential trials/s for a shape of this width (1: no gain known)."""
    return _measured(width, gpu)[1]


def pack_cost(n: int, width: int, gpu: bool) -> float:
    """Estimated wall time of a pack of n trials of this width, in units of one trial
    alone: n over the shape's measured gain (a pack of n gains at most n)."""
    if n <= 1:
        return 1.0
    return n / min(float(n), pack_gain(width, gpu))


def pack_key(trial_spec: Mapping[str, Any]) -> str:
    """Trials with equal keys may share a pack (what `check_packable` requires)."""
    shape = {k: v for k, v in trial_spec.items() if k not in PACKABLE_FIELDS}
    return json.dumps(shape, sort_keys=True, default=str)


class _HasSpec(Protocol):
    @property
    def spec(self) -> Mapping[str, Any]: ...


T = TypeVar("T", bound=_HasSpec)


def plan_packs(
    trials: Sequence[T],
    slots: int,
    size_of: Callable[[T], int],
    cost: Callable[[T, int], float],
) -> list[list[T]]:
    """Split pending trials (plan order) into packs of one shape, in plan order.

    `size_of(trial)` is the largest pack its shape may form; `cost(trial, n)` the wall time
    of a pack of n trials of that trial's shape.
    Full packs are not always fastest: three packs of 6 on 2 slots take longer than 18
    trials one by one when packing gains only 15 %. So every cap on the pack size up to the
    largest allowed is tried, each group is cut into near-equal packs under it, and the cap
    whose packs finish first when run `slots` at a time (longest first) wins; ties go to the
    larger packs (fewer tasks).
    """
    groups: dict[str, list[T]] = {}
    for t in trials:
        groups.setdefault(pack_key(t.spec), []).append(t)
    limit = max((size_of(g[0]) for g in groups.values()), default=1)
    best: tuple[float, int] | None = None
    best_packs: list[list[T]] = []
    for cap in range(1, limit + 1):
        packs = [pack for g in groups.values() for pack in _cut(g, min(cap, size_of(g[0])))]
        span = round(_makespan([cost(p[0], len(p)) for p in packs], max(1, slots)), 9)
        if best is None or (span, -cap) <= best:
            best, best_packs = (span, -cap), packs
    return best_packs


def _cut(group: list[T], cap: int) -> list[list[T]]:
    """`group` in ceil(len / cap) consecutive packs whose sizes differ by at most one."""
    n = math.ceil(len(group) / max(1, cap))
    base, extra = divmod(len(group), n)
    packs, start = [], 0
    for i in range(n):
        size = base + (i < extra)
        packs.append(group[start:start + size])
        start += size
    return packs


def _makespan(costs: list[float], slots: int) -> float:
    """When the last of these tasks ends, run `slots` at a time, longest first."""
    loads = [0.0] * slots
    for c in sorted(costs, reverse=True):
        heapq.heapreplace(loads, loads[0] + c)
    return max(loads)
