"""A trial's outcome: its running progress as a trainer reads losses back (the divergence
rule), and the TrialResult it ends with, completed (with its MFU) or failed."""

from __future__ import annotations

import functools
import math
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hptransfer.models import ParamTable
from hptransfer.spec.trial import TrialResult, TrialSpec

from .peaks import peak_of
from .plan import TrialPlan


@dataclass
class Progress:
    """One trial's running outcome, filled in by a trainer as it reads losses back."""

    status: str = "completed"
    steps_done: int = 0  # optimizer steps actually taken (tokens and FLOPs spent)
    initial_loss: float | None = None
    train_loss: float = float("nan")
    val_loss: float | None = None
    curve: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None  # why a trial stopped failed without an exception

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

    def stop_past_ceiling(self, plan: TrialPlan, step: int, max_hours: float) -> None:
        """Stop failed at `step` (0-based, done) for training past the server's wall-time
        ceiling, the curve ending where it got."""
        self.status = "failed"
        self.error = (f"stopped after step {step + 1} of {plan.total_steps}: trained past "
                      f"the server's HPT_MAX_TRIAL_HOURS={max_hours:g}")
        point = plan.point(step, self.train_loss)
        if not self.curve or self.curve[-1]["step"] != point["step"]:  # not twice a step
            self.curve.append(point)


def trial_result(plan: TrialPlan, progress: Progress, *, table: ParamTable,
                 train_time: float, started: float, notes: list[str],
                 resumed_from: int | None = None, retrained: int = 0,
                 workers: int = 1) -> TrialResult:
    spec, status = plan.spec, progress.status
    tokens = progress.steps_done * plan.tokens_per_step
    # this attempt's speed: the steps it trained itself (from the checkpoint on)
    trained_here = (progress.steps_done - (resumed_from or 0)) * plan.tokens_per_step
    tokens_per_s = trained_here / train_time if train_time > 0 else 0.0
    fpt = plan.flops.training
    peak = peak_flops(plan.device)
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
        device=str(plan.device),
        param_table=table.to_dict(),
        data_hash=plan.data.content_hash,
        spec_hash=spec.content_hash(),
        notes=plan.notes + notes,
        error=progress.error,
        resumed_from_step=resumed_from,
        retrained_tokens=retrained * plan.tokens_per_step,
        workers=workers,
    )


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


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return peak_of(torch.cuda.get_device_name(device))
