"""The training process keeps freed memory for the next step (workers/host_memory.py).

Each case runs in a fresh interpreter: glibc's settings are per process and cannot be undone.
The workload is a training step's pattern: a few activation-sized buffers allocated, written
and freed, again and again. With glibc's defaults, buffers this large are mapped afresh every
round (a page fault per 4 KiB; smaller ones are too when a free trims the heap, which depends
on the order of frees, so the test uses sizes where the defaults are certain); after
keep_freed_memory() the rounds reuse the heap and fault no more.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

ROUNDS = """
import resource, sys, torch
from hptransfer.workers.trainer import run_trial
if sys.argv[1] == "trainer":
    result = run_trial({"width": 32, "depth": 1, "head_dim": 32, "batch_size": 2, "seq_len": 16,
               "budget": {"steps": 1}, "device": "cpu",
               "data": {"source": "stdlib", "val_tokens": 256, "max_corpus_bytes": 200000}},
              cache_dir=sys.argv[2])
    assert result.status == "completed", result.error
def step():
    buffers = [torch.empty(12 << 20).fill_(1.0) for _ in range(3)]  # 3 x 48 MiB
    del buffers
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str, tmp_path) -> int:
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode, str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_freed_step_buffers_are_reused_not_mapped_again(tmp_path):
    # the defaults map every buffer over 32 MiB afresh (glibc's largest mmap threshold): 10
    # rounds of 3 x 48 MiB fault ~370k pages in (the check that this test can fail)
    assert _faults("off", tmp_path) > 10 * 3 * (48 << 20) // 4096 // 2
    # run_trial applies the settings: the same rounds then reuse the heap
    assert _faults("trainer", tmp_path) < 100
