"""Subnormal floats on the CPU: `run_trial` (which flushes them to zero while it trains) against
the same trainer with the caller's setting, x86's default of keeping them.

Near the edge of stability attention's probabilities underflow into subnormals, which x86
multiplies ~100x slower than normal floats; the demo's SP arm at its check shape (40 x 3,
head size 8) at the top of its LR grid (2^-5) slowed from ~14 to ~43 ms per step over its
run before `workers/subnormals.py`. Timed here: whole trials of the demo's first arm
at one shape, for each LR, both ways in alternating rounds, as the ratio kept / flushed
seconds (median over rounds; > 1: flushing is faster); ms per step over the first and the
last 50 steps of the flushed and the kept run show where the time goes; and whether the
final validation losses are equal (to the bit, or their relative difference).

    .venv/bin/python benchmarks/subnormals.py [--shape 40x3] [--lrs -7 -6 -5] [--rounds 2]
        [--arm sp] [--threads N] [--spec examples/cpu_study.yaml]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hptransfer.demo import DEFAULT_SPEC
from hptransfer.spec import load_spec
from hptransfer.spec.trial import TrialResult, TrialSpec
from hptransfer.workers.trainer import run_trial

# the trainer as it was: the subnormal setting left to the caller (x86's default: kept)
kept_run_trial = run_trial.__wrapped__


def timed(train, spec: TrialSpec, cache: str) -> tuple[float, dict[int, float], TrialResult]:
    """Seconds of the whole trial, the reporter's timestamps by step, and its result."""
    stamps: dict[int, float] = {}
    start = time.perf_counter()
    result = train(spec, reporter=lambda m: stamps.__setitem__(m["step"], time.perf_counter()),
                   cache_dir=cache)
    return time.perf_counter() - start, stamps, result


def ms_per_step(stamps: dict[int, float], first: bool, n: int = 50) -> float:
    """Mean ms per step between the reports spanning the first (or last) n steps."""
    steps = sorted(stamps)
    inside = [s for s in steps if s <= steps[0] + n] if first else \
        [s for s in steps if s >= steps[-1] - n]
    lo, hi = inside[0], inside[-1]
    return 1e3 * (stamps[hi] - stamps[lo]) / (hi - lo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", type=Path, default=DEFAULT_SPEC)
    parser.add_argument("--arm", default=None, help="parameterization (default: the first arm)")
    parser.add_argument("--shape", default="40x3", help="WIDTHxDEPTH")
    parser.add_argument("--lrs", type=float, nargs="*", default=[-7, -6, -5], help="log2 LRs")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per trial (default: the spec's, one per task)")
    args = parser.parse_args()
    spec = load_spec(args.spec)
    arm = next(a for a in spec.arms if args.arm in (None, a.parameterization))
    width, depth = (int(x) for x in args.shape.split("x"))
    threads = args.threads or spec.resources.threads
    torch.set_num_threads(threads)
    print(f"torch {torch.__version__}, {threads} thread(s), 1-min load "
          f"{os.getloadavg()[0]:.1f}; {arm.parameterization} {width}x{depth}, {args.rounds} "
          f"rounds; {args.spec.name}")
    print(f"{'log2 lr':>7} {'kept s':>7} {'flushed s':>9} {'ratio':>5} | {'kept ms/step':>17} "
          f"{'flushed ms/step':>17} | final val loss")
    print(f"{'':>7} {'':>7} {'':>9} {'':>5} | {'first':>8} {'last':>8} {'first':>8} "
          f"{'last':>8} |")
    with tempfile.TemporaryDirectory(prefix="hpt-subnormals-") as cache:
        for log2_lr in args.lrs:
            trial = spec.trial_spec(arm, width, depth, 2.0**log2_lr, spec.grid.sigma_bases[0],
                                    0).model_copy(update={"num_threads": threads})
            runs: dict[str, list[tuple[float, dict[int, float], TrialResult]]] = {"kept": [],
                                                                             "flushed": []}
            for r in range(args.rounds):
                sides = [("kept", kept_run_trial), ("flushed", run_trial)]
                for name, train in sides if r % 2 == 0 else sides[::-1]:
                    runs[name].append(timed(train, trial, cache))
            kept, flushed = runs["kept"], runs["flushed"]
            ratio = statistics.median(k[0] / f[0] for k, f in zip(kept, flushed, strict=True))
            a, b = kept[-1][2].final_val_loss, flushed[-1][2].final_val_loss
            same = ("equal to the bit" if a == b
                    else f"{a:.6f} vs {b:.6f} ({(b - a) / a:+.1e})")
            print(f"{log2_lr:>7g} {statistics.median(k[0] for k in kept):>7.2f} "
                  f"{statistics.median(f[0] for f in flushed):>9.2f} {ratio:>5.2f} | "
                  f"{ms_per_step(kept[-1][1], True):>8.1f} {ms_per_step(kept[-1][1], False):>8.1f} "
                  f"{ms_per_step(flushed[-1][1], True):>8.1f} "
                  f"{ms_per_step(flushed[-1][1], False):>8.1f} | {same}", flush=True)


if __name__ == "__main__":
    main()
