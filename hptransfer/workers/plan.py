"""A trial's run plan: everything about its run that follows from its spec and data, resolved
once before training starts (device, threads, precision, batch and micro-batch, steps, LR
schedule, curve and evaluation points, FLOPs), plus the process settings and the data load
that come before it. run_trial and every member of a run_trials pack read one each.

Both trainers read training losses back from the device only at "sync" steps (curve points,
evaluations and every DIVERGENCE_CHECK_EVERY steps), never every step; the divergence rule is
then applied to the buffered per-step losses in order (outcome.Progress), so the outcome
(status, steps, curve) is the same as checking after every step.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hptransfer.data import DataError, TokenDataset, load_dataset
from hptransfer.models import FlopBreakdown, ModelConfig, ParamCounts
from hptransfer.models.flops import flops_per_token, param_counts
from hptransfer.spec.trial import TrialSpec, sequences_per_pass

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


def resolve_device(requested: str) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but no CUDA device is visible to this worker")
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def autocasts(device: torch.device, precision: str) -> bool:
    """Whether a run asking for `precision` autocasts to bf16 on `device`: on CUDA only; on
    the CPU fp32 is both faster and the reference."""
    return precision == "bf16" and device.type == "cuda"


@dataclass
class TrialPlan:
    """How one trial runs, resolved once from its spec and data (plan_trial)."""

    spec: TrialSpec
    data: TokenDataset
    device: torch.device
    threads: int | None  # the spec's thread budget, set by prepare_process (None: torch's)
    bf16: bool  # whether the model runs under bf16 autocast (CUDA only)
    batch_size: int  # sequences per optimizer step
    pass_size: int  # sequences per forward/backward pass (the micro-batch)
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
        """LR multiplier of optimizer step `step` (0-based): the spec's schedule."""
        return self.spec.schedule.factor(step, self.total_steps, warmup=self.warmup)

    def factors(self, steps: int) -> list[float]:
        """`factor(step)` of steps 0 .. `steps` - 1, in one pass (Schedule.factors)."""
        return self.spec.schedule.factors(self.total_steps, warmup=self.warmup, stop=steps)

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

    def micro_batches(self, x: torch.Tensor, y: torch.Tensor,
                      dim: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
        """(x, y, weight) per micro-batch of at most pass_size sequences along `dim` (the
        last one may be smaller); weight = its share of the batch, so the weighted sum of the
        micro-batches' mean losses is the batch's mean loss. One piece, weight 1.0, when the
        batch fits."""
        size = min(self.pass_size, x.shape[dim])
        if size >= x.shape[dim]:
            return [(x, y, 1.0)]
        return [(xs, ys, xs.shape[dim] / x.shape[dim])
                for xs, ys in zip(x.split(size, dim), y.split(size, dim), strict=True)]

    def validation_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The fixed validation windows in passes of at most pass_size sequences (a pass of
        the whole batch would hold activations the micro-batch was set to bound; the windows,
        and so the mean loss, are the same whatever the pass size)."""
        return self.data.val_batches(self.pass_size, self.spec.seq_len)


# trained tokens above this multiple of the budget's (whole steps round it up) get a note
ROUNDING_NOTED = 1.1


def plan_trial(spec: TrialSpec, data: TokenDataset) -> TrialPlan:
    """The plan of `spec` on `data`; raises if its device is not there."""
    device = resolve_device(spec.device)
    cfg = spec.model_config_obj(vocab_size=data.vocab_size)
    counts = param_counts(cfg)
    tokens_per_step = spec.batch_size * spec.seq_len
    total_steps = spec.budget.steps_for(tokens_per_step, counts.non_embedding)
    notes: list[str] = []
    trained = total_steps * tokens_per_step
    asked = spec.budget.tokens_for(counts.non_embedding)
    if asked is not None and trained > ROUNDING_NOTED * asked:
        notes.append(f"the budget of {asked:,.0f} tokens is trained as {total_steps} whole "
                     f"step(s) of {tokens_per_step:,} tokens: {trained:,} tokens")
    bf16 = autocasts(device, spec.precision)
    if spec.precision == "bf16" and not bf16:
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
        spec=spec, data=data, device=device, threads=spec.num_threads, bf16=bf16,
        batch_size=spec.batch_size,
        pass_size=sequences_per_pass(spec.batch_size, spec.micro_batch_size),
        cfg=cfg, counts=counts, flops=flops_per_token(cfg, spec.seq_len),
        tokens_per_step=tokens_per_step, total_steps=total_steps, warmup=warmup,
        eval_every=eval_every, curve_every=max(1, total_steps // CURVE_POINTS), notes=notes,
    )
