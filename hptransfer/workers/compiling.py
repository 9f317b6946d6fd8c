"""torch.compile for a trainer: when a run compiles (compile_wanted), and the eager fallback
where compiling fails (Compiled, eager_if_backward_fails). Results are the same either way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from hptransfer.config import compile_mode

# A CPU run compiles by default only when this much training follows: a cold compile took up
# to 34 s per shape (47 s for a pack of 8), and compiled steps ran 1.05-1.16x eager at widths
# 128-256 (benchmarks/trainer_throughput.py --compile), so a compile is repaid after roughly
# 10 minutes of eager training, ~3e13 FLOPs at the 50-70 GFLOP/s one CPU thread reaches there.
CPU_COMPILE_MIN_FLOPS = 3e13


def compile_wanted(device: torch.device, work_flops: float | None = None) -> bool:
    """torch.compile on CUDA by default; on the CPU when `work_flops` (the training run's
    FLOPs: a pack's are all its members') would repay it, where the eager kernels are
    otherwise the reference: a sweep's short CPU trials and packs stay eager. A compiled pack
    of 8 stepped 1.12-1.28x faster than an eager one at width 64 and 1.08-1.15x at 128 on the
    CPU (benchmarks/packing_compile.py, 2 threads, 2026-12-03), a single trial 1.05-1.16x at
    128-256, so the same threshold serves both. HPT_COMPILE=0 never compiles, HPT_COMPILE=all
    always."""
    mode = compile_mode()
    if mode != "1":
        return mode == "all"
    if device.type == "cuda":
        return True
    return (work_flops or 0.0) >= CPU_COMPILE_MIN_FLOPS


# where torch.compile's own code runs: an error raised from inside them is the compiler's
_COMPILER_MODULES = ("torch._dynamo", "torch._inductor", "torch._functorch", "triton")


def is_compile_failure(exc: BaseException) -> bool:
    """Whether `exc` is torch.compile failing (tracing, or a backend generating code for a
    graph), not the computation it compiles: worth running eager instead. Dynamo wraps what
    fails at a call (BackendCompilerFailed); a backward graph compiled at .backward() raises
    its compiler's own error (a C++ or Triton compile error), known by the compiler's frames
    in its traceback. A real error misread as one recurs eager and is raised then. An
    allocation failure is never one (a pack halves on it; eager needs more memory)."""
    if is_out_of_memory_anywhere(exc):
        return False
    if isinstance(exc, torch._dynamo.exc.TorchDynamoException):
        return True
    tb = exc.__traceback__
    while tb is not None:
        if str(tb.tb_frame.f_globals.get("__name__", "")).startswith(_COMPILER_MODULES):
            return True
        tb = tb.tb_next
    return False


class Compiled:
    """`fn` under torch.compile where wanted, falling back to eager (with a note) where
    compiling fails: at the first call (a compiler or backend missing, an unsupported op),
    and at any later graph (an evaluation's, a smaller pack's): compile failures only, so
    a real error, an out-of-memory above all, is raised as it would be eager. A backward
    graph is compiled at its first .backward(), outside this call: a trainer that sees that
    fail calls `fall_back` and redoes the step. Results are the same either way."""

    def __init__(self, fn: Callable, device: torch.device, notes: list[str], what: str,
                 work_flops: float | None = None):
        self.eager, self.notes, self.what = fn, notes, what
        self.fn = torch.compile(fn) if compile_wanted(device, work_flops) else fn
        self.checked = self.fn is fn  # eager, or compiled and its first call went through
        if not self.checked and device.type == "cpu":
            notes.append(f"the {what} runs under torch.compile on the CPU (HPT_COMPILE=0 keeps "
                         "it eager)")

    def __call__(self, *args: Any) -> Any:
        if self.fn is self.eager:
            return self.fn(*args)
        try:
            out = self.fn(*args)
        except Exception as exc:
            # the first call: anything but running out of memory (a compiler missing can
            # raise anything); later ones: a graph that dynamo could not compile (what it
            # raises then), never an error of compiled code that ran (an in-place update
            # may have been applied in part: running it again would apply it twice)
            later = isinstance(exc, torch._dynamo.exc.TorchDynamoException)
            if (is_out_of_memory_anywhere(exc) or not (later or not self.checked)
                    or not self.fall_back(exc)):
                raise
            out = self.fn(*args)
        self.checked = True
        return out

    def fall_back(self, exc: BaseException) -> bool:
        """Run eager from now on, saying why; False if already eager (nothing to fall back
        from, so the caller raises)."""
        if self.fn is self.eager:
            return False
        self.notes.append(
            f"torch.compile failed for the {self.what} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); ran eager"
        )
        self.fn = self.eager
        return True


def is_out_of_memory_anywhere(exc: BaseException) -> bool:
    """An allocation failure, raised as such or as the cause of a compiler's error."""
    from .device import is_out_of_memory

    return any(c is not None and is_out_of_memory(c)
               for c in (exc, exc.__cause__, exc.__context__))


T = TypeVar("T")


def eager_if_backward_fails(model: Compiled, step: Callable[..., T], *args: Any) -> T:
    """`step(*args)`: a forward and backward that only fill .grad, so it can run again. Where
    compiling the model's backward graph fails (at .backward(), outside `model`'s call),
    `model` falls back to eager and the step runs again."""
    try:
        return step(*args)
    except Exception as exc:
        if not (is_compile_failure(exc) and model.fall_back(exc)):
            raise
        return step(*args)
