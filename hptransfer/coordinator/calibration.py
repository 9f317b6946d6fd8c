"""How fast trials run on this cluster: the throughput a plan (`pricing.py`) prices with.

A trial of `steps` optimizer steps of `passes` forward/backward passes each, at depth L,
training F FLOPs on one worker, takes

    seconds = overhead_s + steps x passes x L x layer_pass_s + F / flops_per_s

(a fixed cost per trial: building the model, loading its data, evaluating; a cost per layer
and pass that no FLOP count sees: kernel launches, the optimizer's per-tensor work, Python;
and the FLOPs at the achieved rate). On W data-parallel workers the compute divides by
W x DDP_EFFICIENCY. The three coefficients come from, in order:

1. ``store``: the completed trials this cluster trained (not reused, not packed) on the same
   kind of device with the sweep's threads, sequence length and head size, fitted by
   non-negative least squares when there are MIN_TRIALS of them;
2. ``micro-run``: a few short trials of the sweep's own settings on this host's CPU
   (CPU sweeps only), measured once and cached under $HPT_HOME/calibration;
3. ``peak x MFU``: the GPU's peak bf16 FLOP/s (by its Ray accelerator type, else assumed
   ASSUMED_GPU) at DEFAULT_MFU (GPU sweeps with nothing measured).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hptransfer.redaction import first_line
from hptransfer.spec import SpecError, SweepSpec
from hptransfer.spec.trial import MAX_DIVERGENCE_FACTOR, TrialSpec, sequences_per_pass
from hptransfer.workers.peaks import PEAK_BF16

MIN_TRIALS = 8  # completed trials a store fit needs (3 coefficients, and some to spare)
STORE_TRIALS = 500  # the most recent completed trials read for a fit
DEFAULT_MFU = 0.35  # a dense GPT at these sizes, bf16, compiled: 0.3-0.45 where measured
ASSUMED_GPU = "H100"  # priced against when the cluster names no GPU
DDP_EFFICIENCY = 0.9  # data-parallel compute per worker against one process (not measured)
MICRO_STEPS = 24  # optimizer steps of each micro-run trial
CACHE_DAYS = 7.0  # a micro-run older than this is measured again
# a step costs the same at any LR; a small one keeps a timing trial from diverging (and
# stopping early) where the sweep's own LRs would
TIMING_LR = 2.0**-12


@dataclass(frozen=True)
class Throughput:
    """Seconds per trial on one worker (module docstring), and where the figures came from."""

    device: str  # "cpu" or "gpu"
    source: str  # "store", "micro-run" or "peak x MFU"
    detail: str  # the source in words, for the plan's output
    flops_per_s: float
    layer_pass_s: float = 0.0
    overhead_s: float = 0.0

    def seconds(self, flops: float, steps: int, passes: int, depth: int,
                workers: int = 1) -> float:
        """One trial's wall time on `workers` data-parallel workers."""
        rate = self.flops_per_s * (workers * DDP_EFFICIENCY if workers > 1 else 1.0)
        return self.overhead_s + steps * passes * depth * self.layer_pass_s + flops / rate

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def passes_per_step(batch_size: int, micro_batch_size: int | None, workers: int = 1) -> int:
    """Forward/backward passes one worker makes per optimizer step (micro-batches of its
    rows of the batch)."""
    rows = math.ceil(batch_size / workers)
    return math.ceil(rows / sequences_per_pass(rows, micro_batch_size))


def fit(rows: list[tuple[float, float, float]]) -> tuple[float, float, float] | None:
    """(overhead_s, layer_pass_s, flops_per_s) from (seconds, steps x passes x depth, FLOPs)
    per trial, by non-negative least squares weighted by 1/seconds (each trial's relative
    error counts alike, so the many short trials do not lose to the few long ones); None
    when the FLOPs get no positive rate."""
    from scipy.optimize import nnls

    y = np.array([r[0] for r in rows], dtype=float)
    x = np.array([[1.0, r[1], r[2]] for r in rows], dtype=float)
    scale = x.max(axis=0)
    scale[scale == 0] = 1.0
    w = 1.0 / y
    coef, _ = nnls((x / scale) * w[:, None], y * w)
    coef = coef / scale
    if coef[2] <= 0:
        return None
    return float(coef[0]), float(coef[1]), float(1.0 / coef[2])


def settings_key(spec: SweepSpec, device: str) -> dict[str, Any]:
    """What a measurement must share with the sweep to price it: the device kind, the
    torch threads of a task, the sequence length, head size and precision."""
    f = spec.fixed
    return {"device": device, "threads": spec.resources.threads, "seq_len": f.seq_len,
            "head_dim": f.head_dim, "precision": f.precision if device == "gpu" else "fp32"}


