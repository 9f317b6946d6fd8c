"""run_trial: train one model for one TrialSpec and return a TrialResult, read top to bottom:
the run plan (process settings, data, plan.py), the model and optimizer, the training loop
(step, clipping, schedule, progress and pruning, evaluations), the final evaluation and the
result. run_trials, the packed variant for K specs of one shape, lives in packed.py.

Pure torch + the data layer: no database, no HTTP, no MLflow. The coordinator observes
progress through the `reporter` callback (MLflow logging, Optuna pruning).

Device work is never waited on per step: losses stay on the device and are read back in
one transfer at sync steps (plan.py), where divergence is checked for every buffered step.
On CUDA the model runs under torch.compile (eager fallback with a note), bf16 autocast when
the spec asks for it, and fused AdamW; on the CPU, FlatAdamW (flat_adamw.py): foreach
AdamW's numbers to the bit, a few ops per parameter group rather than per parameter.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from hptransfer.models.build import build_from_config
from hptransfer.models.ngpt import NGPT
from hptransfer.models.parameterization import optimizer_groups
from hptransfer.spec.trial import TrialResult, TrialSpec

from .checkpoints import CheckpointPolicy, TrialCheckpoints
from .compiling import Compiled, eager_if_backward_fails
from .data_parallel import DataParallel
from .device import autocast, reading_back_is_free, to_device
from .outcome import Progress, failed_result, trial_result
from .plan import TrialPlan, load_trial_data, plan_trial, prepare_process
from .preemption import Preempted, preemption
from .sharding import (
    clip_sharded,
    evaluate_sharded,
    from_rank0,
    gather_state,
    normalize_sharded,
    passes_per_step,
    scatter_state,
    sharded_optimizer,
)
from .sharding import micro_batches as sharded_micro_batches
from .subnormals import subnormals_flushed
from .trial_state import lone_optimizer, resume_checkpoint, resume_from, trial_state

# reporter(metrics) -> True asks the trainer to stop (pruned); metrics has step, tokens,
# train_loss, lr and, at evaluation points, val_loss
Reporter = Callable[[dict[str, Any]], bool | None]

__all__ = ["Reporter", "evaluate", "run_trial"]


@subnormals_flushed()
def run_trial(
    spec: TrialSpec | dict,
    reporter: Reporter | None = None,
    cache_dir: str | None = None,
    roots: Sequence[str] | None = None,
    data_hash: str | None = None,
    checkpoints: CheckpointPolicy | None = None,
    parallel: DataParallel | None = None,
    max_hours: float | None = None,
) -> TrialResult:
    """Train `spec` to its budget. Never raises for training problems: the status says.
    `roots`, `data_hash`: a sweep's data guard (plan.load_trial_data). `checkpoints`: where
    and how often to checkpoint, and resume from the latest one (checkpoints.py).
    `parallel`: this process's rank of a data-parallel trial (data_parallel.py).
    `max_hours`: the server's wall-time ceiling (HPT_MAX_TRIAL_HOURS): an attempt still
    training after it stops there, failed, saying so."""
    started = time.perf_counter()
    progress = Progress()
    try:
        spec = spec if isinstance(spec, TrialSpec) else TrialSpec.model_validate(spec)
        prepare_process(spec)  # threads, subnormals, malloc: before anything is allocated
        data = load_trial_data(spec, cache_dir, roots, data_hash)
        plan = plan_trial(spec, data)  # device, precision, batches, steps, eval points
        return _train(plan, reporter, progress, started, checkpoints, parallel, max_hours)
    except Exception as exc:
        return failed_result(spec, exc, started, progress.curve)


def _train(plan: TrialPlan, reporter: Reporter | None, progress: Progress, started: float,
           policy: CheckpointPolicy | None = None, parallel: DataParallel | None = None,
           max_hours: float | None = None) -> TrialResult:
    """Build the model and its optimizer (from the latest checkpoint, if any), train them
    to the plan's end (or a stop), and return the result."""
    spec, data, device = plan.spec, plan.data, plan.device
    leads = parallel is None or parallel.leads
    sharded = parallel is not None and parallel.shard
    # ---- model and optimizer
    # a sharded model is built on the CPU: only its shards go to the device (sharding.py)
    built = build_from_config(plan.cfg, spec.parameterization_obj(), seed=spec.seed,
                              device=torch.device("cpu") if sharded else device)
    betas = (spec.beta1, spec.beta2)
    notes: list[str] = []
    checkpoints = TrialCheckpoints(policy, notes) if policy is not None else None
    if sharded:
        # sharded first: the optimizer steps the shards (AdamW over DTensors)
        trained = parallel.wrap(built.model, device)
        notes.append(f"the model is sharded over the {parallel.world} workers (FSDP)")
        opt = sharded_optimizer(optimizer_groups(built.model, built.table), betas, device)
        resume, retrained = _resume_sharded(checkpoints, parallel, built.model, opt,
                                            progress, notes)
        model: Any = trained  # eager: torch.compile around FSDP's hooks is not tried
    else:
        opt = lone_optimizer(optimizer_groups(built.model, built.table), betas, device)
        resume, retrained = resume_checkpoint(checkpoints, built.model, opt, progress, notes)
        # the optimizer first: FlatAdamW re-points the parameters, DDP then registers them
        trained = built.model if parallel is None else parallel.wrap(built.model, device)
        model = Compiled(trained, device, notes, "model", work_flops=plan.training_flops)
    params = list(built.model.parameters())
    rows = None if parallel is None else parallel.rows(plan.batch_size)
    share = 1.0 if parallel is None else parallel.share(plan.batch_size)
    passes = (passes_per_step(plan.batch_size, plan.pass_size, parallel.world)
              if sharded else 0)

    def gradients(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """A step's loss, its gradient accumulated over micro-batches in .grad (a data-
        parallel rank's weighted so that DDP's average is the global batch's)."""
        opt.zero_grad(set_to_none=True)
        loss = torch.zeros((), device=device)
        pieces = (sharded_micro_batches(x, y, passes) if sharded
                  else plan.micro_batches(x, y))
        for i, (xs, ys, weight) in enumerate(pieces):
            # DDP all-reduces once per step, with the last micro-batch's backward
            with _no_sync(trained, i < len(pieces) - 1), autocast(device, plan.bf16):
                logits = model(xs)
            if not weight:  # a sharded rank's empty pass: its collectives, no loss
                (logits.float().sum() * 0.0).backward()
                continue
            part = F.cross_entropy(logits.float().flatten(0, 1), ys.flatten())
            if weight * share != 1.0:
                part = part * (weight * share)
            with _no_sync(trained, i < len(pieces) - 1):
                part.backward()
            loss += part.detach()
        return loss

    def record(step: int, evaluating: bool) -> None:
        """The curve point after `step`, with the validation loss where `evaluating`; the
        reporter hears it and may stop the trial (pruned) before its last step. With data
        parallelism rank 0 evaluates and decides, and every rank takes its answer."""
        point = plan.point(step, progress.train_loss)
        if evaluating:
            if sharded:  # a sharded forward all-gathers on every rank: all evaluate
                built.model.eval()
                progress.val_loss = evaluate_sharded(built.model, plan, parallel.rank,
                                                    parallel.world)
                built.model.train()
            elif leads:
                built.model.eval()
                progress.val_loss = evaluate(built.model if parallel else model, plan)
                built.model.train()
            if parallel is not None:
                progress.val_loss = parallel.from_leader(
                    [progress.val_loss if leads else math.nan], device)[0]
            point["val_loss"] = progress.val_loss
            if not math.isfinite(progress.val_loss):
                progress.status = "diverged"
        progress.curve.append(point)
        stop = leads and reporter is not None and bool(reporter(dict(point)))
        if parallel is not None:
            stop = bool(parallel.from_leader([float(stop)], device)[0])
        if stop and progress.running and step + 1 < plan.total_steps:
            progress.status = "pruned"

    # ---- the loop: losses stay on the device until a sync step reads them back at once
    pending_steps: list[int] = []
    pending_losses: list[torch.Tensor] = []
    t_train = time.perf_counter()
    with preemption() as preempted:
        for step in range(resume, plan.total_steps):
            factor = plan.factor(step)
            for g in opt.param_groups:
                g["lr"] = g["initial_lr"] * factor
            x, y = data.train_batch(step, plan.batch_size, spec.seq_len, spec.seed, rows)
            x, y = to_device(x, device), to_device(y, device)
            loss = (gradients(x, y) if sharded
                    else eager_if_backward_fails(model, gradients, x, y))
            if spec.grad_clip:
                (clip_sharded if sharded else clip_gradients)(params, spec.grad_clip)
            opt.step()
            if sharded and isinstance(built.model, NGPT):
                normalize_sharded(built.model)
            else:
                built.after_step()
            pending_steps.append(step)
            pending_losses.append(loss)

            done = step + 1
            # a SIGTERM reaches one rank; sharded ranks stop (and checkpoint) together
            stopping = parallel.any_rank(preempted(), device) if sharded else preempted()
            checkpoint_due = checkpoints is not None and checkpoints.step_is_due(done)
            if not (plan.is_sync_step(done) or checkpoint_due or stopping):
                continue
            # one device->host transfer for every step since the last sync; a diverged step
            # ends the trial there (later steps' updates are discarded with the model)
            losses = torch.stack(pending_losses)
            if parallel is not None:
                losses = parallel.mean_losses(losses)
            progress.absorb(plan, pending_steps, losses.tolist())
            pending_steps, pending_losses = [], []
            if not progress.running or done == plan.total_steps:
                break  # the last step's point comes with the final evaluation, below
            if checkpoints is not None and leads:
                checkpoints.mark_reached(done)
            if max_hours is not None and _past(started, max_hours, parallel, device):
                progress.stop_past_ceiling(plan, step, max_hours)
                break
            if plan.is_curve_step(done) or plan.is_eval_step(done):
                record(step, evaluating=plan.is_eval_step(done))
                if not progress.running:
                    break
            if checkpoints is not None and sharded:
                # rank 0's clock decides; every rank gathers its shards for rank 0 to write
                due = parallel.from_leader([float(leads and checkpoints.due(done))], device)
                if due[0] or stopping:
                    weights = gather_state(built.model, opt)
                    if leads:
                        checkpoints.save(done, trial_state(done, built.model, opt, progress,
                                                      weights))
            elif checkpoints is not None and leads:
                if checkpoints.due(done) or stopping:
                    checkpoints.save(done, trial_state(done, built.model, opt, progress))
            if stopping:
                raise Preempted(f"stopped by SIGTERM after step {done}, checkpointed")

    # ---- the final evaluation, unless the trial stopped early
    if progress.running:
        record(plan.total_steps - 1, evaluating=True)
    if checkpoints is not None and leads:
        checkpoints.finish()
    return trial_result(plan, progress, table=built.table,
                        train_time=time.perf_counter() - t_train, started=started,
                        notes=notes, resumed_from=resume or None, retrained=retrained,
                        workers=1 if parallel is None else parallel.world)


def _past(started: float, max_hours: float, parallel: DataParallel | None,
          device: torch.device) -> bool:
    """Whether the attempt has trained past `max_hours` (rank 0's clock decides for all)."""
    past = time.perf_counter() - started > max_hours * 3600.0
    if parallel is not None:
        past = bool(parallel.from_leader([float(past)], device)[0])
    return past


def _no_sync(model: torch.nn.Module, skip: bool) -> contextlib.AbstractContextManager:
    """DDP's no_sync() for a micro-batch whose gradient is not yet the step's whole. A
    sharded model reduce-scatters every micro-batch's gradients into the shards' .grad:
    its no_sync (set_requires_gradient_sync(False)) would keep every parameter's whole
    gradient on every rank until the last one, 4 bytes a parameter that FSDP is there to
    spread."""
    if not skip or hasattr(model, "set_requires_gradient_sync"):
        return contextlib.nullcontext()
    return model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()


def _resume_sharded(checkpoints: TrialCheckpoints | None, parallel: DataParallel,
                    model: torch.nn.Module, opt: Any, progress: Progress,
                    notes: list[str]) -> tuple[int, int]:
    """resume_checkpoint for a sharded model: rank 0 reads the latest checkpoint and scatters its
    weights and optimizer state to the shards; every rank takes the rest of it."""
    found = checkpoints.latest() if checkpoints is not None and parallel.leads else None
    state = found[1] if found is not None else {}
    rest = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
    if found is not None:
        rest["reached"] = checkpoints.reached()
    rest = from_rank0(rest if found is not None else None)
    if rest is None:
        return 0, 0
    scatter_state(model, opt, state.get("model", {}), state.get("optimizer", {}))
    return resume_from(rest["steps_done"], rest, rest["reached"], progress, notes)


@torch.no_grad()
def evaluate(forward: Callable[[torch.Tensor], torch.Tensor], plan: TrialPlan) -> float:
    """Mean loss over the fixed validation set (identical for every trial of a sweep)."""
    device = plan.device
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    for x, y in plan.validation_batches():
        x, y = to_device(x, device), to_device(y, device)
        with autocast(device, plan.bf16):
            logits = forward(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
        total += loss.double()  # the sum in float64, as when it was added up on the host
        count += y.numel()
    return total.item() / count


def clip_gradients(params: list[torch.nn.Parameter], max_norm: float) -> None:
    """torch.nn.utils.clip_grad_norm_(params, max_norm) to the bit. It scales every gradient
    by clamp(max_norm / (norm + 1e-6), max=1.0) even when that is 1.0, a pass over all of
    them that changes nothing (x * 1.0 is x); on the CPU, where reading the factor back waits
    for nothing, this skips that pass. On CUDA it would stall the queue: torch's own."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or not reading_back_is_free(grads[0].device) or any(
            g.dtype != grads[0].dtype for g in grads):  # torch's groups, its order of sums
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        return
    # as clip_grad_norm_ computes it for one device and dtype: per-tensor norms, then theirs
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    factor = max_norm / (norm + 1e-6)
    if factor.item() >= 1.0:
        return  # torch's clamp(factor, max=1.0) is 1.0; a NaN factor scales, as in torch
    torch._foreach_mul_(grads, factor)

