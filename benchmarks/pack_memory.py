"""How well workers/memory.py's estimate tracks the memory a pack really takes on the CPU.

run_trials splits a pack that would take more than MEMORY_HEADROOM of the device's free
memory by that estimate, so the estimate must not fall far short. Each measurement runs
K trials of one shape packed (K = 1: a pack of one) for a few steps in a fresh interpreter,
and takes the growth of its peak resident memory over what it held just before training
(data loaded, libraries mapped). Printed per shape and K: measured, estimated, and their
ratio (< 1: the estimate is generous).

    .venv/bin/python benchmarks/pack_memory.py [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = """
import json, resource, sys
import torch
from hptransfer.data import load_dataset
from hptransfer.workers.memory import trial_memory
from hptransfer.workers.packed import run_trials
from hptransfer.spec.trial import TrialSpec

width, depth, batch, seq, k, threads, cache = sys.argv[1:8]
torch.set_num_threads(int(threads))
specs = [TrialSpec(width=int(width), depth=int(depth), head_dim=32, batch_size=int(batch),
                   seq_len=int(seq), budget={"steps": 3}, eval_every=1000, device="cpu",
                   lr=2**-8 * 2**i, seed=i, num_threads=int(threads),
                   data={"val_tokens": 4096, "max_corpus_bytes": 2_000_000})
         for i in range(int(k))]
data = load_dataset(specs[0].data, cache_dir=cache)
torch.ones(1) @ torch.ones(1)  # the math libraries mapped before the baseline
rss = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status")
           if line.startswith("VmRSS"))
results = run_trials(specs, cache_dir=cache, memory_limit=float("inf"))
assert all(r.status == "completed" for r in results), results[0].error
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
need = trial_memory(specs[0], data.vocab_size, half_activations=False).pack_peak(int(k))
print("RESULT", json.dumps({"measured": peak - rss, "estimated": need}))
"""

SHAPES = ((64, 2, 8, 64), (128, 2, 16, 128), (256, 2, 32, 128), (128, 4, 32, 256))


def measure(shape: tuple[int, int, int, int], k: int, threads: int, cache: str) -> dict:
    args = [str(v) for v in (*shape, k, threads, cache)]
    out = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True,
                         text=True, check=True, env={**os.environ, "HPT_COMPILE": "0"})
    return json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print("width depth batch x seq  K  measured MB  estimated MB  measured/estimated")
    with tempfile.TemporaryDirectory() as cache:
        for shape in SHAPES:
            for k in (1, 4):
                got = measure(shape, k, args.threads, cache)
                w, d, b, t = shape
                print(f"{w:5d} {d:5d} {b:5d} x {t:<4d} {k:2d} {got['measured'] / 1e6:12.1f} "
                      f"{got['estimated'] / 1e6:13.1f} {got['measured'] / got['estimated']:19.2f}")


if __name__ == "__main__":
    main()
