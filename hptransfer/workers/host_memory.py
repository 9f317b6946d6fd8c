"""glibc malloc settings for a training process (they matter where activations live in host
memory: CPU training; harmless on CUDA, where host allocations are few).

A training step allocates and frees the same activation-sized buffers every step. With
glibc's defaults, buffers above its mmap threshold (128 KiB at first, raised as it sees them
freed) and memory freed at the top of the heap go back to the kernel, so the next step's
buffers are fresh pages: a page fault per 4 KiB, each zero-filled. `benchmarks/host_memory.py`
on this project's 2-core CPU host, one thread (2026-12-02): relu² forward + backward on an
(8, 128, 512) activation 1325 us with the defaults, 756 us with the settings below (1.75x);
`run_trial` at 128x2, batch 8 x seq 128: 14391 vs 15396 tokens/s (1.07x). The cost: memory
a step freed stays with the process (up to the trim threshold), ready for the next step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# mallopt parameter numbers (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 256 << 20  # allocations below this come from the heap, not fresh mappings
TRIM_THRESHOLD = 512 << 20  # free memory kept at the top of the heap before returning it
TOP_PAD = 64 << 20  # extra heap grown at once, so a step's growth is one call, not many

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the settings above once per process (glibc only; elsewhere a no-op). True if
    glibc accepted them."""
    global _done
    if _done is None:
        _done = _apply()
    return _done


def _apply() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other libcs have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (_M_TOP_PAD, TOP_PAD)))
