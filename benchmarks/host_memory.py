"""What keeping freed memory (hptransfer/workers/host_memory.py) buys a CPU training process.

Each measurement runs in a fresh interpreter (glibc's settings are per process), alternating
"defaults" and "kept" rounds so that a busy moment of a shared machine hits both; printed as
medians and the ratio kept/defaults of the rate (> 1: faster with the settings):
  relu2      relu² forward + backward on an (8, 128, 512) activation (one MLP of a 128-wide
             model at batch 8 x seq 128), microseconds per call;
  trial      `run_trial` at width 128, depth 2, batch 8 x seq 128, 60 steps: tokens/s of its
             training loop.

    .venv/bin/python benchmarks/host_memory.py [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile

CHILD = """
import sys, time, torch
from hptransfer.workers import host_memory
if sys.argv[1] == "defaults":
    host_memory._done = False  # marked done without applying: run_trial keeps the defaults
else:
    assert host_memory.keep_freed_memory()
torch.set_num_threads(int(sys.argv[3]))
from hptransfer.models.layers import relu_squared
from hptransfer.workers.trainer import run_trial
x = torch.randn(8, 128, 512, requires_grad=True)
g = torch.randn(8, 128, 512)
for _ in range(10):
    relu_squared(x).backward(g)
t = time.perf_counter()
for _ in range(100):
    relu_squared(x).backward(g)
relu2_us = (time.perf_counter() - t) / 100 * 1e6
r = run_trial({"width": 128, "depth": 2, "head_dim": 32, "batch_size": 8, "seq_len": 128,
               "budget": {"steps": 60}, "eval_every": 1000, "device": "cpu",
               "num_threads": int(sys.argv[3]),
               "data": {"source": "stdlib", "val_tokens": 4096, "max_corpus_bytes": 2000000}},
              cache_dir=sys.argv[2])
assert r.status == "completed", r.error
print("RESULT", relu2_us, r.tokens_per_s)
"""


def measure(mode: str, cache: str, threads: int) -> tuple[float, float]:
    out = subprocess.run([sys.executable, "-c", CHILD, mode, cache, str(threads)],
                         capture_output=True, text=True, check=True)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    relu2_us, tokens_per_s = map(float, line.split()[1:])
    return relu2_us, tokens_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    runs: dict[str, list[tuple[float, float]]] = {"defaults": [], "kept": []}
    with tempfile.TemporaryDirectory(prefix="hpt-mem-") as cache:
        measure("kept", cache, args.threads)  # data cache and imports warm, not timed
        for _ in range(args.rounds):
            for mode in runs:
                runs[mode].append(measure(mode, cache, args.threads))
    med = {mode: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
           for mode, rs in runs.items()}
    print(f"{args.rounds} rounds, {args.threads} thread(s); medians")
    print(f"{'':10} {'defaults':>10} {'kept':>10} {'kept/defaults (rate)':>21}")
    print(f"{'relu2 us':10} {med['defaults'][0]:10.0f} {med['kept'][0]:10.0f} "
          f"{med['defaults'][0] / med['kept'][0]:21.2f}")
    print(f"{'trial tok/s':10} {med['defaults'][1]:10.0f} {med['kept'][1]:10.0f} "
          f"{med['kept'][1] / med['defaults'][1]:21.2f}")


if __name__ == "__main__":
    main()
