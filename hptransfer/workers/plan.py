"""What run_trial and run_trials share: the process settings they start with, a trial's plan
(steps, schedule, curve and evaluation points, FLOPs), its curve points, the divergence rule
and how a TrialResult is assembled.

Both trainers read training losses back from the device only at "sync" steps (curve points,
evaluations and every DIVERGENCE_CHECK_EVERY steps), never every step; the divergence rule is
then applied to the buffered per-step losses in order, so the outcome (status, steps, curve)
is the same as checking after every step.
"""

from __future__ import annotations

import functools
import math
import time
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hptransfer.data import DataError, TokenDataset, load_dataset
from hptransfer.models import FlopBreakdown, ModelConfig, ParamCounts, ParamTable
from hptransfer.models.flops import flops_per_token, param_counts
from hptransfer.spec.trial import TrialResult, TrialSpec, sequences_per_pass

from .device import autocasts, peak_flops
from .host_memory import keep_freed_memory
from .subnormals import flushing_subnormals, set_flush_everywhere

CURVE_POINTS = 50
# at most this many evaluations per trial: each is a curve point (stored with the result, sent
# in listings, logged to MLflow) and a pass over the validation tokens, so a small eval_every
# on a long trial is raised to keep the curve bounded (the trial's notes say so)
MAX_EVALUATIONS = 200
# at most this many optimizer steps between two host reads of the losses (divergence check)
DIVERGENCE_CHECK_EVERY = 32


def prepare_process(spec: TrialSpec) -> None:
    """Settings a trainer applies before anything else: the spec's thread budget (its threads
    flushing subnormals as this one does: subnormals.py), and freed memory kept for the next
    step (host_memory.py)."""
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    set_flush_everywhere(flushing_subnormals())
    keep_freed_memory()


def micro_batches(x: torch.Tensor, y: torch.Tensor, spec: TrialSpec,
                  dim: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
    """(x, y, weight) per micro-batch of at most spec.micro_batch_size sequences along `dim`
    (the last one may be smaller); weight = its share of the batch, so the weighted sum of
    the micro-batches' mean losses is the batch's mean loss. One piece, weight 1.0, when the
    batch fits."""
    size = sequences_per_pass(x.shape[dim], spec.micro_batch_size)
    if size >= x.shape[dim]:
        return [(x, y, 1.0)]
    return [(xs, ys, xs.shape[dim] / x.shape[dim])
            for xs, ys in zip(x.split(size, dim), y.split(size, dim), strict=True)]



def validation_batches(data: TokenDataset,
                       spec: TrialSpec) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The fixed validation windows in passes of at most spec.micro_batch_size sequences (a
    pass of the whole batch would hold activations the micro-batch was set to bound; the
    windows, and so the mean loss, are the same whatever the pass size)."""
    return data.val_batches(sequences_per_pass(spec.batch_size, spec.micro_batch_size),
                            spec.seq_len)

def load_trial_data(spec: TrialSpec, cache_dir: str | None = None,
                    roots: Sequence[str] | None = None,
                    data_hash: str | None = None) -> TokenDataset:
    """The trial's data. A trial of a sweep gets the server's data `roots` (a source that
    left them since submit, say a path swapped for a symlink, is refused here too) and the
    sweep's `data_hash`: data that changed since submit (a shard directory still being
    written) is refused, since the sweep's trials would train and validate on different
    data and its fits would compare them."""
    data = load_dataset(spec.data, cache_dir=cache_dir,
                        roots=None if roots is None else [Path(r) for r in roots])
    if data_hash is not None and data.content_hash != data_hash:
        raise DataError(
            f"the data changed since the sweep was submitted (hash {data_hash[:12]} then, "
            f"{data.content_hash[:12]} now): its trials would not train or validate on the "
            "same data; submit a new sweep once the data is final")
    return data


@dataclass
class TrialPlan:
    """Everything about a trial's run that follows from its spec and data alone."""

    spec: TrialSpec
    data: TokenDataset
    cfg: ModelConfig
    counts: ParamCounts
    flops: FlopBreakdown
    tokens_per_step: int
    total_steps: int
    warmup: bool  # nGPT trains without warmup
    eval_every: int
    curve_every: int
    notes: list[str] = field(default_factory=list)

    @property
    def training_flops(self) -> float:
        """The whole run's training FLOPs (the final count may be lower: a stop ends it)."""
        return self.flops.training * self.tokens_per_step * self.total_steps

    def factor(self, step: int) -> float:
        return self.spec.schedule.factor(step, self.total_steps, warmup=self.warmup)

    def is_curve_step(self, done: int) -> bool:
        return done % self.curve_every == 0 or done == self.total_steps

    def is_eval_step(self, done: int) -> bool:
        return done % self.eval_every == 0 or done == self.total_steps

    def is_sync_step(self, done: int) -> bool:
        """Steps after which losses are read back to the host (nothing is read in between)."""
        return (self.is_curve_step(done) or self.is_eval_step(done)
                or done % DIVERGENCE_CHECK_EVERY == 0)

    def point(self, step: int, loss: float) -> dict[str, Any]:
        """Curve point after optimizer step `step` (0-based) with that step's train loss."""
        return {
            "step": step + 1,
            "tokens": (step + 1) * self.tokens_per_step,
            "train_loss": loss if math.isfinite(loss) else None,
            "lr": self.spec.lr * self.factor(step),
        }

    def diverged(self, loss: float, initial: float) -> bool:
        return not math.isfinite(loss) or loss > self.spec.divergence_factor * initial


