"""How `fit_report` scales with the number of trials, against a plain pandas groupby.

Synthetic sweeps of ~1k, 10k and 100k trials (arms x widths x depths x LRs x seeds) are timed
with the bootstrap off and on, as a ratio to `df.groupby(shape + lr)["final_val_loss"].min()`
on the same frame in the same run, so the figures mean something across machines.

    .venv/bin/python benchmarks/analysis_scaling.py [--sizes 1k 10k 100k] [--bootstrap 200]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import pandas as pd

from hptransfer.analysis import fit_report

# (arms, widths, depths, lrs, seeds) per sweep size.
PLANS: dict[str, tuple[int, int, int, int, int]] = {
    "1k": (2, 4, 4, 8, 4),
    "10k": (4, 5, 5, 10, 10),
    "100k": (4, 10, 10, 25, 10),
}
# Per-arm drift of log2 η* per doubling of width and of depth (SP drifts, CompleteP does not),
# and a loss multiplier on the reducible part (CompleteP slightly more compute-efficient).
ARMS = {
    "gpt/mup": ("mup", 0.0, -0.5, 1.0),
    "gpt/completep": ("completep", 0.0, 0.0, 0.97),
    "gpt/sp": ("sp", -1.0, -0.5, 1.03),
    "gpt/depth_mup": ("depth_mup", 0.0, -0.15, 0.99),
}
E, A, B, ALPHA, BETA = 1.69, 406.4, 410.7, 0.34, 0.28
# Steps of about 1.5x so that many (width, depth) pairs share a parameter count (N:L groups).
GROUP_KEYS = ["arm", "width", "depth", "sigma_base", "lr"]
WIDTHS = (128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072)
DEPTHS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48)


def synthetic_sweep(
    n_arms: int, n_widths: int, n_depths: int, n_lrs: int, n_seeds: int, seed: int = 0
) -> pd.DataFrame:
    """A sweep whose losses follow a Chinchilla law plus a parabola in log2(lr) per shape."""
    rng = np.random.default_rng(seed)
    arms = list(ARMS)[:n_arms]
    widths = np.array(WIDTHS[:n_widths])
    depths = np.array(DEPTHS[:n_depths])
    log2_lrs = np.linspace(-13.0, -4.0, n_lrs)
    a, w, d, x, s = (
        g.ravel()
        for g in np.meshgrid(
            np.arange(n_arms), widths, depths, log2_lrs, np.arange(n_seeds), indexing="ij"
        )
    )
    table = np.array([ARMS[k][1:] for k in arms])
    drift_w, drift_d, efficiency = table[a, 0], table[a, 1], table[a, 2]
    n_params = 12.0 * w.astype(float) ** 2 * d
    # Vary tokens per parameter (10/20/40) so the Chinchilla fit can separate N from D.
    tpp = 20.0 * 2.0 ** (np.searchsorted(widths, w) % 3 - 1)
    tokens = tpp * n_params
    vertex = -8.0 + drift_w * np.log2(w / 256) + drift_d * np.log2(d / 2)
    loss = E + efficiency * (A / n_params**ALPHA + B / tokens**BETA)
    loss = loss + 0.03 * (x - vertex) ** 2 + rng.normal(0.0, 0.003, len(a))
    status = np.where(x - vertex > 2.5, "diverged", "completed").astype(object)
    odd = rng.random(len(a))
    status[odd < 0.01] = "failed"
    status[(odd >= 0.01) & (odd < 0.015)] = "pending"
    finished = status == "completed"
    return pd.DataFrame(
        {
            "trial_id": [f"t{i}" for i in range(len(a))],
            "arm": np.array(arms, dtype=object)[a],
            "arch": "gpt",
            "parameterization": np.array([ARMS[k][0] for k in arms], dtype=object)[a],
            "width": w,
            "depth": d,
            "lr": 2.0**x,
            "sigma_base": 0.02,
            "seed": s,
            "status": status,
            "final_val_loss": np.where(finished, loss, np.nan),
            "flops": 6.0 * n_params * tokens,
            "tokens": tokens,
            "params_non_embedding": n_params.astype(np.int64),
            "params_embedding": (50_304 * w).astype(np.int64),
        }
    )


def best_time(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(PLANS), choices=list(PLANS))
    parser.add_argument("--bootstrap", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    header = (
        f"{'trials':>8} {'shapes':>6} {'groupby ms':>10} {'report ms':>10} {'ratio':>7} "
        f"{'+boot ms':>10} {'ratio':>7}"
    )
    print(
        f"fit_report timings (best of {args.repeat} without bootstrap; one run with "
        f"bootstrap={args.bootstrap})"
    )
    print(header)
    for size in args.sizes:
        df = synthetic_sweep(*PLANS[size])
        t_ref = best_time(lambda df=df: df.groupby(GROUP_KEYS)["final_val_loss"].min(), 5)
        t_fast = best_time(lambda df=df: fit_report(df, bootstrap=0), args.repeat)
        t_boot = best_time(lambda df=df: fit_report(df, bootstrap=args.bootstrap, seed=0), 1)
        shapes = df.groupby(["arm", "width", "depth"]).ngroups
        print(
            f"{len(df):>8} {shapes:>6} {t_ref * 1e3:>10.2f} {t_fast * 1e3:>10.1f} "
            f"{t_fast / t_ref:>7.0f} {t_boot * 1e3:>10.0f} {t_boot / t_ref:>7.0f}"
        )


if __name__ == "__main__":
    main()
