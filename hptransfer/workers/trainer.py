"""run_trial: train one model for one TrialSpec and return a TrialResult.

Pure torch + the data layer: no database, no HTTP, no MLflow. The coordinator observes
progress through the `reporter` callback (MLflow logging, Optuna pruning).
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from hptransfer.data import TokenDataset, load_dataset
from hptransfer.models.build import BuiltModel, build_from_config
from hptransfer.models.flops import flops_per_token, param_counts
from hptransfer.models.parameterization import optimizer_groups

from .device import autocast, peak_flops, resolve_device
from .trial import TrialResult, TrialSpec

# reporter(metrics) -> True asks the trainer to stop (pruned); metrics has step, tokens,
# train_loss, lr and, at evaluation points, val_loss
Reporter = Callable[[dict[str, Any]], bool | None]

_CURVE_POINTS = 50


def load_trial_data(spec: TrialSpec, cache_dir: str | None = None) -> TokenDataset:
    return load_dataset(spec.data, cache_dir=cache_dir)


@torch.no_grad()
def evaluate(built: BuiltModel, data: TokenDataset, spec: TrialSpec, device: torch.device) -> float:
    """Mean loss over the fixed validation set (identical for every trial of a sweep)."""
    built.model.eval()
    total, count = 0.0, 0
    for x, y in data.val_batches(spec.batch_size, spec.seq_len):
        x, y = x.to(device), y.to(device)
        with autocast(device, spec.precision):
            logits = built.model(x)
        total += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
    built.model.train()
    return total / count


def run_trial(
    spec: TrialSpec | dict,
    reporter: Reporter | None = None,
    cache_dir: str | None = None,
) -> TrialResult:
    """Train `spec` to its budget. Never raises for training problems: the status says."""
    started = time.perf_counter()
    try:
        spec = spec if isinstance(spec, TrialSpec) else TrialSpec.model_validate(spec)
        return _train(spec, reporter, cache_dir, started)
    except Exception as exc:  # a failed trial is a result the coordinator stores
        return TrialResult(
            status="failed",
            error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}",
            wall_time_s=time.perf_counter() - started,
            spec_hash=spec.content_hash() if isinstance(spec, TrialSpec) else None,
        )


def _train(
    spec: TrialSpec, reporter: Reporter | None, cache_dir: str | None, started: float
) -> TrialResult:
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    device = resolve_device(spec.device)
    data = load_trial_data(spec, cache_dir)
    cfg = spec.model_config_obj(vocab_size=data.vocab_size)
    built = build_from_config(cfg, spec.parameterization_obj(), seed=spec.seed, device=device)
    counts = param_counts(cfg)
    tokens_per_step = spec.batch_size * spec.seq_len
    total_steps = spec.budget.steps_for(tokens_per_step, counts.non_embedding)
    flop_breakdown = flops_per_token(cfg, spec.seq_len)
    fpt = flop_breakdown.training
    notes: list[str] = []
    if spec.precision == "bf16" and device.type != "cuda":
        notes.append(f"bf16 autocast is CUDA-only; this trial ran fp32 on {device}")
    warmup = spec.arch != "ngpt"
    if not warmup and spec.schedule.warmup_fraction > 0:
        notes.append("ngpt: warmup disabled (nGPT trains without warmup)")

    groups = optimizer_groups(built.model, built.table)
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(groups, betas=(spec.beta1, spec.beta2), fused=fused)
    eval_every = spec.eval_every or max(1, total_steps // 10)
    curve_every = max(1, total_steps // _CURVE_POINTS)

    curve: list[dict[str, Any]] = []
    initial_loss: float | None = None
    status, val_loss, train_loss = "completed", None, float("nan")
    steps_done = 0
    t_train = time.perf_counter()
    for step in range(total_steps):
        factor = spec.schedule.factor(step, total_steps, warmup=warmup)
        for g in opt.param_groups:
            g["lr"] = g["initial_lr"] * factor
        x, y = data.train_batch(step, spec.batch_size, spec.seq_len, spec.seed)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(device, spec.precision):
            logits = built.model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        train_loss = loss.item()
        initial_loss = train_loss if initial_loss is None else initial_loss
        if not math.isfinite(train_loss) or train_loss > spec.divergence_factor * initial_loss:
            status = "diverged"
            curve.append(_point(step, tokens_per_step, train_loss, factor, spec))
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if spec.grad_clip:
            torch.nn.utils.clip_grad_norm_(built.model.parameters(), spec.grad_clip)
        opt.step()
        built.after_step()
        steps_done = step + 1  # optimizer steps actually taken (tokens and FLOPs spent)

        done = step + 1
        point = None
        if done % curve_every == 0 or done == total_steps:
            point = _point(step, tokens_per_step, train_loss, factor, spec)
        if done % eval_every == 0 or done == total_steps:
            val_loss = evaluate(built, data, spec, device)
            point = point or _point(step, tokens_per_step, train_loss, factor, spec)
            point["val_loss"] = val_loss
            if not math.isfinite(val_loss):
                status = "diverged"
        if point is not None:
            curve.append(point)
            if reporter is not None and reporter(dict(point)) and done < total_steps:
                status = "pruned"
                break
        if status == "diverged":
            break

    tokens = steps_done * tokens_per_step
    train_time = time.perf_counter() - t_train
    tokens_per_s = tokens / train_time if train_time > 0 else 0.0
    peak = peak_flops(device)
    return TrialResult(
        status=status,
        final_val_loss=val_loss if status in ("completed", "pruned") else None,
        final_train_loss=train_loss if math.isfinite(train_loss) else None,
        curve=curve,
        steps=steps_done,
        tokens=tokens,
        flops=fpt * tokens,
        flops_per_token=fpt,
        flops_convention=flop_breakdown.convention,
        params_embedding=counts.embedding,
        params_non_embedding=counts.non_embedding,
        wall_time_s=time.perf_counter() - started,
        tokens_per_s=tokens_per_s,
        mfu=(fpt * tokens_per_s / peak) if peak else None,
        device=str(device),
        param_table=built.table.to_dict(),
        data_hash=data.content_hash,
        spec_hash=spec.content_hash(),
        notes=notes,
    )


def _point(step: int, tokens_per_step: int, loss: float, factor: float, spec: TrialSpec) -> dict:
    return {
        "step": step + 1,
        "tokens": (step + 1) * tokens_per_step,
        "train_loss": loss if math.isfinite(loss) else None,
        "lr": spec.lr * factor,
    }
