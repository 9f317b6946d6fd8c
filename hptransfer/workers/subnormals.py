"""Subnormal floats flushed to zero on the CPU while a trainer runs, on every torch thread.

Near the edge of stability attention's probabilities underflow into subnormals (below 2^-126
in fp32), which x86 multiplies ~100x slower than normal floats: an SP trial of the demo's
check stage (40x3, LR 2^-5) stepped 3x slower by its end (`benchmarks/subnormals.py`).
Flushed to zero (FTZ and DAZ), they change only rounding far below fp32's precision of the
values they meet (that trial's losses were equal to the bit), as a thread count does.

The flag lives in each thread's MXCSR register, and `torch.set_flush_denormal` sets only the
calling thread's; torch's intra-op threads, OpenMP's pool, are long-lived and do not inherit
it once started. So every thread of the pool runs the setter itself, through the OpenMP
runtime torch loaded (`GOMP_parallel`, the entry point of GNU's libgomp that Intel's runtime
also provides). Where no such runtime is found (not Linux, another backend), only the
calling thread and threads started later flush.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from functools import cache

import torch

_PER_THREAD = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


@contextlib.contextmanager
def subnormals_flushed() -> Iterator[None]:
    """Flush subnormals inside, and restore this thread's previous setting after on every
    thread the trainer used (the caller's numpy and scipy see no change). Only this thread
    here: the trainer's `plan.prepare_process`, which sets the thread count, gives the pool
    this thread's setting, so no team is started for a count the trial will not use."""
    was = flushing_subnormals()
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        set_flush_everywhere(was)


def flushing_subnormals() -> bool:
    """Whether this thread flushes subnormals (torch has no getter: half the smallest
    normal float is a subnormal, and zero when flushed)."""
    return float(torch.tensor(2.0**-126) * 0.5) == 0.0


def set_flush_everywhere(on: bool) -> None:
    """Set flush-to-zero on this thread and on the threads of torch's OpenMP pool, as many
    as torch's thread count. Call it again after changing the thread count."""
    torch.set_flush_denormal(on)
    threads = torch.get_num_threads()
    parallel = _openmp_parallel()
    if parallel is None or threads < 2:
        return

    def set_here(_: int | None) -> None:  # runs once on each thread of the team
        torch.set_flush_denormal(on)

    parallel(_PER_THREAD(set_here), None, threads, 0)


@cache
def _openmp_parallel():  # noqa: ANN202 (a ctypes function)
    """GOMP_parallel(fn, data, num_threads, flags) of the OpenMP runtime loaded in this
    process, or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "omp" in line.rsplit("/", 1)[-1]}
    except OSError:
        return None
    for path in sorted(paths):
        if not path.startswith("/") or ".so" not in path:
            continue
        try:
            fn = ctypes.CDLL(path).GOMP_parallel  # the loaded copy: dlopen returns its handle
        except (OSError, AttributeError):
            continue
        fn.argtypes = [_PER_THREAD, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        fn.restype = None
        return fn
    return None
