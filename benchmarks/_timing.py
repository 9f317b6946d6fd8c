"""Timing pieces the benchmarks share: alternating rounds, sequential vs packed trials, matmul
FLOP/s, and the time a pack spends in its matmuls and attention kernels."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hptransfer.spec.trial import Budget, TrialResult, TrialSpec
from hptransfer.workers.packed import run_trials
from hptransfer.workers.trainer import run_trial

T = TypeVar("T")


def alternating(sides: dict[str, Callable[[], T]], rounds: int) -> dict[str, list[T]]:
    """Each side's result per round, the sides run one after the other in every round and in
    reverse order every other round (A B, B A, ...), so a busy moment of a shared machine and
    any order effect hit both alike."""
    names = list(sides)
    got: dict[str, list[T]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            got[name].append(sides[name]())
    return got


def bench_head_dim(width: int) -> int:
    """The head size the benchmarks give a width: 32, or 8 at the demo's small widths (16,
    24, 40), which 32 does not divide."""
    return 32 if width % 32 == 0 else 8


def sequential_and_packed_rounds(
    specs: Sequence[TrialSpec], cache_dir: str, rounds: int
) -> tuple[list[TrialResult], list[TrialResult], list[float], list[float]]:
    """Every spec trained by its own `run_trial`, one after the other, and all of them by one
    `run_trials`, `rounds` times, the two sides alternating (`alternating`; sequential first):
    the last round's results and each round's seconds, sequential then packed."""
    got = alternating({"seq": lambda: _timed_sequential(specs, cache_dir),
                       "pack": lambda: _timed_packed(specs, cache_dir)}, rounds)
    return (got["seq"][-1][0], got["pack"][-1][0], [t for _, t in got["seq"]],
            [t for _, t in got["pack"]])


def _timed_sequential(specs: Sequence[TrialSpec], cache_dir: str
                      ) -> tuple[list[TrialResult], float]:
    t = time.perf_counter()
    results = [run_trial(s, cache_dir=cache_dir) for s in specs]
    return results, time.perf_counter() - t


def _timed_packed(specs: Sequence[TrialSpec], cache_dir: str) -> tuple[list[TrialResult], float]:
    t = time.perf_counter()
    results = run_trials(specs, cache_dir=cache_dir)
    return results, time.perf_counter() - t


def step_stamps(spec: TrialSpec, cache_dir: str, between: Callable[[int], Any] | None = None
                ) -> tuple[dict[int, float], TrialResult]:
    """Train `spec` with `run_trial`, stamping the time of each reporter call by its step
    (on CUDA the trainer reads losses back to the host before it reports, so the stamps hold
    the device's work); `between(step)` then runs inside that call, before training goes on.
    Raises if the run did not complete."""
    stamps: dict[int, float] = {}

    def reporter(point: dict[str, Any]) -> bool:
        stamps[point["step"]] = time.perf_counter()
        if between is not None:
            between(point["step"])
        return False

    result = run_trial(spec, reporter=reporter, cache_dir=cache_dir)
    if result.status != "completed":
        raise RuntimeError(f"timing run {result.status}: {result.error}")
    return stamps, result


def pack_step_stamps(specs: Sequence[TrialSpec], cache_dir: str
                     ) -> tuple[dict[int, float], list[TrialResult]]:
    """`step_stamps` for a pack: `run_trials` on `specs`, stamping each of member 0's
    reporter calls by its step (a pack reports all its members at the same sync steps)."""
    stamps: dict[int, float] = {}

    def reporter(member: int, point: dict[str, Any]) -> bool:
        if member == 0:
            stamps[point["step"]] = time.perf_counter()
        return False

    return stamps, run_trials(specs, reporter=reporter, cache_dir=cache_dir)


def matmul_flops(m: int, k: int, n: int, threads: int, batch: int = 1, reps: int = 30) -> float:
    """FLOP/s of an fp32 (m x k) @ (k x n) matmul, or of `batch` of them in one torch.bmm
    (median of `reps`), on `threads` threads."""
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(batch, m, k, generator=gen)
    b = torch.randn(batch, k, n, generator=gen)
    out = torch.empty(batch, m, n)
    if batch == 1:
        a, b, out = a[0], b[0], out[0]

    def op() -> None:
        if batch == 1:
            torch.mm(a, b, out=out)
        else:
            torch.bmm(a, b, out=out)

    for _ in range(3):
        op()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        op()
        times.append(time.perf_counter() - t)
    return 2.0 * batch * m * k * n / statistics.median(times)


_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
            torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default}


def kernel_kind(func: torch._ops.OpOverload) -> str | None:
    """"matmul", "attention" (torch's fused attention kernels, forward and backward) or None."""
    if func in _MATMULS:
        return "matmul"
    if func.name().startswith("aten::_scaled_dot_product"):
        return "attention"
    return None


class KernelClock(TorchDispatchMode):
    """Seconds spent inside matrix multiplies and inside attention kernels (forward and
    autograd's backward ones alike) while active: the real calls at their real shapes and
    layouts, each timed alone."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = {"matmul": 0.0, "attention": 0.0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kind = kernel_kind(func)
        if kind is None:
            return func(*args, **(kwargs or {}))
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.seconds[kind] += time.perf_counter() - start
        return out


def kernel_seconds_per_step(specs: Sequence[TrialSpec], cache_dir: str, packed: bool,
                            short: int = 4, long: int = 12) -> dict[str, float]:
    """Seconds per training step that `specs` spend in matmuls and in attention kernels, all
    of them together: trained as one pack (`packed`) or one after the other. Two short runs
    (`short` and `long` steps, one final evaluation each) under KernelClock, differenced, so
    set-up and evaluation cancel."""
    spent = []
    for steps in (short, long):
        runs = [s.model_copy(update={"budget": Budget(steps=steps)}) for s in specs]
        clock = KernelClock()
        with clock:
            if packed:
                run_trials(runs, cache_dir=cache_dir)
            else:
                for spec in runs:
                    run_trial(spec, cache_dir=cache_dir)
        spent.append(clock.seconds)
    return {kind: (spent[1][kind] - spent[0][kind]) / (long - short) for kind in spent[0]}
