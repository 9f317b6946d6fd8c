"""What a trainer does on its device: bf16 autocast where its plan says so, host-to-device
copies that do not wait, whether reading a value back costs a wait, how much memory the
device has free, and whether an error was a failed allocation."""

from __future__ import annotations

import contextlib
import os

import psutil
import torch


def autocast(device: torch.device, bf16: bool) -> contextlib.AbstractContextManager:
    """bf16 autocast on `device` where the plan says so (TrialPlan.bf16), else nothing."""
    if bf16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def reading_back_is_free(device: torch.device) -> bool:
    """Whether reading a value of `device` into Python costs nothing: on the CPU; on CUDA it
    waits for every queued kernel (tests/test_host_reads.py)."""
    return device.type == "cpu"


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device: a copy to CUDA from pageable
    memory makes the host wait for every kernel already queued (a host sync each step), so
    the tensor is staged in pinned memory first (torch's pinned-memory cache keeps it alive
    until the copy is done). Elsewhere a plain `.to`."""
    if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def free_memory(device: torch.device, threads: int | None = None) -> float:
    """Bytes a new allocation could take on `device` now: the GPU's free memory plus what
    torch's caching allocator holds unused. On the CPU the kernel's MemAvailable, but at
    most this task's share of the host by its threads (Ray runs as many tasks on a node as
    it has CPUs for, and each would otherwise plan for all the memory free at its start)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return float(free + cached)
    host = psutil.virtual_memory()  # available: the kernel's MemAvailable on Linux
    share = min(1.0, (threads or os.cpu_count() or 1) / (os.cpu_count() or 1))
    return float(min(host.available, share * host.total))


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is an allocation failure (CUDA's OutOfMemoryError, or the CPU
    allocator's RuntimeError), i.e. worth retrying with less in memory."""
    return isinstance(exc, torch.OutOfMemoryError | MemoryError) or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))
