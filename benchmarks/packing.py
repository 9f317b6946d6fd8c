"""Trials/s of K packed trials (`run_trials`) against K sequential `run_trial` calls.

Same specs (an LR grid of K members, one seed each), same thread budget, same process, one
after the other per width, in --rounds rounds of alternating order (this host's speed drifts
from minute to minute); printed as the ratio packed/sequential, its median over the rounds
and its range. Each side trains every member to its budget with its evaluations, as a sweep
would. Run under the heavy lock on a shared machine; a loaded machine makes both sides
slower, the ratio less so.

The ceiling, measured in the same run: packing can only help by running the same FLOPs at a
higher rate. "trial GFLOP/s" is what one sequential trial achieves in its training loop
(analytic training FLOPs x its tokens/s, median of the K); "bmm GFLOP/s" is the rate of one
torch.bmm of K of its largest matmuls (K x (batch*seq) x width @ width x 4*width) on the same
threads: the fastest a packed step could run if every FLOP were in such a batched matmul
(attention, norms and the optimizer never are). Hence "max x" = bmm / trial bounds the
packing speedup from above; "mm GFLOP/s" (one member's matmul alone) shows whether batching
the matmuls makes them any faster on this machine at all.

A tighter ceiling from the pack's own matmuls: "pack mm ms" is the time per training step the
pack spends inside its matrix multiplies (every linear layer's forward and backward bmm, at
their real shapes and layouts, timed call by call), "trial ms" one sequential trial's whole
training step (median of the K). Packing cannot make those matmuls cheaper than they are, so
K x trial ms / pack mm ms ("mm bound x") is the most the pack could gain even if everything
else in its step (attention, norms, activations, the loss, AdamW) cost nothing. "attn ms" is
the pack's time per step inside torch's attention kernels, timed the same way; "+attn bound x"
= K x trial ms / (pack mm ms + attn ms) is the ceiling with those counted too, since a pack
runs its attention as well. "seq kern ms" is the same kernel time of the K trials run one by
one, and "kern x" = seq kern ms / (pack mm ms + attn ms): whether batching makes those kernels
themselves any faster. Where it does not (kern x near 1), packing can only save the rest of
the step. Kernel times come from two short runs (4 and 12 steps) differenced, the pack's and
the trials' alternating over the --rounds rounds, median per kind.

    .venv/bin/python benchmarks/packing.py [--k 8] [--widths 64 128 256] [--steps 60]
        [--threads N] [--depth L] [--rounds 3]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile

import torch
from _timing import (
    alternating,
    bench_head_dim,
    kernel_seconds_per_step,
    matmul_flops,
    sequential_and_packed_rounds,
)

from hptransfer.spec.trial import TrialResult, TrialSpec
from hptransfer.workers.trainer import run_trial

BATCH, SEQ_LEN = 8, 64


def grid(width: int, k: int, steps: int, threads: int, depth: int = 2) -> list[TrialSpec]:
    return [
        TrialSpec(width=width, depth=depth, head_dim=bench_head_dim(width), base_width=64,
                  base_depth=2, parameterization="completep",
                  lr=2.0 ** (-10 + i * 6 / max(k - 1, 1)), seed=i, batch_size=BATCH,
                  seq_len=SEQ_LEN, budget={"steps": steps}, eval_every=50,
                  data={"val_tokens": 8192, "max_corpus_bytes": 2_000_000},
                  device="cpu", num_threads=threads, divergence_factor=1e9)
        for i in range(k)
    ]


def achieved(result: TrialResult) -> float:
    """Training FLOP/s of one trial's training loop."""
    return result.tokens_per_s * result.flops_per_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--widths", type=int, nargs="*", default=[64, 128, 256])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3,
                        help="sequential and packed runs per width, alternating")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    print(f"torch {torch.__version__}, {args.threads} threads, {os.cpu_count()} CPUs, "
          f"1-min load {load:.1f}; K={args.k}, {args.steps} steps, batch {BATCH} x seq "
          f"{SEQ_LEN}, depth {args.depth}")
    print(f"{'width':>5} {'seq s':>7} {'packed s':>8} {'seq trials/s':>12} "
          f"{'packed trials/s':>15} {'ratio':>5} {'rounds':>9} | {'trial':>6} {'packed':>7} "
          f"{'mm':>5} {'bmm':>5} {'max x':>5} | {'trial ms':>8} {'pack mm ms':>10} "
          f"{'mm bound x':>10} "
          f"{'attn ms':>7} {'+attn bound x':>13} | {'seq kern ms':>11} {'kern x':>7}")
    with tempfile.TemporaryDirectory(prefix="hpt-pack-") as cache:
        run_trial(grid(64, 1, 2, args.threads)[0], cache_dir=cache)  # data cache + warm-up
        for width in args.widths:
            specs = grid(width, args.k, args.steps, args.threads, args.depth)
            shape = (BATCH * SEQ_LEN, width, 4 * width)
            mm = matmul_flops(*shape, args.threads)
            bmm = matmul_flops(*shape, args.threads, batch=args.k)
            seq, packed, seq_s, pack_s = sequential_and_packed_rounds(specs, cache, args.rounds)
            t_seq, t_pack = statistics.median(seq_s), statistics.median(pack_s)
            ratios = [s / p for s, p in zip(seq_s, pack_s, strict=True)]
            bad = [r.error for r in seq + packed if r.status == "failed"]
            if bad:
                raise RuntimeError(bad[0])
            bmm = max(bmm, matmul_flops(*shape, args.threads, batch=args.k))
            trial = statistics.median(achieved(r) for r in seq)
            pack = sum(achieved(r) for r in packed)
            step = statistics.median(BATCH * SEQ_LEN / r.tokens_per_s for r in seq)
            # the pack's kernel time and the K trials' own, alternating, median per kind
            timed = alternating({side: functools.partial(kernel_seconds_per_step, specs, cache,
                                                         packed=side == "pack")
                                 for side in ("pack", "seq")}, args.rounds)
            kernels, own = ({kind: statistics.median(r[kind] for r in timed[side])
                             for kind in timed[side][0]} for side in ("pack", "seq"))
            mm_floor = kernels["matmul"]
            floor = mm_floor + kernels["attention"]
            own_floor = own["matmul"] + own["attention"]
            print(f"{width:>5} {t_seq:>7.2f} {t_pack:>8.2f} {args.k / t_seq:>12.2f} "
                  f"{args.k / t_pack:>15.2f} {statistics.median(ratios):>5.2f} "
                  f"{min(ratios):>4.2f}-{max(ratios):<4.2f} | {trial / 1e9:>6.1f} "
                  f"{pack / 1e9:>7.1f} {mm / 1e9:>5.0f} {bmm / 1e9:>5.0f} {bmm / trial:>5.2f} | "
                  f"{step * 1e3:>8.2f} {mm_floor * 1e3:>10.2f} {args.k * step / mm_floor:>10.2f} "
                  f"{kernels['attention'] * 1e3:>7.2f} {args.k * step / floor:>13.2f} | "
                  f"{own_floor * 1e3:>11.2f} {own_floor / floor:>7.2f}",
                  flush=True)
    print(f"1-min load after: {os.getloadavg()[0]:.1f}")
    print(f"ratio = packed trials/s over sequential (whole trials: set-up, training, "
          f"evaluations), the median over {args.rounds} rounds of the two run one after the "
          "other, in alternating order; rounds = its lowest and highest; seq s, packed s = "
          "median seconds. GFLOP/s (training loops only): trial = one sequential trial "
          "(median), packed = the pack's members together, mm / bmm = one fp32 matmul "
          f"(batch*seq) x width @ width x 4*width alone / {args.k} of them in one bmm; "
          "max x = bmm / trial: the most packing could speed up training on these threads. "
          "trial ms = one sequential trial's training step (median), pack mm ms = the pack's "
          "time in matmuls per step, mm bound x = K x trial ms / pack mm ms: the most packing "
          "could gain if nothing but its matmuls cost time; attn ms = the pack's time in "
          "attention kernels per step, +attn bound x = K x trial ms / (pack mm ms + attn "
          "ms): the same bound with attention's kernels, which no pack can skip, counted "
          f"too. seq kern ms = the {args.k} sequential trials' own time in matmuls and "
          "attention kernels per step, together; kern x = seq kern ms / (pack mm ms + attn "
          "ms): how much faster batching made those kernels (1.0: not at all).")


if __name__ == "__main__":
    main()
