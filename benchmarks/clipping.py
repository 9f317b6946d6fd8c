"""Gradient clipping in a CPU training step: the trainer's `clip_gradients` against
torch.nn.utils.clip_grad_norm_, whose numbers it gives to the bit (tests/test_trainer.py).

torch scales every gradient by clamp(max_norm / (norm + 1e-6), max=1.0) even when that is
1.0; `clip_gradients` skips that pass then. Both run inside real training steps (the
trainer's model, data and FlatAdamW, batch 8 x seq 128, LR 2^-7, max_norm 1), taking turns
step by step in one run so that cold caches after the backward and a busy moment of the
machine hit both: ms of the clipping itself and of the whole step (medians), "x" = torch's
over ours (> 1: ours is faster), and the share of steps whose norm was over max_norm
(those scale in both).

Packed trials (`--pack-widths`): a pack of --k members (an LR grid, 2^-10 to 2^-4, batch 8 x
seq 64, depth 2) on the CPU scales only the rows of members whose factor is below 1, and masks
stopped members only once one has stopped (the numbers equal to the bit: tests/test_packed.py).
In one training run its optimizer steps alternate between that and making every pass as on
CUDA: ms of the optimizer step and of the whole training step it ends, medians per side.

    .venv/bin/python benchmarks/clipping.py [--threads 2] [--steps 64] [--shapes 128x2 256x4 512x4]
        [--pack-widths 64 128] [--k 8]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from _timing import bench_head_dim

from hptransfer.models import optimizer_groups
from hptransfer.models.build import build_model
from hptransfer.spec.trial import TrialSpec
from hptransfer.workers import pack as pack_module
from hptransfer.workers.flat_adamw import FlatAdamW
from hptransfer.workers.pack import Pack
from hptransfer.workers.plan import load_trial_data
from hptransfer.workers.trainer import clip_gradients

BATCH, SEQ, LR, MAX_NORM, WARMUP = 8, 128, 2.0**-7, 1.0, 8


def torch_clip(params: list[torch.nn.Parameter], max_norm: float) -> None:
    torch.nn.utils.clip_grad_norm_(params, max_norm)


def measure(width: int, depth: int, steps: int, cache: str) -> dict[str, float]:
    spec = TrialSpec(width=width, depth=depth, head_dim=bench_head_dim(width), lr=LR,
                     batch_size=BATCH, seq_len=SEQ, budget={"steps": steps},
                     data={"val_tokens": 2048}, device="cpu")
    data = load_trial_data(spec, cache)
    built = build_model(arch="gpt", parameterization="completep", width=width, depth=depth,
                        head_dim=spec.head_dim, vocab_size=data.vocab_size, max_seq_len=SEQ,
                        base_width=128, base_depth=2, lr=LR, weight_decay=0.1)
    opt = FlatAdamW(optimizer_groups(built.model, built.table), betas=(0.9, 0.95))
    params = list(built.model.parameters())
    sides = {"torch": torch_clip, "ours": clip_gradients}
    clip_s: dict[str, list[float]] = {name: [] for name in sides}
    step_s: dict[str, list[float]] = {name: [] for name in sides}
    over = 0
    for step in range(steps):
        name = ("torch", "ours")[step % 2]
        start = time.perf_counter()
        x, y = data.train_batch(step, BATCH, SEQ, 0)
        opt.zero_grad()
        F.cross_entropy(built.model(x).flatten(0, 1), y.flatten()).backward()
        clip_start = time.perf_counter()
        sides[name](params, MAX_NORM)
        clip_end = time.perf_counter()
        opt.step()
        if step >= WARMUP:
            clip_s[name].append(clip_end - clip_start)
            step_s[name].append(time.perf_counter() - start)
            # the norm after clipping: max_norm (to rounding) where it clipped, else below
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
            over += bool(norm > MAX_NORM * 0.999)
    med = {f"{kind}_{name}": statistics.median(times[name]) * 1e3
           for kind, times in (("clip", clip_s), ("step", step_s)) for name in sides}
    return {**med, "over": over / (steps - WARMUP)}


def measure_pack(width: int, k: int, steps: int, threads: int, cache: str
                 ) -> dict[str, list[float]]:
    """One pack of `k` trained to `steps`, its optimizer steps alternating between skipping
    what changes nothing (the CPU's way) and making every pass (CUDA's): seconds of each
    side's optimizer steps, and of the whole training steps they ended, after WARMUP."""
    specs = [TrialSpec(width=width, depth=2, head_dim=bench_head_dim(width), base_width=64,
                       base_depth=2, lr=2.0 ** (-10 + i * 6 / max(k - 1, 1)), seed=i,
                       batch_size=8, seq_len=64, budget={"steps": steps}, eval_every=50,
                       data={"val_tokens": 2048}, device="cpu", num_threads=threads)
             for i in range(k)]
    pack = Pack(specs, None, cache)
    free, inner = pack_module.reading_back_is_free, pack.update_fn
    got: dict[str, list[float]] = {f"{kind}_{side}": [] for kind in ("update", "step")
                                   for side in ("every", "skip")}
    last = [time.perf_counter(), 0]

    def alternating_update(*args: object) -> object:
        side = ("every", "skip")[last[1] % 2]
        pack_module.reading_back_is_free = free if side == "skip" else (lambda device: False)
        start = time.perf_counter()
        try:
            return inner(*args)
        finally:
            end = time.perf_counter()
            pack_module.reading_back_is_free = free
            if last[1] >= WARMUP:
                got[f"update_{side}"].append(end - start)
                got[f"step_{side}"].append(end - last[0])
            last[:] = [end, last[1] + 1]

    pack.update_fn = alternating_update
    results = pack.train()
    assert all(r.status == "completed" for r in results), [r.error for r in results]
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--shapes", nargs="*", default=["128x2", "256x4", "512x4"])
    parser.add_argument("--pack-widths", type=int, nargs="*", default=[64, 128])
    parser.add_argument("--k", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), batch {BATCH} x seq {SEQ}; "
          f"{args.steps} steps, the first {WARMUP} untimed, the two clippings alternating")
    print(f"{'shape':>7} {'torch clip ms':>13} {'ours ms':>8} {'x':>5} "
          f"{'torch step ms':>13} {'ours ms':>8} {'x':>6} {'clipped':>8}")
    with tempfile.TemporaryDirectory(prefix="hpt-clip-") as cache:
        for shape in args.shapes:
            width, depth = (int(v) for v in shape.split("x"))
            m = measure(width, depth, args.steps, cache)
            print(f"{shape:>7} {m['clip_torch']:>13.3f} {m['clip_ours']:>8.3f} "
                  f"{m['clip_torch'] / m['clip_ours']:>5.2f} {m['step_torch']:>13.2f} "
                  f"{m['step_ours']:>8.2f} {m['step_torch'] / m['step_ours']:>6.3f} "
                  f"{m['over']:>8.0%}", flush=True)
        if args.pack_widths:
            print(f"\npacks of {args.k}, {args.steps} steps, the first {WARMUP} untimed, "
                  "the optimizer steps alternating (ms, medians)")
            print(f"{'width':>5} {'every pass':>10} {'skipping':>8} {'x':>6} "
                  f"{'step, every pass':>16} {'skipping':>8} {'x':>6}")
        for width in args.pack_widths:
            m = {key: statistics.median(v) * 1e3 for key, v in
                 measure_pack(width, args.k, args.steps, args.threads, cache).items()}
            print(f"{width:>5} {m['update_every']:>10.2f} {m['update_skip']:>8.2f} "
                  f"{m['update_every'] / m['update_skip']:>6.3f} {m['step_every']:>16.2f} "
                  f"{m['step_skip']:>8.2f} {m['step_every'] / m['step_skip']:>6.3f}",
                  flush=True)
    print("\nx = torch's median over ours, or every pass over skipping (> 1: skipping is "
          "faster); clipped = share of timed steps whose gradient norm was over max_norm")


if __name__ == "__main__":
    main()
