"""GPU check: MFU of one trial at widths 256, 1024, 2048 (bf16, torch.compile) and packed
(K=8) vs sequential trials/s at width 256.

MFU is measured twice per width:
- steady: analytic training FLOPs per token x tokens/s between two reporter calls after the
  first third of the steps (compile and warm-up excluded; the trainer reads losses back to
  the host at those calls, so the interval holds every step's GPU work);
- trial: run_trial's own figure, compile, warm-up and the final eval included.
The packing ratio is what a sweep sees: K trials one after the other (each compiling) against
one pack of K, wall time.

`--device cpu` runs the same script on the CPU (fp32, small widths by default, no peak so
no MFU): a dry run of every code path except CUDA's, for machines without a GPU.
`scripts/gpu_check.sh` runs it on the GPU machine that the device tool lends (after
`scripts/gpu_wheels.sh` here fetched the wheels that machine lacks).

    .venv/bin/python benchmarks/gpu_check.py [--steps 60] [--k 8] [--device cuda|cpu]
        [--widths 256 1024 2048] [--pack-width 256]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import Any

import torch
from _timing import sequential_and_packed_rounds, step_stamps

from hptransfer.models.flops import flops_per_token
from hptransfer.status import TrialStatus
from hptransfer.workers.device import peak_flops, resolve_device
from hptransfer.workers.plan import load_trial_data
from hptransfer.workers.trial import TrialSpec

CPU_DEFAULTS = {"widths": [64, 128], "pack_width": 64, "batch": 4, "seq_len": 128}
CUDA_DEFAULTS = {"widths": [256, 1024, 2048], "pack_width": 256, "batch": 32, "seq_len": 512}


def spec(width: int, steps: int, device: str, batch: int, seq_len: int,
         lr: float = 2.0**-8, seed: int = 0) -> TrialSpec:
    return TrialSpec(width=width, depth=4, head_dim=64, base_width=256, base_depth=2, lr=lr,
                     seed=seed, batch_size=batch, seq_len=seq_len, budget={"steps": steps},
                     eval_every=10**9, data={"val_tokens": 16384}, device=device,
                     precision="bf16" if device == "cuda" else "fp32",
                     divergence_factor=1e9)  # a timing run must not stop early


def steady_tokens_per_s(s: TrialSpec, cache: str) -> tuple[float, Any]:
    """(tokens/s over the steps after the first third, the trial's result)."""
    stamps, result = step_stamps(s, cache)
    steps = s.budget.steps or 0
    # the last stamp before the final step (which also evaluates)
    window = sorted(k for k in stamps if steps // 3 <= k < steps - 1)
    if len(window) < 2:
        raise RuntimeError(f"{len(window)} reporter calls in the timed window")
    first, last = window[0], window[-1]
    tokens = (last - first) * s.batch_size * s.seq_len
    return tokens / (stamps[last] - stamps[first]), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--widths", type=int, nargs="+")
    parser.add_argument("--pack-width", type=int)
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check on this machine (--device cpu dry-runs it)")
        return
    defaults = CUDA_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS
    widths = args.widths or defaults["widths"]
    pack_width = args.pack_width or defaults["pack_width"]
    batch, seq_len = defaults["batch"], defaults["seq_len"]
    device = resolve_device(args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    peak = peak_flops(device)
    print(f"{name}, torch {torch.__version__}, peak bf16 "
          f"{'unknown' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}; "
          f"batch {batch} x seq {seq_len}, depth 4, {args.steps} steps")
    with tempfile.TemporaryDirectory(prefix="hpt-gpu-") as cache:
        for width in widths:
            # compiled afresh, as in a new worker process: a second width in one process
            # would otherwise make dynamo recompile with dynamic shapes
            torch._dynamo.reset()
            s = spec(width, args.steps, args.device, batch, seq_len)
            data = load_trial_data(s, cache)
            fpt = flops_per_token(s.model_config_obj(vocab_size=data.vocab_size),
                                  seq_len).training
            tps, r = steady_tokens_per_s(s, cache)
            steady = f"{fpt * tps / peak:.1%}" if peak else "n/a"
            trial = f"{r.mfu:.1%}" if r.mfu is not None else "n/a"
            print(f"width {width}: steady {tps:,.0f} tok/s, {fpt * tps / 1e12:.2f} TFLOP/s, "
                  f"MFU {steady}; trial (compile and eval included) "
                  f"{r.tokens_per_s:,.0f} tok/s, MFU {trial}; notes={r.notes}", flush=True)
        torch._dynamo.reset()
        specs = [spec(pack_width, args.steps, args.device, batch, seq_len,
                      lr=2.0 ** (-10 + i * 0.75), seed=i) for i in range(args.k)]
        seq, packed, [t_seq], [t_pack] = sequential_and_packed_rounds(specs, cache, 1)
        print(f"width {pack_width}, K={args.k}: sequential {t_seq:.1f} s, packed {t_pack:.1f} "
              f"s, ratio {t_seq / t_pack:.2f}; statuses "
              f"{sorted({TrialStatus(r.status).value for r in seq + packed})}")
        print(f"packed notes: {packed[0].notes}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
