"""torch.compile on the CPU: steady training steps of a pack and of one trial, eager vs compiled.

The question it answers: should a CPU pack compile, and does compiling change what packing
gains? Each side trains K packed trials (`run_trials`) and one trial alone (`run_trial`) for
--short and --long steps, evaluation only at the end; the difference of the two wall times
over the difference of the steps is the steady step, free of set-up, compile and the final
evaluation (which both runs pay alike). The compiled side runs with HPT_COMPILE=all after a
dynamo reset each time (a new pack is a new graph; inductor's on-disk kernel cache, warmed by
an untimed first run, makes later compiles a few seconds). Sides alternate by round.

Printed per width: the pack's step eager and compiled and their ratio, the same for one
trial, and packed/sequential (K x one trial's step over the pack's step) in each mode; the
compile's own cost is the difference of the fixed parts.

    .venv/bin/python benchmarks/packing_compile.py [--widths 64 128] [--k 8] [--threads N]
        [--short 40] [--long 140] [--rounds 2]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from _timing import alternating
from packing import grid

from hptransfer.spec.trial import TrialSpec
from hptransfer.workers.packed import run_trials
from hptransfer.workers.trainer import run_trial


def specs_for(width: int, k: int, steps: int, threads: int) -> list[TrialSpec]:
    # evaluation only at the end: the step difference of two runs is pure training
    return [s.model_copy(update={"eval_every": 10**9}) for s in grid(width, k, steps, threads)]


def wall(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def steady(train: Callable[[int], object], short: int, long: int) -> tuple[float, float]:
    """(seconds per steady step, seconds of fixed cost) from runs of `short` and `long` steps."""
    t_short, t_long = wall(lambda: train(short)), wall(lambda: train(long))
    step = (t_long - t_short) / (long - short)
    return step, t_short - short * step


def measure(width: int, k: int, threads: int, short: int, long: int,
            compiled: bool, cache: str) -> dict[str, float]:
    os.environ["HPT_COMPILE"] = "all" if compiled else "0"

    def pack(steps: int) -> None:
        torch._dynamo.reset()  # a fresh graph per run, as a worker process would compile
        results = run_trials(specs_for(width, k, steps, threads), cache_dir=cache)
        if any(r.status != "completed" for r in results):
            raise RuntimeError(next(r.error for r in results if r.status != "completed"))

    def one(steps: int) -> None:
        torch._dynamo.reset()
        result = run_trial(specs_for(width, 1, steps, threads)[0], cache_dir=cache)
        if result.status != "completed":
            raise RuntimeError(result.error)

    pack_step, pack_fixed = steady(pack, short, long)
    one_step, one_fixed = steady(one, short, long)
    return {"pack": pack_step, "pack_fixed": pack_fixed, "one": one_step, "one_fixed": one_fixed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", type=int, nargs="*", default=[64, 128])
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--short", type=int, default=40)
    parser.add_argument("--long", type=int, default=140)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, {os.cpu_count()} CPUs, 1-min "
          f"load {os.getloadavg()[0]:.1f}; K={args.k}, steady steps from {args.short} and "
          f"{args.long}-step runs, {args.rounds} alternating rounds")
    print(f"{'width':>5} | {'pack eager ms':>13} {'compiled':>8} {'x':>5} | {'one eager ms':>12} "
          f"{'compiled':>8} {'x':>5} | {'packed/seq eager':>16} {'compiled':>8} | "
          f"{'compile s: pack':>15} {'one':>5}")
    with tempfile.TemporaryDirectory(prefix="hpt-packc-") as cache:
        for width in args.widths:
            for compiled in (False, True):  # untimed: data cache, inductor's kernel cache
                measure(width, args.k, args.threads, 2, 3, compiled, cache)
            got = alternating({
                mode: functools.partial(measure, width, args.k, args.threads, args.short,
                                        args.long, mode == "compiled", cache)
                for mode in ("eager", "compiled")}, args.rounds)
            med = {mode: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
                   for mode, rows in got.items()}
            e, c = med["eager"], med["compiled"]
            print(f"{width:>5} | {e['pack'] * 1e3:>13.1f} {c['pack'] * 1e3:>8.1f} "
                  f"{e['pack'] / c['pack']:>5.2f} | {e['one'] * 1e3:>12.2f} "
                  f"{c['one'] * 1e3:>8.2f} {e['one'] / c['one']:>5.2f} | "
                  f"{args.k * e['one'] / e['pack']:>16.2f} "
                  f"{args.k * c['one'] / c['pack']:>8.2f} | "
                  f"{c['pack_fixed'] - e['pack_fixed']:>15.1f} "
                  f"{c['one_fixed'] - e['one_fixed']:>5.1f}", flush=True)
    print(f"1-min load after: {os.getloadavg()[0]:.1f}")
    print("pack / one ms: steady training step of the K-member pack / of one trial alone "
          "(medians over rounds); x = eager over compiled (> 1: compiling is faster); "
          "packed/seq = K x one trial's step over the pack's step, in each mode; compile s = "
          "the compiled run's fixed cost over the eager run's (compile with a warm kernel "
          "cache).")


if __name__ == "__main__":
    main()
