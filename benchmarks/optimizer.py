"""The CPU optimizer step: the trainer's FlatAdamW against torch.optim.AdamW(foreach=True),
whose arithmetic it repeats to the bit (tests/test_flat_adamw.py).

1. The step alone on a model of each shape with random
   gradients: ms per step, "x" = foreach / flat (> 1: FlatAdamW is faster).
2. `run_trial` at the same shapes (batch 16 x seq 64), the trainer with FlatAdamW against the
   trainer with foreach AdamW swapped in: ms per training step and the same ratio.

Both sides alternate in this one process (flat, foreach, foreach, flat, ...) and the medians
of the rounds are compared, so a busy moment of the shared machine hits both.

    .venv/bin/python benchmarks/optimizer.py [--rounds 5] [--threads 1] [--steps 40]
        [--shapes 16x24 40x4 64x2 128x2 256x4] [--skip-trials]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial

import torch
from _timing import alternating, bench_head_dim
from trainer_throughput import time_training

import hptransfer.workers.trainer as trainer
from hptransfer.models import optimizer_groups
from hptransfer.models.build import build_model
from hptransfer.spec.trial import TrialSpec
from hptransfer.workers.flat_adamw import FlatAdamW

BETAS = (0.9, 0.95)
WARMUP = 3  # training steps left out of the timing


def foreach_adamw(groups: list[dict], betas: tuple[float, float]) -> torch.optim.AdamW:
    return torch.optim.AdamW(groups, betas=betas, foreach=True)


def step_ms(make, width: int, depth: int, reps: int = 30) -> tuple[float, int]:
    """Median ms of one optimizer step (grads set, then step) on a fresh model, and the
    model's number of parameter tensors."""
    built = build_model(arch="gpt", parameterization="completep", width=width, depth=depth,
                        head_dim=bench_head_dim(width), base_width=64, base_depth=2,
                        weight_decay=0.1)
    opt = make(optimizer_groups(built.model, built.table), BETAS)
    params = list(built.model.parameters())
    grads = [torch.randn_like(p) * 1e-3 for p in params]
    times = []
    for _ in range(reps + 3):
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:]) * 1e3, len(params)


def trial_ms(width: int, depth: int, steps: int, threads: int, cache: str,
             optimizer: Callable = FlatAdamW) -> float:
    """Median ms of a `run_trial` training step, the trainer's CPU optimizer swapped for
    `optimizer` for the run."""
    trainer.FlatAdamW = optimizer
    spec = TrialSpec(width=width, depth=depth, head_dim=bench_head_dim(width), base_width=64,
                     base_depth=2, parameterization="completep", lr=2.0**-7,
                     batch_size=16, seq_len=64, budget={"steps": steps},
                     eval_every=10**9, data={"val_tokens": 2048}, device="cpu",
                     num_threads=threads, divergence_factor=1e9)  # never stops early
    try:
        times, _, _ = time_training(spec, WARMUP, cache)
    finally:
        trainer.FlatAdamW = FlatAdamW
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--shapes", nargs="*", default=["16x24", "40x4", "64x2", "128x2",
                                                         "256x4"])
    parser.add_argument("--skip-trials", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    sides = {"flat": FlatAdamW, "foreach": foreach_adamw}

    print(f"torch {torch.__version__}, {args.threads} thread(s); optimizer step alone")
    print(f"{'shape':>7} {'tensors':>7} {'foreach ms':>10} {'flat ms':>8} {'x':>5}")
    for width, depth in shapes:
        got = alternating({name: partial(step_ms, make, width, depth)
                           for name, make in sides.items()}, args.rounds)
        tensors = got["flat"][0][1]
        a, f = (statistics.median(ms for ms, _ in got[name]) for name in ("foreach", "flat"))
        print(f"{width}x{depth:<4} {tensors:>7} {a:>10.2f} {f:>8.2f} {a / f:>5.2f}")
    if args.skip_trials:
        return

    print(f"\nrun_trial, batch 16 x seq 64, ms per training step (median of {args.rounds} "
          "alternating rounds)")
    print(f"{'shape':>7} {'foreach ms':>10} {'flat ms':>8} {'x':>5}")
    with tempfile.TemporaryDirectory(prefix="hpt-opt-") as cache:
        for width, depth in shapes:
            trial_ms(width, depth, args.steps, args.threads, cache)  # data cache and warm-up
            got = alternating({name: partial(trial_ms, width, depth, args.steps, args.threads,
                                             cache, optimizer=make)
                               for name, make in sides.items()}, args.rounds)
            a, f = statistics.median(got["foreach"]), statistics.median(got["flat"])
            print(f"{width}x{depth:<4} {a:>10.2f} {f:>8.2f} {a / f:>5.2f}", flush=True)
    print("\nx = foreach time / flat time (> 1: FlatAdamW is faster); the two give the same "
          "numbers to the bit (tests/test_flat_adamw.py)")


if __name__ == "__main__":
    main()