def from_store(store: Any, spec: SweepSpec, device: str) -> Throughput | None:
    """A fit to the completed trials this cluster trained with the sweep's settings."""
    from sqlalchemy import select

    from hptransfer.store.schema import Trial

    key = settings_key(spec, device)
    stmt = (select(Trial.spec, Trial.result, Trial.wall_time_s, Trial.flops)
            .where(Trial.status == "completed", Trial.reused_from.is_(None),
                   Trial.wall_time_s > 0, Trial.flops > 0)
            .order_by(Trial.finished_at.desc()).limit(STORE_TRIALS))
    rows = []
    with store.engine.connect() as conn:
        for trial_spec, result, seconds, flops in conn.execute(stmt):
            result = result or {}
            if any(n.startswith("trained packed") for n in result.get("notes") or []):
                continue  # a pack's members share its time: not one trial's
            kind = "gpu" if str(result.get("device", "cpu")).startswith("cuda") else "cpu"
            try:
                trial = TrialSpec.model_validate(trial_spec)
            except ValueError:
                continue  # a row of an older schema
            workers = int(result.get("workers") or 1)
            seen = {"device": kind, "threads": trial.num_threads, "seq_len": trial.seq_len,
                    "head_dim": trial.head_dim,
                    "precision": trial.precision if kind == "gpu" else "fp32"}
            if seen != key:
                continue
            steps = int(result.get("steps") or 0)
            passes = passes_per_step(trial.batch_size, trial.micro_batch_size, workers)
            layer_passes = steps * passes * trial.depth
            eff = workers * DDP_EFFICIENCY if workers > 1 else 1.0
            rows.append((float(seconds), float(layer_passes), float(flops) / eff))
    if len(rows) < MIN_TRIALS:
        return None
    coefficients = fit(rows)
    if coefficients is None:
        return None
    overhead, layer, rate = coefficients
    return Throughput(device, "store", f"fitted to {len(rows)} completed trials on this "
                      f"cluster ({_described(key)})", rate, layer, overhead)


def peak_throughput(gpu: str | None, mfu: float = DEFAULT_MFU) -> Throughput:
    """The GPU's peak bf16 FLOP/s at `mfu` (ASSUMED_GPU when `gpu` is unknown)."""
    name = gpu if gpu in PEAK_BF16 else ASSUMED_GPU
    said = name if gpu == name else f"{name} (assumed: the cluster names no GPU type)"
    peak = PEAK_BF16[name]
    return Throughput("gpu", "peak x MFU", f"nothing measured yet: {said} peak "
                      f"{peak / 1e12:.0f} TFLOP/s bf16 x MFU {mfu:g}", peak * mfu)


MICRO_STEP_FLOPS = 4e9  # the largest shape a micro-run times: ~0.1-0.2 s a step on a core
# the costliest filler it times where the sweep's own shapes are all too costly (a filler is
# already as small as the settings allow): ~1-2 s a step on a core, so up to a few minutes
# for the 7 timed trials (a client's 60 s wait may give up first; the next plan is cached)
MAX_FILLER_STEP_FLOPS = 10 * MICRO_STEP_FLOPS


def micro_shapes(spec: SweepSpec) -> list[tuple[int, int]]:
    """Up to four of the sweep's own shapes cheap enough to time (at most MICRO_STEP_FLOPS
    a step): the cheapest, the costliest, the deepest and the widest, so that the fit
    interpolates where the sweep trains; small shapes at its head size and its shallowest
    depth fill in where fewer than three are cheap enough (a large sweep on a CPU), if the
    sweep's settings allow them (a batch rule, value embeddings) and each step costs at
    most MAX_FILLER_STEP_FLOPS.
    A sweep none of whose shapes can be timed is a SpecError."""
    from .admission import stage_shapes

    own = list(dict.fromkeys((s.width, s.depth) for s in stage_shapes(spec)))
    cheap = {shape: step for shape in own
             if (step := _step_flops(spec, *shape)) is not None and step <= MICRO_STEP_FLOPS}
    picks = [min(cheap, key=cheap.__getitem__), max(cheap, key=cheap.__getitem__),
             max(cheap, key=lambda k: (k[1], -k[0])),
             max(cheap, key=lambda k: (k[0], -k[1]))] if cheap else []
    h, d0 = spec.fixed.head_dim, min(depth for _, depth in own)
    shapes = list(dict.fromkeys(picks))
    for filler in [(h, d0), (h, d0 + 5), (4 * h, d0)]:
        if len(shapes) >= 3:
            break
        step = _step_flops(spec, *filler)
        if filler not in shapes and step is not None and step <= MAX_FILLER_STEP_FLOPS:
            shapes.append(filler)
    if not shapes:
        raise SpecError([{"field": "grid", "message": (
            f"no shape of this sweep can be timed on this host's CPU to price it: a step of "
            f"each of its shapes costs more than {MICRO_STEP_FLOPS:g} FLOPs, and the small "
            f"shapes at its head size ({h}) either cost more than {MAX_FILLER_STEP_FLOPS:g} "
            "or are refused by its settings (batch rule, arm options); give it smaller shapes "
            "or batches, or price it as a GPU sweep (fixed.device: cuda and resources.gpus)")}])
    return shapes


