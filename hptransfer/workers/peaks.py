"""Accelerators' peak FLOP/s, torch-free: a trainer reports its MFU by them (outcome.py), and
the coordinator prices a sweep by them before anything is measured (coordinator/
calibration.py)."""

from __future__ import annotations

# dense bf16 tensor-core peaks (FLOP/s) of common accelerators, for MFU; None = unknown.
# Matched in the device's name longest key first: "L40" holds "L4", "H100 PCIe" "H100".
PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,  # SXM
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "A10G": 125e12,
    "L4": 121e12,
}


def peak_of(device_name: str) -> float | None:
    """The peak of the device `device_name` names (None: not one of PEAK_BF16's)."""
    for key in sorted(PEAK_BF16, key=len, reverse=True):
        if key in device_name:
            return PEAK_BF16[key]
    return None
