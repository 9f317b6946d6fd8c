"""Attention on the CPU: torch's fused SDPA kernel against the explicit T x T products
(`models/layers.py`, taken when `uses_small_head_path`: head_dim <= 8 and T <= 64).

1. The op alone, forward + backward, causal, over a grid of (batch, heads, T, head_dim) on
   both sides of that rule: "x" = fused time / explicit time (> 1: the explicit path is
   faster), median of alternating rounds in this one process, on --threads threads.
2. `run_trial` (batch 16 x seq 64, --head-dim, --threads), the explicit path for every head
   size up to --head-dim against the fused kernel everywhere, alternating: ms per step and
   the same ratio.

    .venv/bin/python benchmarks/attention.py [--rounds 5] [--threads 1] [--steps 40]
        [--shapes 16x24 24x11 40x4 32x2] [--head-dim 8] [--skip-trials]
    (wider heads on two threads: --threads 2 --head-dim 32 --shapes 64x2 128x2)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from functools import partial

import torch
import torch.nn.functional as F
from _timing import alternating

import hptransfer.models.config as model_config
import hptransfer.models.layers as layers
from hptransfer.spec.trial import TrialSpec
from hptransfer.workers.trainer import run_trial

# (batch, heads, T, head_dim): the demo's heads (width / 8 at batch 16 x 64), then past the rule
OP_CASES = [(16, 2, 64, 8), (16, 3, 64, 8), (16, 5, 64, 8), (16, 10, 64, 8),
            (16, 2, 64, 16), (16, 4, 64, 16), (8, 8, 128, 8), (8, 4, 128, 32),
            (64, 2, 64, 32), (8, 4, 128, 64), (8, 4, 256, 32), (2, 4, 512, 32)]


def fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=q.shape[-1] ** -0.5)


def small_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return layers._small_head_attention(q, k, v, None, q.shape[-1] ** -0.5)


def time_op(fn, q, k, v, grad, reps: int = 20) -> float:  # noqa: ANN001
    """Seconds per forward + backward."""
    for _ in range(2):
        fn(q, k, v).backward(grad)
    t = time.perf_counter()
    for _ in range(reps):
        fn(q, k, v).backward(grad)
    return (time.perf_counter() - t) / reps


def op_table(rounds: int) -> None:
    print(f"{'batch':>5} {'heads':>5} {'T':>4} {'d':>3} {'rule':>5} {'fused us':>9} "
          f"{'small us':>9} {'x':>5}")
    for b, h, t, d in OP_CASES:
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(b, h, t, d, generator=gen, requires_grad=True) for _ in range(3))
        grad = torch.randn(b, h, t, d, generator=gen)
        torch.testing.assert_close(small_head(q, k, v), fused(q, k, v))
        got = alternating({"fused": partial(time_op, fused, q, k, v, grad),
                           "small": partial(time_op, small_head, q, k, v, grad)}, rounds)
        a, s = got["fused"], got["small"]
        ratio = statistics.median(x / y for x, y in zip(a, s, strict=True))
        rule = "small" if layers.uses_small_head_path(q) else "fused"
        print(f"{b:>5} {h:>5} {t:>4} {d:>3} {rule:>5} {statistics.median(a) * 1e6:>9.0f} "
              f"{statistics.median(s) * 1e6:>9.0f} {ratio:>5.2f}")


def trial_spec(width: int, depth: int, steps: int, threads: int, head_dim: int) -> TrialSpec:
    return TrialSpec(width=width, depth=depth, head_dim=head_dim, base_width=32, base_depth=2,
                     parameterization="completep", lr=2.0**-7, batch_size=16, seq_len=64,
                     budget={"steps": steps}, eval_every=10**6, device="cpu",
                     num_threads=threads, data={"val_tokens": 1024})


def ms_per_step(spec: TrialSpec, cache: str, small: bool) -> float:
    rule = model_config.SMALL_HEAD_DIM
    # fused: no head is small; explicit: every head up to this trial's is
    model_config.SMALL_HEAD_DIM = spec.head_dim if small else 0
    try:
        result = run_trial(spec, cache_dir=cache)
    finally:
        model_config.SMALL_HEAD_DIM = rule
    if result.status != "completed":
        raise RuntimeError(f"{result.status}: {result.error}")
    return spec.batch_size * spec.seq_len / result.tokens_per_s * 1e3


def trial_table(shapes: list[str], rounds: int, steps: int, threads: int,
                head_dim: int) -> None:
    print(f"\n{'shape':>6} {'fused ms':>9} {'small ms':>9} {'x':>5}  per round")
    with tempfile.TemporaryDirectory(prefix="hpt-attn-") as cache:
        for shape in shapes:
            width, depth = (int(n) for n in shape.split("x"))
            spec = trial_spec(width, depth, steps, threads, head_dim)
            ms_per_step(spec, cache, small=True)  # data cache and warm-up
            got = alternating({"fused": partial(ms_per_step, spec, cache, small=False),
                               "small": partial(ms_per_step, spec, cache, small=True)}, rounds)
            a, s = got["fused"], got["small"]
            ratios = [x / y for x, y in zip(a, s, strict=True)]
            print(f"{shape:>6} {statistics.median(a):>9.1f} {statistics.median(s):>9.1f} "
                  f"{statistics.median(ratios):>5.2f}  {' '.join(f'{x:.2f}' for x in ratios)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--shapes", nargs="*", default=["16x24", "24x11", "40x4", "32x2"])
    parser.add_argument("--head-dim", type=int, default=8)
    parser.add_argument("--skip-trials", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {os.cpu_count()} CPUs, "
          f"1-min load {os.getloadavg()[0]:.1f}; {args.rounds} alternating rounds")
    op_table(args.rounds)
    if not args.skip_trials:
        trial_table(args.shapes, args.rounds, args.steps, args.threads, args.head_dim)
    print("\nx = fused / explicit time (> 1: the explicit path is faster); rule = the path "
          "attention() takes for that shape on these threads ('small': explicit)")


if __name__ == "__main__":
    main()