def _step_flops(spec: SweepSpec, width: int, depth: int) -> float | None:
    """Training FLOPs of one optimizer step of the sweep's first arm at width x depth (the
    sweep's own count, `SweepSpec.trial_flops`, of a one-step trial), or None where its
    settings refuse that shape (its trial spec does not validate)."""
    from hptransfer.spec.trial import Budget

    try:
        trial = spec.trial_spec(spec.arms[0], width, depth, spec.grid.lr_values()[0],
                                spec.grid.sigma_bases[0], spec.grid.seeds[0])
    except ValueError:  # pydantic's ValidationError: e.g. a batch rule's batch out of bounds
        return None
    return spec.trial_flops(trial.model_copy(update={"budget": Budget(steps=1)}))


def micro_run(spec: SweepSpec, home: Path, refresh: bool = False) -> Throughput:
    """A few short trials of the sweep's settings on this host's CPU (MICRO_STEPS steps
    each, at `micro_shapes`), fitted; cached under `home`/calibration by settings and host
    for CACHE_DAYS."""
    # what the timed trials train: the first arm's architecture (its per-layer cost) and
    # each shape's batch (the batch rule)
    arm = spec.arms[0]
    key = settings_key(spec, "cpu") | {"threads": micro_threads(spec),
                                       "host": platform.node(), "cpus": os.cpu_count(),
                                       "batch": spec.budget.batch_size,
                                       "batch_rule": spec.budget.batch_rule,
                                       "batch_exponent": spec.budget.batch_exponent,
                                       "base_shape": [spec.fixed.base_width,
                                                      spec.fixed.base_depth],
                                       "micro_batch": spec.fixed.micro_batch_size,
                                       "arch": arm.arch,
                                       "arch_options": arm.arch_options.model_dump(mode="json")}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = home / "calibration" / f"cpu-{digest}.json"
    if not refresh and path.is_file():
        try:
            cached = json.loads(path.read_text())
            if time.time() - cached["measured_at"] < CACHE_DAYS * 86400:
                return Throughput(**cached["throughput"])
        except (ValueError, KeyError, TypeError):
            pass  # unreadable: measured again
    shapes = micro_shapes(spec)
    _time_one(spec, *shapes[0])  # a process's first trial pays its warm-up: not timed
    # the faster of two runs of each: a shared host's noise only ever slows one down
    rows = [min(_time_one(spec, w, d), _time_one(spec, w, d)) for w, d in shapes]
    coefficients = fit(rows)
    if coefficients is None:  # noise hid the FLOPs' share: their rate over all the time
        coefficients = (0.0, 0.0, sum(r[2] for r in rows) / sum(r[0] for r in rows))
    overhead, layer, rate = coefficients
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime())
    result = Throughput("cpu", "micro-run", f"a micro-run of {len(rows)} short trials on this "
                        f"host's CPU ({_described(key)}; measured {when}, cached)",
                        rate, layer, overhead)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"measured_at": time.time(), "key": key, "rows": rows,
                               "throughput": result.to_dict()}))
    tmp.replace(path)
    return result


def micro_threads(spec: SweepSpec) -> int:
    """The torch threads a micro-run trial gets: a task's, at most this host's cores (more
    would time their contention, not the sweep's steps, and take minutes)."""
    return max(1, min(spec.resources.threads, os.cpu_count() or 1))


def _time_one(spec: SweepSpec, width: int, depth: int) -> tuple[float, float, float]:
    """(seconds, steps x passes x depth, FLOPs) of one short trial of the sweep's settings
    (the first arm, the embedded corpus at the byte tokenizer)."""
    from hptransfer.spec.trial import Budget
    from hptransfer.workers.trainer import run_trial

    arm = spec.arms[0]
    lr = min(TIMING_LR, *spec.grid.lr_values())
    trial = spec.trial_spec(arm, width, depth, lr, spec.grid.sigma_bases[0], spec.grid.seeds[0])
    trial = trial.model_copy(update={
        "budget": Budget(steps=MICRO_STEPS), "device": "cpu", "eval_every": 10**6,
        "num_threads": micro_threads(spec),
        # a timing trial runs its steps whatever its loss does (a tight divergence_factor
        # would stop it early, as a diverging LR would)
        "divergence_factor": MAX_DIVERGENCE_FACTOR,
        "data": trial.data.model_copy(update={"source": "stdlib", "tokenizer": "byte",
                                              "vocab_size": None})})
    result = run_trial(trial)
    if result.status != "completed":  # the sweep's trials would not train either: a 422
        raise SpecError([{"field": "arms", "message": (
            f"the micro-run that prices this sweep could not train its first arm at "
            f"{width}x{depth} for {MICRO_STEPS} steps at lr {lr:g} ({result.status}: "
            f"{first_line(result.error)[:300] or 'no error given'}); its trials would fail "
            "alike")}])
    layer_passes = result.steps * passes_per_step(trial.batch_size, trial.micro_batch_size) * depth
    return result.wall_time_s, float(layer_passes), result.flops


def _described(key: dict[str, Any]) -> str:
    return (f"{key['device'].upper()}, {key['threads']} thread"
            f"{'s' if key['threads'] != 1 else ''}, seq_len {key['seq_len']}, head_dim "
            f"{key['head_dim']}")
