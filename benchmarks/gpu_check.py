"""GPU check: MFU of one trial at widths 256, 1024, 2048 (bf16, torch.compile), packed (K=8)
vs sequential trials at width 256, and packed-vs-solo equivalence on the device.

Sections, in order of what a short lease must not miss; each is timed, a failing one prints
its traceback and the next runs, and a section that would start after `--deadline` seconds
is skipped (the device tool's lease is short):
- mfu: per width, analytic training FLOPs per token x tokens/s between two reporter calls
  after the first third of the steps (compile and warm-up excluded; the trainer reads losses
  back to the host at those calls, so the interval holds every step's GPU work), and
  run_trial's own figure (compile, warm-up and the final eval included).
- pack: K trials one after the other (each its own run_trial) against one pack of K: wall
  time, as a sweep sees it (compiles included), and steady tokens/s (compiles excluded).
- equivalence: tests/test_packed.py's cases (every arch x parameterization) on the device,
  eager fp32, each member of a pack against run_trial alone (goal: final val loss within
  1e-3 relative), then two cases compiled in bf16 (the bf16 tests' 5e-3).
On request (`--only profile scan`): profile, a lone trial's and a pack's time per step,
device-busy time, kernels and host ops under torch.profiler; scan, steady pack-vs-solo
ratios per `--scan WIDTH:K` (what `pack: auto` on CUDA is set from).

`--device cpu` runs the same script on the CPU (fp32, small widths, no peak so no MFU): a dry
run of every code path except CUDA's. `scripts/gpu_check.sh` runs it on the GPU machine that
the device tool lends (after `scripts/gpu_wheels.sh` here fetched the wheels it lacks).

    .venv/bin/python benchmarks/gpu_check.py [--steps 100] [--pack-steps 200] [--k 8]
        [--device cuda|cpu] [--widths 256 1024 2048] [--pack-width 256] [--deadline 480]
        [--only mfu pack equivalence profile scan] [--profile-k 8 16] [--scan 256:8 512:8]
        [--inductor max_autotune=True ...]
"""

from __future__ import annotations

import argparse
import ast
import math
import os
import sys
import tempfile
import time
import traceback
import unittest.mock
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _timing import pack_step_stamps, step_stamps

from hptransfer.contracts.status import TrialStatus
from hptransfer.models.flops import flops_per_token
from hptransfer.spec.trial import TrialResult, TrialSpec
from hptransfer.workers.memory import trial_memory
from hptransfer.workers.outcome import peak_flops
from hptransfer.workers.packed import run_trials
from hptransfer.workers.plan import autocasts, load_trial_data, resolve_device
from hptransfer.workers.trainer import run_trial

CPU_DEFAULTS = {"widths": [64, 128], "pack_width": 64, "batch": 4, "seq_len": 128}
CUDA_DEFAULTS = {"widths": [256, 1024, 2048], "pack_width": 256, "batch": 32, "seq_len": 512}
SECTIONS = ("mfu", "pack", "equivalence")
# on request (--only ...): where a pack's step time goes; steady pack ratios per width and K
EXTRA_SECTIONS = ("profile", "scan")
BF16_COMPILED_CASES = ("gpt-completep", "ngpt")
# training steps of the two profiled runs whose difference the profile section reports
PROFILE_STEPS = (20, 60)


def spec(width: int, steps: int, device: str, batch: int, seq_len: int,
         lr: float = 2.0**-8, seed: int = 0) -> TrialSpec:
    return TrialSpec(width=width, depth=4, head_dim=64, base_width=256, base_depth=2, lr=lr,
                     seed=seed, batch_size=batch, seq_len=seq_len, budget={"steps": steps},
                     eval_every=10**9, data={"val_tokens": 16384}, device=device,
                     precision="bf16" if device == "cuda" else "fp32",
                     divergence_factor=1e9)  # a timing run must not stop early


def grid_lr(i: int, k: int) -> float:
    """Member i of k's LR: 2^-10 ... 2^-4.75 whatever k (a pack of 8 steps by 0.75 octave),
    so a larger pack holds no member that diverges and shrinks it mid-measurement."""
    return 2.0 ** (-10 + i * 5.25 / max(1, k - 1))


