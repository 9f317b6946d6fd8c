"""What the demo's η* would need to be reliable: the LR bracket's rise against the seed noise.

The demo (`examples/cpu_study.yaml`) trains its tune shape 16x2 for 31 steps (5 tokens per
non-embedding parameter), two seeds per LR, and every η* comes out NOT reliable: the bracket
is flat within the seed noise. This trains one shape's LR grid (2^-9 ... 2^-4, one octave
apart, the demo's data, batch and schedule) for SP and µP at several budgets with S seeds,
and prints each budget's loss table and the service's η* fit (`optimal_lr`) from the first
2 seeds and from all S: the paired noise, the bracket's rise, the CI, the verdict.

It trains in this process with `run_trial`, one trial at a time on one thread (the
demo's trials run on one thread each too): the question is the losses, not the service.
µP and CompleteP are the same model at the base shape (16x2), so CompleteP is not trained.

    .venv/bin/python benchmarks/demo_noise.py --shape 16x2 --tpp 5 20 60 --seeds 4
    .venv/bin/python benchmarks/demo_noise.py --shape 16x8 --tpp 20 --seeds 4
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import pandas as pd

from hptransfer.analysis.optimal_lr import optimal_lr
from hptransfer.spec.sweep import load_spec
from hptransfer.workers.trainer import run_trial

DEMO_SPEC = Path(__file__).resolve().parent.parent / "examples" / "cpu_study.yaml"
LOG2_LRS = range(-9, -3)
FIT_COLUMNS = ("arm", "log2_lr_opt", "log2_ci_low", "log2_ci_high", "eta_noise_sd",
               "eta_noise_dof", "bracket_rise", "bracket_noise", "reliable")


def train_grid(width: int, depth: int, tpp: float, seeds: int) -> pd.DataFrame:
    """One row per (arm, LR, seed): the final validation loss of the demo's trial there."""
    spec = load_spec(DEMO_SPEC)
    arms = [a for a in spec.arms if a.parameterization in ("sp", "mup")]
    rows = []
    for arm, log2_lr, seed in itertools.product(arms, LOG2_LRS, range(seeds)):
        trial = spec.trial_spec(arm, width, depth, 2.0**log2_lr, 0.02, seed,
                                tokens_per_param=tpp)
        result = run_trial(trial)
        rows.append({"trial_id": f"{arm.parameterization}/{log2_lr}/{seed}",
                     "arm": arm.parameterization, "width": width, "depth": depth,
                     "lr": 2.0**log2_lr, "sigma_base": 0.02, "seed": seed,
                     "status": result.status, "final_val_loss": result.final_val_loss,
                     "steps": result.steps})
    return pd.DataFrame(rows)


def report(frame: pd.DataFrame, seeds: int) -> None:
    table = frame.pivot_table(index="lr", columns=["arm", "seed"], values="final_val_loss")
    print(table.round(3).to_string())
    for n in sorted({2, seeds}):
        fit = optimal_lr(frame[frame["seed"] < n])
        print(f"-- η* from the first {n} seeds")
        print(fit.shapes[list(FIT_COLUMNS)].to_string(index=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="16x2", help="WIDTHxDEPTH (default 16x2)")
    parser.add_argument("--tpp", type=float, nargs="+", default=[5.0, 20.0],
                        help="tokens per non-embedding parameter, one grid each")
    parser.add_argument("--seeds", type=int, default=4)
    args = parser.parse_args()
    width, depth = (int(x) for x in args.shape.split("x"))
    for tpp in args.tpp:
        start = time.perf_counter()
        frame = train_grid(width, depth, tpp, args.seeds)
        print(f"== {width}x{depth}, {tpp:g} tokens per parameter ({frame['steps'].iloc[0]} "
              f"steps), {args.seeds} seeds: {time.perf_counter() - start:.0f} s", flush=True)
        report(frame, args.seeds)


if __name__ == "__main__":
    main()
