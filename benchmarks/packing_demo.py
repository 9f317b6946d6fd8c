"""Packing at the demo's own shapes: K packed trials (`run_trials`) against K `run_trial` calls.

`benchmarks/packing.py` scans widths at one pass size (8 x 64 tokens, head size 32); the demo
study (`examples/cpu_study.yaml`) trains other shapes: head size 8, 16 x 64 tokens, budgets
in tokens per parameter, one thread per task. This times the shapes whose LRs the demo could
pack (its tune shape, its check shape, and its ladder's two-layer shapes) as the spec builds
them (`SweepSpec.trial_spec`), for each arm, K LRs one octave apart around the grid's middle, on
the spec's threads per task. The two sides alternate over --rounds rounds; printed is packed
over sequential trials/s, its median and range, and beside it the pack size `pack: auto`
gives the shape on those threads (`coordinator/packing.py`), so a shape packed at a loss (ratio
below 1 where auto > 1) or left alone at a gain shows.

With --busy, a second process runs the same measurement on the other core meanwhile, as the
demo's two tasks do (its own figures are not printed).

    .venv/bin/python benchmarks/packing_demo.py [--k 5] [--rounds 3] [--shapes 32x2 40x3]
        [--spec examples/cpu_study.yaml] [--busy]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from _timing import sequential_and_packed_rounds

from hptransfer.coordinator.packing import auto_pack, measured_packs
from hptransfer.demo import DEFAULT_SPEC
from hptransfer.spec import Arm, SweepSpec, load_spec
from hptransfer.spec.trial import TrialSpec

# the tune shape, the check shape (the ladder's largest) and the ladder's other 2-layer widths
DEMO_SHAPES = ["32x2", "40x3", "16x2", "24x2"]


def shape_specs(spec: SweepSpec, arm: Arm, width: int, depth: int, k: int) -> list[TrialSpec]:
    """K trials of one shape of one arm, LRs one octave apart around the middle of the
    spec's LR grid, at the sweep's own budget, batch, head size and threads."""
    low, high = spec.grid.lr_bounds()
    middle = (low * high) ** 0.5
    lrs = [middle * 2.0 ** (i - (k - 1) / 2) for i in range(k)]
    return [spec.trial_spec(arm, width, depth, lr, spec.grid.sigma_bases[0], 0) for lr in lrs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shapes", nargs="*", default=DEMO_SHAPES, help="WIDTHxDEPTH")
    parser.add_argument("--spec", type=Path, default=DEFAULT_SPEC)
    parser.add_argument("--arms", nargs="*", default=None,
                        help="parameterizations to time (default: every arm of the spec)")
    parser.add_argument("--busy", action="store_true",
                        help="run the same measurement on the other core meanwhile")
    args = parser.parse_args()
    spec = load_spec(args.spec)
    threads = spec.resources.threads
    torch.set_num_threads(threads)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes]
    neighbour = None
    if args.busy:
        argv = [sys.executable, __file__, "--k", str(args.k), "--rounds", str(args.rounds + 1),
                "--spec", str(args.spec), "--shapes", *args.shapes,
                *(["--arms", *args.arms] if args.arms else [])]
        neighbour = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(f"torch {torch.__version__}, {threads} thread(s) per task (the spec's), "
          f"{os.cpu_count()} CPUs, 1-min load {os.getloadavg()[0]:.1f}; K={args.k}, "
          f"{args.rounds} rounds{', the other core busy' if args.busy else ''}; {args.spec.name}")
    arms = [a for a in spec.arms if args.arms is None or a.parameterization in args.arms]
    print(f"{'arm':>12} {'shape':>7} {'tokens/pass':>11} {'seq s':>7} {'packed s':>8} {'ratio':>5} "
          f"{'rounds':>9} {'auto':>4}")
    try:
        with tempfile.TemporaryDirectory(prefix="hpt-pack-demo-") as cache:
            for arm, (width, depth) in ((a, s) for s in shapes for a in arms):
                specs = shape_specs(spec, arm, width, depth, args.k)
                _, _, seq_s, pack_s = sequential_and_packed_rounds(specs, cache, args.rounds)
                ratios = sorted(s / p for s, p in zip(seq_s, pack_s, strict=True))
                first = specs[0].model_dump()
                auto = auto_pack(first, measured_packs(spec))
                tokens = first["batch_size"] * first["seq_len"]
                print(f"{arm.parameterization:>12} {width:>4}x{depth:<2} {tokens:>11} "
                      f"{statistics.median(seq_s):>7.2f} {statistics.median(pack_s):>8.2f} "
                      f"{statistics.median(ratios):>5.2f} {ratios[0]:>4.2f}-{ratios[-1]:<4.2f} "
                      f"{auto:>4}", flush=True)
    finally:
        if neighbour is not None:
            neighbour.kill()
    print("ratio = packed over sequential trials/s (whole trials: set-up, training, "
          "evaluations), median over the rounds; rounds = its lowest and highest; auto = the "
          "pack size `pack: auto` gives this shape on these threads (1: trained one by one).")


if __name__ == "__main__":
    main()
