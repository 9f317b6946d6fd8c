"""GPU check: MFU of one trial at widths 256, 1024, 2048 (bf16, torch.compile) and packed
(K=8) vs sequential trials/s at width 256. Exits cleanly on a machine without CUDA.

    .venv/bin/python benchmarks/gpu_check.py [--steps 60] [--k 8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import torch
from _timing import time_sequential_and_packed

from hptransfer.workers.trainer import run_trial
from hptransfer.workers.trial import TrialSpec


def spec(width: int, steps: int, lr: float = 2.0**-8, seed: int = 0) -> TrialSpec:
    return TrialSpec(width=width, depth=4, head_dim=64, base_width=256, base_depth=2, lr=lr,
                     seed=seed, batch_size=32, seq_len=512, budget={"steps": steps},
                     eval_every=10**9, data={"val_tokens": 16384}, device="cuda",
                     precision="bf16", divergence_factor=1e9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--k", type=int, default=8)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check on this machine")
        return
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory(prefix="hpt-gpu-") as cache:
        for width in (256, 1024, 2048):
            r = run_trial(spec(width, args.steps), cache_dir=cache)
            mfu = f"{r.mfu:.1%}" if r.mfu is not None else "unknown peak"
            print(f"width {width}: {r.status}, {r.tokens_per_s:,.0f} tok/s, MFU {mfu} "
                  f"(warm-up and compile included) notes={r.notes}", flush=True)
        specs = [spec(256, args.steps, lr=2.0 ** (-10 + i * 0.75), seed=i)
                 for i in range(args.k)]
        seq, packed, t_seq, t_pack = time_sequential_and_packed(specs, cache)
        print(f"width 256, K={args.k}: sequential {t_seq:.1f} s, packed {t_pack:.1f} s, "
              f"ratio {t_seq / t_pack:.2f}; statuses {[r.status for r in seq + packed]}")
        print(f"packed notes: {packed[0].notes}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