def steady_rate(stamps: dict[int, float], steps: int) -> tuple[int, float]:
    """(steps, seconds) between the first reporter call after a third of the run and the
    last one before the final step (which also evaluates)."""
    window = sorted(k for k in stamps if steps // 3 <= k < steps - 1)
    if len(window) < 2:
        raise RuntimeError(f"{len(window)} reporter calls in the timed window")
    first, last = window[0], window[-1]
    return last - first, stamps[last] - stamps[first]


def steady_tokens_per_s(s: TrialSpec, cache: str) -> tuple[float, TrialResult]:
    """(tokens/s over the steps after the first third, the trial's result)."""
    stamps, result = step_stamps(s, cache)
    n, seconds = steady_rate(stamps, s.budget.steps or 0)
    return n * s.batch_size * s.seq_len / seconds, result


def packed_steady(specs: list[TrialSpec], cache: str) -> tuple[float, float, list[TrialResult]]:
    """(all members' tokens/s in the steady window, wall seconds, results) of one pack."""
    t = time.perf_counter()
    stamps, results = pack_step_stamps(specs, cache)
    wall = time.perf_counter() - t
    n, seconds = steady_rate(stamps, specs[0].budget.steps or 0)
    s = specs[0]
    return len(specs) * n * s.batch_size * s.seq_len / seconds, wall, results


def section_mfu(args: argparse.Namespace, cache: str) -> None:
    peak = peak_flops(args.device_obj)
    for width in args.widths:
        # compiled afresh, as in a new worker process: a second width in one process
        # would otherwise make dynamo recompile with dynamic shapes
        torch._dynamo.reset()
        s = spec(width, args.steps, args.device, args.batch, args.seq_len)
        data = load_trial_data(s, cache)
        fpt = flops_per_token(s.model_config_obj(vocab_size=data.vocab_size),
                              args.seq_len).training
        t = time.perf_counter()
        tps, r = steady_tokens_per_s(s, cache)
        wall = time.perf_counter() - t
        steady = f"{fpt * tps / peak:.1%}" if peak else "n/a"
        trial = f"{r.mfu:.1%}" if r.mfu is not None else "n/a"
        print(f"width {width}: steady {tps:,.0f} tok/s, {fpt * tps / 1e12:.2f} TFLOP/s, "
              f"MFU {steady}; trial (compile and eval included, {wall:.1f} s wall) "
              f"{r.tokens_per_s:,.0f} tok/s, MFU {trial}; peak memory "
              f"{_peak_memory_gib(args.device_obj)}; notes={r.notes}", flush=True)


def section_pack(args: argparse.Namespace, cache: str) -> None:
    torch._dynamo.reset()
    specs = [spec(args.pack_width, args.pack_steps, args.device, args.batch, args.seq_len,
                  lr=grid_lr(i, args.k), seed=i) for i in range(args.k)]
    load_trial_data(specs[0], cache)  # the tokenizer is trained once, outside both timings
    t = time.perf_counter()
    solo_tps, seq = [], []
    for s in specs:
        tps, r = steady_tokens_per_s(s, cache)
        solo_tps.append(tps)
        seq.append(r)
    t_seq = time.perf_counter() - t
    print(f"width {args.pack_width}, {args.pack_steps} steps: sequential {args.k} trials "
          f"{t_seq:.1f} s wall, steady {min(solo_tps):,.0f}-{max(solo_tps):,.0f} tok/s each",
          flush=True)
    pack_tps, t_pack, packed = packed_steady(specs, cache)
    mean_solo = sum(solo_tps) / len(solo_tps)
    print(f"width {args.pack_width}, K={args.k}: packed {t_pack:.1f} s wall, steady "
          f"{pack_tps:,.0f} tok/s, peak memory {_peak_memory_gib(args.device_obj)} "
          f"({_estimated_gib(specs[0], args.k, args.device_obj, cache)}); "
          f"ratio wall {t_seq / t_pack:.2f}x, steady "
          f"{pack_tps / mean_solo:.2f}x; statuses "
          f"{sorted({TrialStatus(r.status).value for r in seq + packed})}")
    # per member, LR ascending: past the stable LRs (loss above the best) training is
    # chaotic and amplifies rounding (CPU fp32, width 64: 2e-6..2e-4 up to 2^-7.75, 7e-3..6e-2
    # beyond, with first losses equal to 7e-7); the equivalence section holds the 1e-3 goal
    rels = [abs(p.final_val_loss - q.final_val_loss) / q.final_val_loss
            for p, q in zip(packed, seq, strict=True)]
    print(f"{specs[0].precision} members vs run_trial, final val loss rel diff per LR: "
          + ", ".join(f"2^{math.log2(s.lr):.2f}: {r:.1e} (loss {q.final_val_loss:.3f})"
                      for s, r, q in zip(specs, rels, seq, strict=True)))
    print(f"packed notes: {packed[0].notes}", flush=True)


def section_equivalence(args: argparse.Namespace, cache: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from test_packed import CASES, specs_for

    def compare(name: str, specs: list[TrialSpec], tol: float) -> None:
        torch._dynamo.reset()
        t = time.perf_counter()
        packed = run_trials(specs, cache_dir=cache)
        solos = [run_trial(s, cache_dir=cache) for s in specs]
        rels, firsts = [], []
        for p, q in zip(packed, solos, strict=True):
            if p.status != q.status or q.final_val_loss is None:
                print(f"  {name}: status packed {p.status} / solo {q.status}: "
                      f"{p.error or q.error}")
                return
            rels.append(abs(p.final_val_loss - q.final_val_loss) / q.final_val_loss)
            firsts.append(abs(p.curve[0]["train_loss"] - q.curve[0]["train_loss"]))
        verdict = "ok" if max(rels) <= tol else f"OVER {tol:g}"
        print(f"  {name}: final val loss rel diff max {max(rels):.2e} ({verdict}), first "
              f"train loss abs diff max {max(firsts):.1e}, losses "
              f"{[round(q.final_val_loss, 4) for q in solos]}, "
              f"{time.perf_counter() - t:.1f} s", flush=True)

    device = {"device": args.device}
    with unittest.mock.patch.dict(os.environ, HPT_COMPILE="0"):  # restored after, as it was
        print("eager fp32, packed vs run_trial per member (tol 1e-3):", flush=True)
        for name, case in CASES.items():
            compare(name, [s.model_copy(update=device) for s in specs_for(case)], 1e-3)
    if args.device != "cuda":
        return
    if time.perf_counter() - args.started > args.deadline:
        print("compiled bf16 equivalence: skipped, past the deadline", flush=True)
        return
    print("compiled bf16, packed vs run_trial per member (tol 5e-3):", flush=True)
    for name in BF16_COMPILED_CASES:
        specs = [s.model_copy(update={**device, "precision": "bf16"})
                 for s in specs_for(CASES[name])]
        compare(name, specs, 5e-3)


def section_profile(args: argparse.Namespace, cache: str) -> None:
    """A lone trial (`run_trial`) and a pack of each K at the pack width, compiled and
    warmed, under torch.profiler: per training step, wall time and the device's busy time
    (host-bound when the device idles for much of the step), then kernels and host ops.
    Per step = the difference of a short and a long profiled run over their difference in
    steps, so set-up, the first compile and the final evaluation cancel out."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + (
        [ProfilerActivity.CUDA] if args.device == "cuda" else [])
    short, long = PROFILE_STEPS
    for k in [1, *args.profile_k]:
        torch._dynamo.reset()

        def train(steps: int, k: int = k) -> None:
            specs = [spec(args.pack_width, steps, args.device, args.batch, args.seq_len,
                          lr=grid_lr(i, k), seed=i) for i in range(k)]
            results = [run_trial(specs[0], cache_dir=cache)] if k == 1 else run_trials(
                specs, cache_dir=cache)
            if any(r.status == TrialStatus.FAILED for r in results):
                raise RuntimeError(next(r.error for r in results if r.error))

        train(short)  # compile (later runs' Compiled reuse it)
        runs = []
        for steps in (short, long):
            with profile(activities=activities) as prof:
                t = time.perf_counter()
                train(steps)
                wall = time.perf_counter() - t
            events = prof.key_averages()
            runs.append((wall, _device_seconds(events), events))
        (wall_s, busy_s, _), (wall_l, busy_l, events) = runs
        step_ms, busy_ms = ((b - a) / (long - short) * 1e3
                            for a, b in ((wall_s, wall_l), (busy_s, busy_l)))
        what = "one trial alone (run_trial)" if k == 1 else f"a pack of K={k}"
        print(f"{what}: {step_ms:.2f} ms per training step under the profiler, the device "
              f"busy {busy_ms:.2f} ms of it ({busy_ms / step_ms:.0%}"
              f"{'' if k == 1 else f'; {busy_ms / k:.2f} ms per member'}); tables: the "
              f"{long}-step run", flush=True)
        sort = "self_device_time_total" if args.device == "cuda" else "self_cpu_time_total"
        print(events.table(sort_by=sort, row_limit=22, max_name_column_width=60), flush=True)
        print(events.table(sort_by="self_cpu_time_total", row_limit=12,
                           max_name_column_width=60), flush=True)


def _device_seconds(events: Any) -> float:
    """Seconds of device kernels in a profile, each counted once (as torch's own table
    totals them: the kernels' events, not the ops that launched them, which carry the same
    time again)."""
    from torch.autograd import DeviceType

    return sum(e.self_device_time_total for e in events
               if e.device_type == DeviceType.CUDA and not e.is_user_annotation) / 1e6


def section_scan(args: argparse.Namespace, cache: str) -> None:
    """Steady tokens/s of a pack of K against one trial alone, per WIDTH:K of `--scan`
    (compiles excluded): what `pack: auto` on CUDA (coordinator/packing.py) is chosen from."""
    solo: dict[int, float] = {}
    for item in args.scan:
        if time.perf_counter() - args.started > args.deadline:
            print(f"scan {item}: skipped, past the deadline", flush=True)
            continue
        width, k = (int(v) for v in item.split(":"))
        specs = [spec(width, args.steps, args.device, args.batch, args.seq_len,
                      lr=grid_lr(i, k), seed=i) for i in range(k)]
        if width not in solo:
            torch._dynamo.reset()
            solo[width], _ = steady_tokens_per_s(specs[0], cache)
        torch._dynamo.reset()
        pack_tps, wall, results = packed_steady(specs, cache)
        print(f"width {width}, K={k}: solo {solo[width]:,.0f} tok/s, packed {pack_tps:,.0f} "
              f"tok/s, steady ratio {pack_tps / solo[width]:.2f}x ({wall:.1f} s wall, peak "
              f"memory {_peak_memory_gib(args.device_obj)}, "
              f"{_estimated_gib(specs[0], k, args.device_obj, cache)}); statuses "
              f"{sorted({TrialStatus(r.status).value for r in results})}", flush=True)


def _estimated_gib(s: TrialSpec, k: int, device: torch.device, cache: str) -> str:
    """workers/memory.py's estimate of a pack's peak, which run_trials splits packs by."""
    half = autocasts(device, s.precision)
    need = trial_memory(s, load_trial_data(s, cache).vocab_size, half_activations=half)
    return f"estimated {need.pack_peak(k) / 2**30:.1f} GiB"


def _peak_memory_gib(device: torch.device) -> str:
    if device.type != "cuda":
        return "n/a"
    gib = torch.cuda.max_memory_allocated() / 2**30
    torch.cuda.reset_peak_memory_stats()
    return f"{gib:.1f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--pack-steps", type=int, default=200)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--widths", type=int, nargs="+")
    parser.add_argument("--pack-width", type=int)
    parser.add_argument("--deadline", type=float, default=480.0,
                        help="seconds after which no further section starts")
    parser.add_argument("--only", nargs="+", choices=SECTIONS + EXTRA_SECTIONS,
                        default=list(SECTIONS))
    parser.add_argument("--profile-k", type=int, nargs="+", default=[8])
    parser.add_argument("--scan", nargs="+", default=["256:16", "512:4", "512:8", "1024:4"],
                        help="WIDTH:K packs for the scan section")
    parser.add_argument("--inductor", nargs="+", default=[], metavar="KEY=VALUE",
                        help="torch._inductor.config settings for every compile of the run, "
                             "e.g. max_autotune=True (an experiment: the trainer sets none)")
    args = parser.parse_args()
    import torch._inductor.config as inductor

    for item in args.inductor:
        key, _, value = item.partition("=")
        if not hasattr(inductor, key):
            parser.error(f"--inductor {item}: torch._inductor.config has no {key!r}")
        try:
            setattr(inductor, key, ast.literal_eval(value))
        except (ValueError, SyntaxError):
            parser.error(f"--inductor {item}: {value!r} is no Python literal (True, 3, 'x')")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check on this machine (--device cpu dry-runs it)")
        return
    defaults = CUDA_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS
    args.widths = args.widths or defaults["widths"]
    args.pack_width = args.pack_width or defaults["pack_width"]
    args.batch, args.seq_len = defaults["batch"], defaults["seq_len"]
    args.device_obj = resolve_device(args.device)
    name = torch.cuda.get_device_name() if args.device_obj.type == "cuda" else "CPU"
    peak = peak_flops(args.device_obj)
    print(f"{name}, torch {torch.__version__}, peak bf16 "
          f"{'unknown' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}; "
          f"batch {args.batch} x seq {args.seq_len}, depth 4, {args.steps} steps"
          f"{'; inductor ' + ' '.join(args.inductor) if args.inductor else ''}", flush=True)
    sections: dict[str, Callable[[argparse.Namespace, str], None]] = {
        "mfu": section_mfu, "pack": section_pack, "equivalence": section_equivalence,
        "profile": section_profile, "scan": section_scan}
    started = args.started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hpt-gpu-") as cache:
        for key in args.only:
            elapsed = time.perf_counter() - started
            if elapsed > args.deadline:
                print(f"== {key}: skipped, {elapsed:.0f} s past the {args.deadline:.0f} s "
                      "deadline", flush=True)
                continue
            print(f"== {key} (at {elapsed:.0f} s)", flush=True)
            try:
                sections[key](args, cache)
            except Exception:  # report and go on: the next section is still worth its time
                traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
    print(f"== done in {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
