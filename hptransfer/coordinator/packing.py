"""Which pending trials train together (`resources.pack`): one Ray task per pack.

A pack is trials of one shape: TrialSpecs equal in every field but `PACKABLE_FIELDS` (LR,
sigma, seed, schedule, ...), trained as one batched model by `workers/packed.run_trials`.
Packing is only a way of running trials: every member keeps its own row, attempts and
result, so this module only decides the grouping.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from hptransfer.spec import SweepSpec
from hptransfer.spec.trial import sequences_per_pass
from hptransfer.workers.packable import PACKABLE_FIELDS, split_evenly

# `pack: auto` packs a shape whose work per forward pass is small enough for packing to have
# paid where it was measured. That work is tokens per pass (micro-batch x seq_len) x width^2
# (every matmul of a block): a trial with more of it keeps its device busier alone, so a pack
# gains less. Measured only across widths at one pass size per device; other pass sizes
# (batch, seq_len) are placed by that product, and depth by nothing (a deeper model runs
# more kernels of the same size).


@dataclass(frozen=True)
class MeasuredPacks:
    """Where packing paid on one kind of device: at `tokens` per forward pass, a shape up to
    `widest` wide packs `k` at a time and gains `gain` (packed/sequential trials/s, the
    smallest measured up to that width), for each (widest, k, gain) in `packs`, narrowest
    first."""

    tokens: int
    packs: tuple[tuple[int, int, float], ...]


# CPU, from benchmarks/packing.py (packed vs sequential trials/s, K=8, 8 x 64 tokens per pass,
# depth 2, on a shared 2-core machine; benchmarks/RESULTS.md has the figures). A CPU pack
# does no less work per member than a trial alone; it gains where its larger ops keep the
# threads busier, or where per-op overhead dominates a tiny trial. On one thread
# (2026-12-05): 1.71x at width 16, 1.40x at 32, 1.13x at 48, 1.01x at 64, 0.87-0.97x from 80
# to 128; the demo's own shapes (benchmarks/packing_demo.py: head_dim 8, 16 x 64 tokens, K=5,
# each arm) 1.23-1.27x at 16x2, 1.05-1.06x at 24x2, 1.03-1.06x at 32x2, 0.96-0.98x at 40x3.
# On two threads: 2.1-2.2x at 16-32, 1.3-1.75x at 48-64 over several runs, 1.2x at 96,
# 1.02-1.34x at 128, 0.94-1.21x at 256. More threads were not measured and take the
# two-thread rule.
CPU_ONE_THREAD_PACKS = MeasuredPacks(8 * 64, ((32, 8, 1.4), (48, 8, 1.05)))
CPU_PACKS = MeasuredPacks(8 * 64, ((64, 8, 1.3), (128, 8, 1.05)))
# CUDA, from benchmarks/gpu_check.py on one H200 (bf16, compiled, 32 x 512 tokens per pass,
# depth 4, 2026-12-04; steady tokens/s of a pack against one trial alone): K=8 gave 3.48x at
# width 128, 3.78x and 3.87x at 256 (two runs) and 1.60x at 512 (K=4 there: 1.49x); K=16
# 4.22x at 256; K=4 at 1024 1.02x, one trial alone already reaching 42 % MFU there. The gain
# up to 256 is K=8's, the smaller of those measured.
CUDA_PACKS = MeasuredPacks(32 * 512, ((256, 16, 3.5), (512, 8, 1.5)))


def on_gpu(spec: SweepSpec) -> bool:
    """Whether the sweep's tasks train on a GPU (Ray gives them one and may use it)."""
    return spec.resources.gpus > 0 and spec.fixed.device != "cpu"


def measured_packs(spec: SweepSpec) -> MeasuredPacks:
    """What packing gained on the device and threads that this sweep's tasks get."""
    if on_gpu(spec):
        return CUDA_PACKS
    return CPU_ONE_THREAD_PACKS if spec.resources.threads == 1 else CPU_PACKS


def pass_work(trial: Mapping[str, Any]) -> float:
    """A trial spec's tokens per forward pass x width^2 (what `auto` compares)."""
    sequences = sequences_per_pass(trial["batch_size"], trial.get("micro_batch_size"))
    return float(sequences * trial["seq_len"]) * trial["width"] ** 2


def _measured(trial: Mapping[str, Any], where: MeasuredPacks) -> tuple[int, float]:
    """(K, gain) for this trial's shape where `where` was measured: the pack `auto` picks and
    its measured packed/sequential trials/s; (1, 1.0) where packing did not pay."""
    work = pass_work(trial)
    return next(((k, gain) for widest, k, gain in where.packs
                 if work <= where.tokens * widest**2), (1, 1.0))


def auto_pack(trial: Mapping[str, Any], where: MeasuredPacks) -> int:
    """The pack size `auto` picks for this trial spec's shape where `where` was measured."""
    return _measured(trial, where)[0]


def pack_size(spec: SweepSpec, trial: Mapping[str, Any]) -> int:
    """The most trials of this trial spec's shape that the sweep's spec lets one task
    train (a worker may still split a pack its memory cannot hold: workers/packed.py)."""
    pack = spec.resources.pack
    return auto_pack(trial, measured_packs(spec)) if pack == "auto" else int(pack)


def pack_gain(trial: Mapping[str, Any], where: MeasuredPacks) -> float:
    """Measured packed/sequential trials/s for this trial's shape (1: no gain known)."""
    return _measured(trial, where)[1]


def pack_cost(n: int, trial: Mapping[str, Any], where: MeasuredPacks) -> float:
    """Estimated wall time of a pack of n trials of this trial's shape, in units of one
    trial alone: n over the shape's measured gain (a pack of n gains at most n)."""
    if n <= 1:
        return 1.0
    return n / min(float(n), pack_gain(trial, where))


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
        packs = [pack for g in groups.values() for pack in split_evenly(g, min(cap, size_of(g[0])))]
        span = round(_makespan([cost(p[0], len(p)) for p in packs], max(1, slots)), 9)
        if best is None or (span, -cap) <= best:
            best, best_packs = (span, -cap), packs
    return best_packs


def _makespan(costs: list[float], slots: int) -> float:
    """When the last of these tasks ends, run `slots` at a time, longest first."""
    loads = [0.0] * slots
    for c in sorted(costs, reverse=True):
        heapq.heapreplace(loads, loads[0] + c)
    return max(loads)
