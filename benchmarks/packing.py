"""Trials/s of K packed trials (`run_trials`) against K sequential `run_trial` calls.

Same specs (an LR grid of K members, one seed each), same thread budget, same process, one
after the other per width; printed as the ratio packed/sequential. Each side trains every
member to its budget with its evaluations, as a sweep would. Run under the heavy lock on a
shared machine; a loaded machine makes both sides slower, the ratio less so.

    .venv/bin/python benchmarks/packing.py [--k 8] [--widths 64 128 256] [--steps 60]
        [--threads N]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from hptransfer.workers.trainer import run_trial, run_trials
from hptransfer.workers.trial import TrialSpec


def grid(width: int, k: int, steps: int, threads: int) -> list[TrialSpec]:
    return [
        TrialSpec(width=width, depth=2, head_dim=32, base_width=64, base_depth=2,
                  parameterization="completep", lr=2.0 ** (-10 + i * 6 / max(k - 1, 1)),
                  seed=i, batch_size=8, seq_len=64, budget={"steps": steps}, eval_every=50,
                  data={"val_tokens": 8192, "max_corpus_bytes": 2_000_000},
                  device="cpu", num_threads=threads, divergence_factor=1e9)
        for i in range(k)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--widths", type=int, nargs="*", default=[64, 128, 256])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(f"torch {torch.__version__}, {args.threads} threads, {os.cpu_count()} CPUs, "
          f"1-min load {load:.1f}; K={args.k}, {args.steps} steps, batch 8 x seq 64, depth 2")
    print(f"{'width':>5} {'seq s':>8} {'packed s':>9} {'seq trials/s':>13} "
          f"{'packed trials/s':>16} {'ratio':>6}")
    with tempfile.TemporaryDirectory(prefix="hpt-pack-") as cache:
        run_trial(grid(64, 1, 2, args.threads)[0], cache_dir=cache)  # data cache + warm-up
        for width in args.widths:
            specs = grid(width, args.k, args.steps, args.threads)
            t = time.perf_counter()
            seq = [run_trial(s, cache_dir=cache) for s in specs]
            t_seq = time.perf_counter() - t
            t = time.perf_counter()
            packed = run_trials(specs, cache_dir=cache)
            t_pack = time.perf_counter() - t
            bad = [r.error for r in seq + packed if r.status == "failed"]
            if bad:
                raise RuntimeError(bad[0])
            print(f"{width:>5} {t_seq:>8.2f} {t_pack:>9.2f} {args.k / t_seq:>13.2f} "
                  f"{args.k / t_pack:>16.2f} {t_seq / t_pack:>6.2f}", flush=True)
    print(f"1-min load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
