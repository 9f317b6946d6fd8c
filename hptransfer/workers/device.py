"""What a trainer does on its device: bf16 autocast where its plan says so, host-to-device
copies that do not wait, and whether reading a value back costs a wait."""

from __future__ import annotations

import contextlib

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