def plan_trial(spec: TrialSpec, data: TokenDataset, device: torch.device) -> TrialPlan:
    cfg = spec.model_config_obj(vocab_size=data.vocab_size)
    counts = param_counts(cfg)
    tokens_per_step = spec.batch_size * spec.seq_len
    total_steps = spec.budget.steps_for(tokens_per_step, counts.non_embedding)
    notes: list[str] = []
    if spec.precision == "bf16" and not autocasts(device, spec.precision):
        notes.append(f"bf16 autocast is CUDA-only; this trial ran fp32 on {device}")
    warmup = spec.arch != "ngpt"
    if not warmup and spec.schedule.warmup_fraction > 0:
        notes.append("ngpt: warmup disabled (nGPT trains without warmup)")
    eval_every = spec.eval_every or max(1, total_steps // 10)
    fewest = -(-total_steps // MAX_EVALUATIONS)  # the eval_every that keeps to the cap
    if eval_every < fewest:
        notes.append(f"eval_every raised from {eval_every} to {fewest}: at most "
                     f"{MAX_EVALUATIONS} evaluations in a trial of {total_steps} steps")
        eval_every = fewest
    return TrialPlan(
        spec=spec, data=data, cfg=cfg, counts=counts,
        flops=flops_per_token(cfg, spec.seq_len),
        tokens_per_step=tokens_per_step, total_steps=total_steps, warmup=warmup,
        eval_every=eval_every,
        curve_every=max(1, total_steps // CURVE_POINTS),
        notes=notes,
    )


@dataclass
class Progress:
    """One trial's running outcome, filled in by a trainer as it reads losses back."""

    status: str = "completed"
    steps_done: int = 0  # optimizer steps actually taken (tokens and FLOPs spent)
    initial_loss: float | None = None
    train_loss: float = float("nan")
    val_loss: float | None = None
    curve: list[dict[str, Any]] = field(default_factory=list)

    @property
    def running(self) -> bool:
        return self.status == "completed"

    def absorb(self, plan: TrialPlan, steps: list[int], losses: list[float]) -> None:
        """Apply the divergence rule to buffered (step, loss) pairs in step order."""
        for step, loss in zip(steps, losses, strict=True):
            if not self.running:
                return
            self.train_loss = loss
            self.initial_loss = loss if self.initial_loss is None else self.initial_loss
            if plan.diverged(loss, self.initial_loss):
                self.status = "diverged"
                self.curve.append(plan.point(step, loss))
                return
            self.steps_done = step + 1


def trial_result(plan: TrialPlan, progress: Progress, *, table: ParamTable, device: torch.device,
                 train_time: float, started: float, notes: list[str]) -> TrialResult:
    spec, status = plan.spec, progress.status
    tokens = progress.steps_done * plan.tokens_per_step
    tokens_per_s = tokens / train_time if train_time > 0 else 0.0
    fpt = plan.flops.training
    peak = peak_flops(device)
    return TrialResult(
        status=status,
        final_val_loss=progress.val_loss if status in ("completed", "pruned") else None,
        final_train_loss=progress.train_loss if math.isfinite(progress.train_loss) else None,
        curve=progress.curve,
        steps=progress.steps_done,
        tokens=tokens,
        flops=fpt * tokens,
        flops_per_token=fpt,
        flops_convention=plan.flops.convention,
        params_embedding=plan.counts.embedding,
        params_non_embedding=plan.counts.non_embedding,
        wall_time_s=time.perf_counter() - started,
        tokens_per_s=tokens_per_s,
        mfu=(fpt * tokens_per_s / peak) if peak else None,
        device=str(device),
        param_table=table.to_dict(),
        data_hash=plan.data.content_hash,
        spec_hash=spec.content_hash(),
        notes=plan.notes + notes,
    )


def shown_traceback(exc: BaseException) -> str:
    """`exc`'s traceback as a failed trial shows it, each file named by its import path
    (hptransfer/workers/trainer.py, torch/nn/modules/module.py) instead of where this
    machine installed it: the server's layout stays out of API responses."""
    shown = traceback.TracebackException.from_exception(exc)
    pending, seen = [shown], set()
    while pending:  # the exception and every one it was raised from or during
        tb = pending.pop()
        if id(tb) in seen:
            continue
        seen.add(id(tb))
        for frame in tb.stack:
            frame.filename = _import_path(frame.filename)
        pending += [t for t in (tb.__cause__, tb.__context__) if t is not None]
    return "".join(shown.format())


@functools.lru_cache(maxsize=256)
def _import_path(filename: str) -> str:
    """The file's path from the top of its package (the first folder up without an
    __init__.py), or its bare name."""
    path = Path(filename)
    top = path.parent
    while (top / "__init__.py").is_file() and top.parent != top:
        top = top.parent
    return str(path.relative_to(top)) if path.is_absolute() else path.name


def failed_result(spec: Any, exc: BaseException, started: float,
                  curve: list[dict[str, Any]] | None = None) -> TrialResult:
    """A failed trial is a result the coordinator stores, not an exception; with the curve
    it had reported before it failed (so the app DB holds what MLflow showed live)."""
    return TrialResult(
        status="failed",
        error=f"{type(exc).__name__}: {exc}\n{shown_traceback(exc)}",
        wall_time_s=time.perf_counter() - started,
        spec_hash=spec.content_hash() if isinstance(spec, TrialSpec) else None,
        curve=list(curve or []),
    )
