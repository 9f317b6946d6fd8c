"""Pack: K trial specs of one shape trained together as one batched model (run_trials, in
packed.py, decides which members train together and hands each pack here).

The members' parameters are stacked on a new leading axis and become the parameters of one
copy of the model, whose code runs once for all of them on inputs with that member axis in
front (models/layers.py: every linear layer is one batched matmul, every lookup one gather,
attention one kernel call). No torch.func.vmap: its per-op batching cost more than the pack
saved at the small widths a sweep tunes at. The stacks are views into one (K, P) buffer, so
the AdamW step is a few ops per optimizer group. Each member keeps what makes it its own
trial: its init (built exactly as run_trial builds it), its data order (its seed), LR /
sigma / weight decay / eps / schedule, its AdamW state and gradient clipping, its curve,
evaluations and status. A member that diverges has its updates masked on the device from
that very step (no host round trip); a member that diverges or is pruned by the reporter is
dropped from the stacks at the next sync step, so the others go on at the cost of the
smaller pack.

Every member's result equals run_trial's for its spec alone up to fp32 rounding
(tests/test_packed.py), because both share the run plan (plan.py), the divergence rule and
the result assembly (outcome.py), and the batched AdamW below follows torch.optim.AdamW's
update exactly.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hptransfer.data import TokenDataset
from hptransfer.models import ParamTable
from hptransfer.models.build import BuiltModel, build_from_config
from hptransfer.models.ngpt import NGPT, unit
from hptransfer.models.parameterization import optimizer_groups
from hptransfer.spec.trial import TrialResult, TrialSpec

from .checkpoints import CheckpointPolicy, TrialCheckpoints
from .compiling import Compiled, eager_if_backward_fails
from .device import autocast, reading_back_is_free, to_device
from .flat_adamw import FlatAdamW
from .outcome import Progress, trial_result
from .plan import TrialPlan, load_trial_data, plan_trial, prepare_process
from .preemption import Preempted, preemption
from .trial_state import lone_optimizer, trial_state

# reporter(member, metrics) -> True stops that member (pruned); member indexes the pack's specs
PackedReporter = Callable[[int, dict[str, Any]], bool | None]


@dataclass
class _Member:
    spec: TrialSpec
    plan: TrialPlan
    table: ParamTable
    progress: Progress
    train_time: float = 0.0
    result: TrialResult | None = None  # final once the member stopped before the pack's end
    checkpoints: TrialCheckpoints | None = None  # its own, as run_trial's alone
    notes: list[str] = field(default_factory=list)  # its own (checkpoint warnings)


# Compaction shrinks the stacks (K) that the compiled model's parameters are views of; torch
# compiles parameters for their exact shapes, so each smaller K compiled the model anew (a
# pack of 5 losing 3 members one by one: 4 compiles, CPU, ad hoc). Traced as any input, the
# first change of K makes it dynamic and later compactions reuse that graph. Built at first
# use: torch._dynamo takes ~1.2 s to import, paid by every process importing this module
# (the coordinator's, each Ray worker's) though only a pack's training needs it.
@functools.cache
def stack_size_may_change() -> Any:
    return torch._dynamo.config.patch(force_parameter_static_shapes=False)


class Pack:
    """One pack's batched model, its AdamW state and its training loop (module docstring)."""

    def __init__(self, specs: list[TrialSpec], reporter: PackedReporter | None,
                 cache_dir: str | None, data: TokenDataset | None = None,
                 on_stop: Callable[[int, TrialResult], None] | None = None,
                 max_hours: float | None = None,
                 policies: Sequence[CheckpointPolicy | None] | None = None):
        spec = specs[0]
        self.max_hours = max_hours  # the server's wall-time ceiling, as run_trial's
        prepare_process(spec)
        self.spec, self.reporter, self.on_stop = spec, reporter, on_stop
        self.started = time.perf_counter()
        self.data = data = data if data is not None else load_trial_data(spec, cache_dir)
        self.notes: list[str] = [f"trained packed: {len(specs)} trials in one batched model"]
        built = []
        self.members: list[_Member] = []
        for k, s in enumerate(specs):
            plan = plan_trial(s, data)
            # built on the CPU exactly as run_trial builds it (same init for the same seed)
            b = build_from_config(plan.cfg, s.parameterization_obj(), seed=s.seed)
            built.append(b)
            member = _Member(s, plan, b.table, Progress())
            policy = policies[k] if policies is not None else None
            if policy is not None:  # each member checkpoints as it would alone
                member.checkpoints = TrialCheckpoints(policy, member.notes)
            self.members.append(member)
        # the shape's plan: device, batches, steps, curve and eval points are the members'
        self.plan = self.members[0].plan
        self.device = self.plan.device
        self._stack(built)
        self._adamw_state(built)
        self.rows = list(range(len(specs)))  # member index of each stacked row
        self.initial: torch.Tensor | None = None
        # compiled on CUDA, and on the CPU when all the members' training repays a compile
        # (workers/compiling.compile_wanted)
        work = sum(m.plan.training_flops for m in self.members)
        self.loss_fn = Compiled(self._losses, self.device, self.notes, "packed model", work)
        self.update_fn = Compiled(self._update, self.device, self.notes, "packed AdamW step",
                                  work)

    # ---- the loop ----------------------------------------------------------------------
    def train(self) -> list[TrialResult]:
        spec, plan, device = self.spec, self.plan, self.device
        self._row_idx = torch.tensor(self.rows, device=device)
        alive = torch.ones(len(self.rows), dtype=torch.bool, device=device)
        pending_steps: list[int] = []
        pending_losses: list[torch.Tensor] = []
        t_train = time.perf_counter()
        with preemption() as preempted:
            for step in range(plan.total_steps):
                xs, ys = zip(*(self.data.train_batch(step, plan.batch_size, spec.seq_len,
                                                     self.members[i].spec.seed)
                               for i in self.rows), strict=True)
                x, y = to_device(torch.stack(xs), device), to_device(torch.stack(ys), device)
                losses = eager_if_backward_fails(self.loss_fn, self._gradients, x, y)
                if self.initial is None:
                    self.initial = losses.detach().double().clone()
                t = step + 1
                with torch.no_grad():
                    alive = self.update_fn(
                        self.gather_grads(), losses, alive, self.initial,
                        self.factors[step, self._row_idx], self.bias1[step],
                        self.bias2_sqrt[step],
                    )
                pending_steps.append(step)
                pending_losses.append(losses.detach())
                # as run_trial: a step-count checkpoint or a SIGTERM makes a sync step
                stopping = preempted()
                if not (plan.is_sync_step(t) or stopping or any(
                        self.members[i].checkpoints is not None
                        and self.members[i].checkpoints.step_is_due(t) for i in self.rows)):
                    continue
                self._sync(step, pending_steps, torch.stack(pending_losses).tolist(),
                           time.perf_counter() - t_train)
                pending_steps, pending_losses = [], []
                if t < plan.total_steps and self._past_ceiling():
                    for i in self.rows:
                        self.members[i].progress.stop_past_ceiling(self.members[i].plan, step,
                                                                   self.max_hours)
                self._compact()
                if not self.rows:
                    break
                if t < plan.total_steps:  # the last step's state is the result's
                    self._checkpoint(t, stopping)
                    if stopping:
                        raise Preempted(f"stopped by SIGTERM after step {t}, checkpointed")
                alive = torch.ones(len(self.rows), dtype=torch.bool, device=device)
        end = time.perf_counter() - t_train
        for m in self.members:  # finished (any way but an exception): as run_trial's
            if m.checkpoints is not None:
                m.checkpoints.finish()
        return [m.result or self._result(m, m.train_time or end) for m in self.members]

    def _checkpoint(self, done: int, stopping: bool) -> None:
        """After `done` steps, for each member still training where its policy says so (or
        on SIGTERM): its checkpoint, in run_trial's format, so that its retry resumes alone
        (the dispatcher leases a trial with a checkpoint alone) from there."""
        for r, i in enumerate(self.rows):
            checkpoints = self.members[i].checkpoints
            if checkpoints is not None and (checkpoints.due(done) or stopping):
                checkpoints.save(done, self.member_state(r, done))

    def member_state(self, row: int, done: int) -> dict[str, Any]:
        """The checkpoint of the member in stacked `row` after `done` steps, exactly what
        run_trial writes for that trial alone (trial_state.trial_state): the lone model's state dict
        (same keys), the lone optimizer's (FlatAdamW on the CPU, fused AdamW on CUDA) with
        the member's AdamW moments, its progress and the RNG."""
        m = self.members[self.rows[row]]
        # copied to the host: a view would save the whole (K, P) buffer it is part of, and
        # the device has no room planned for a member's copy (torch.load maps to the CPU
        # anyway, and the lone optimizer's load moves its state to its parameters' device)
        weights = {n: self._block(self.flat, n)[row].detach().to("cpu", copy=True)
                   for n in self.names}
        model_state = self.template.state_dict()  # the buffers, and the lone model's keys
        model_state.update(weights)
        params = {n: nn.Parameter(w) for n, w in weights.items()}  # the optimizer's only
        opt = lone_optimizer(optimizer_groups(params, m.table),
                             (self.spec.beta1, self.spec.beta2), self.device)
        exp_avg = [self._block(self.exp_avg, n)[row] for n in self.names]
        exp_avg_sq = [self._block(self.exp_avg_sq, n)[row] for n in self.names]
        if isinstance(opt, FlatAdamW):
            opt.set_moments(done, exp_avg, exp_avg_sq)
        else:  # torch.optim.AdamW: each parameter's state as its step() leaves it
            fused = any(g.get("fused") for g in opt.param_groups)
            for p, avg, avg_sq in zip(params.values(), exp_avg, exp_avg_sq, strict=True):
                opt.state[p] = {
                    "step": torch.tensor(float(done), dtype=torch.float32,
                                         device=p.device if fused else None),
                    "exp_avg": avg.to("cpu", copy=True),
                    "exp_avg_sq": avg_sq.to("cpu", copy=True)}
        return trial_state(done, self.template, opt, m.progress,
                      weights=(model_state, opt.state_dict()))

    def _past_ceiling(self) -> bool:
        return (self.max_hours is not None
                and time.perf_counter() - self.started > self.max_hours * 3600.0)

    def _result(self, m: _Member, train_time: float) -> TrialResult:
        return trial_result(m.plan, m.progress, table=m.table, train_time=train_time,
                            started=self.started, notes=[*self.notes, *m.notes])

    def _sync(self, step: int, steps: list[int], losses: list[list[float]],
              elapsed: float) -> None:
        """Host side of a sync step: divergence, curve points, evaluation, the reporter."""
        done = step + 1
        for r, i in enumerate(self.rows):
            self.members[i].progress.absorb(self.members[i].plan, steps, [row[r] for row in losses])
        self._compact()  # diverged members are not evaluated
        if done < self.plan.total_steps:  # before the reporter, which may end the process
            for i in self.rows:
                if self.members[i].checkpoints is not None:
                    self.members[i].checkpoints.mark_reached(done)
        running = list(self.rows)
        points = {i: self.members[i].plan.point(step, self.members[i].progress.train_loss)
                  for i in running if self.plan.is_curve_step(done)}
        if running and self.plan.is_eval_step(done):
            for i, val in zip(self.rows, self.evaluate(), strict=True):
                progress = self.members[i].progress
                progress.val_loss = val
                point = points.setdefault(i, self.members[i].plan.point(step, progress.train_loss))
                point["val_loss"] = val
                if not math.isfinite(val):
                    progress.status = "diverged"
        for i, point in points.items():
            progress = self.members[i].progress
            progress.curve.append(point)
            stop = self.reporter is not None and self.reporter(i, dict(point))
            if stop and progress.running and done < self.plan.total_steps:
                progress.status = "pruned"
        for r, m in enumerate(self.members):
            if not m.progress.running and not m.train_time:
                m.train_time = elapsed
                if m.checkpoints is not None:  # final: as run_trial's, they go
                    m.checkpoints.finish()
                if self.on_stop is not None and done < self.plan.total_steps:
                    # stopped early (diverged, pruned): final now, handed over while the
                    # others train on, so a pack that dies later does not take it along
                    m.result = self._result(m, elapsed)
                    self.on_stop(r, m.result)

    def _gradients(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Each member's loss on its batch, (members,); its gradient in .grad, accumulated
        over micro-batches along the batch axis (1)."""
        for p in self.params.values():
            p.grad = None
        losses = torch.zeros(len(self.rows), device=self.device)
        for xc, yc, weight in self.plan.micro_batches(x, y, dim=1):
            with stack_size_may_change():
                part = self.loss_fn(xc, yc)
            if weight != 1.0:
                part = part * weight
            part.sum().backward()  # members are independent: each gets its own gradient
            losses += part.detach()
        return losses

    # ---- set-up ----------------------------------------------------------------------
    def _stack(self, built: list[BuiltModel]) -> None:
        """Every member's parameters side by side in one (K, P) buffer, each parameter a
        column block of it, grouped by optimizer group: the AdamW step is a dozen ops per
        group on whole column ranges, not a dozen per parameter (at the widths a sweep tunes
        at, those cost more than the model). Member 0's model, moved to the device, is the
        template whose code runs the pack."""
        named = [dict(b.model.named_parameters()) for b in built]
        groups = [[g.params for g in b.table.groups] for b in built]
        if any(g != groups[0] for g in groups):  # same shape and rule: cannot happen
            raise ValueError("packed members must have the same parameter groups")
        self.names = names = [n for params in groups[0] for n in params]
        self.blocks: dict[str, tuple[int, int, torch.Size]] = {}
        self.segments: list[tuple[int, int]] = []  # column range of each group
        start = 0
        for params in groups[0]:
            first = start
            for n in params:
                shape = named[0][n].shape
                self.blocks[n] = (start, start + shape.numel(), shape)
                start += shape.numel()
            self.segments.append((first, start))
        # stacked before the template moves: Module.to moves member 0's parameters in place
        initial = torch.stack([torch.cat([m[n].detach().flatten() for n in names])
                               for m in named])
        self.template: nn.Module = built[0].model.to(self.device)  # code + buffers, not weights
        self.ngpt_axes = (self.template.unit_norm_axes()
                          if isinstance(self.template, NGPT) else {})
        self._set_params(initial.to(self.device))

    def _adamw_state(self, built: list[BuiltModel]) -> None:
        """AdamW's moments and scratch buffers, each member's own numbers (from its own group
        table and LR schedule), and every step's bias corrections, all on the device."""
        device, spec, steps = self.device, self.spec, self.plan.total_steps
        self.exp_avg = torch.zeros_like(self.flat)
        self.exp_avg_sq = torch.zeros_like(self.flat)
        self.grad, self.scratch = torch.empty_like(self.flat), torch.empty_like(self.flat)
        # (K, groups): each member's own AdamW numbers, from its own group table
        self.hp = {key: torch.tensor([[getattr(g, key) for g in b.table.groups] for b in built],
                                     device=device)
                   for key in ("lr", "weight_decay", "eps")}
        # groups whose weight decay is 0 for every member skip the decay's pass (x * 1.0 is x)
        self.decays = (self.hp["weight_decay"] != 0).any(dim=0).tolist()  # once, at set-up
        # each column's optimizer group, for the traced AdamW step (_update_traced)
        self.column_group = torch.repeat_interleave(
            torch.arange(len(self.segments), device=device),
            torch.tensor([stop - start for start, stop in self.segments], device=device))
        self.factors = torch.tensor(  # (steps, K): each member's own LR schedule
            list(zip(*(m.plan.factors(steps) for m in self.members), strict=True)),
            device=device,
        )
        # AdamW bias corrections of every step, on the device: a host scalar made into a device
        # tensor each step would be a blocking copy (a host sync) on CUDA
        t = torch.arange(1, steps + 1, dtype=torch.float64)
        self.bias1 = (1 - spec.beta1**t).float().to(device)
        self.bias2_sqrt = (1 - spec.beta2**t).sqrt().float().to(device)
        self.div_factor = torch.tensor([m.spec.divergence_factor for m in self.members],
                                       dtype=torch.float64, device=device)

    # ---- the batched model -------------------------------------------------------------
    def _block(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """Parameter `name` of every member: a (K, *shape) view into a (K, P) buffer."""
        start, stop, shape = self.blocks[name]
        return flat[:, start:stop].view(flat.shape[0], *shape)

    def _set_params(self, flat: torch.Tensor) -> None:
        """Make views into `flat` the template's parameters (leaves that get .grad; an
        nn.Parameter made from a view shares its storage, so updating `flat` updates them)."""
        self.flat = flat
        self.params = {n: nn.Parameter(self._block(flat, n)) for n in self.names}
        for name, p in self.params.items():
            owner, _, leaf = name.rpartition(".")
            self.template.get_submodule(owner)._parameters[leaf] = p

    def _token_losses(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """(members, batch, T) ids and targets -> (members, batch * T) cross-entropies."""
        with autocast(self.device, self.plan.bf16):
            logits = self.template(x)
        ce = F.cross_entropy(logits.float().flatten(0, -2), y.flatten(), reduction="none")
        return ce.view(y.shape[0], -1)

    def _losses(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Each member's mean training loss on its own batch: (members,)."""
        return self._token_losses(x, y).mean(dim=1)

    @torch.no_grad()
    def evaluate(self) -> list[float]:
        """Every active member's mean validation loss (the same batches as run_trial)."""
        self.template.eval()
        k = len(self.rows)
        total = torch.zeros(k, dtype=torch.float64, device=self.device)
        count = 0
        for x, y in self.plan.validation_batches():
            x, y = to_device(x, self.device), to_device(y, self.device)
            shared = (k, *x.shape)  # every member sees the same validation batch
            total += self._token_losses(x.expand(shared), y.expand(shared)).sum(dim=1).double()
            count += y.numel()
        self.template.train()
        return (total / count).tolist()

    # ---- one optimizer step for all active members ---------------------------------------
    def gather_grads(self) -> torch.Tensor:
        """The parameters' gradients laid out as the (K, P) buffer, in its scratch `grad`."""
        return torch.cat([self.params[n].grad.flatten(1) for n in self.names], dim=1,
                         out=self.grad)

    def _update(self, grad: torch.Tensor, losses: torch.Tensor, alive: torch.Tensor,
                initial: torch.Tensor, factors: torch.Tensor, bias1: torch.Tensor,
                bias2_sqrt: torch.Tensor) -> torch.Tensor:
        """Divergence mask, per-member clipping and torch.optim.AdamW's update on the (K, P)
        buffers; returns the new alive mask. All on the device, nothing read back."""
        spec = self.spec
        lossd = losses.detach().double()
        alive = alive & torch.isfinite(lossd) & ~(lossd > self.div_factor * initial)
        # in place on grad and into the scratch buffer: on the CPU a fresh temporary the size
        # of the model is mostly page faults (large allocations are new mappings every time)
        # where reading back is free (the CPU, eager), what would change nothing is skipped:
        # the rows of members whose clipping factor is 1.0 (x * 1.0 is x), and the masking
        # while no member has stopped. Elsewhere each is one pass over the whole buffer.
        skips = reading_back_is_free(grad.device) and not torch.compiler.is_compiling()
        if spec.grad_clip:  # each member's global norm, as clip_grad_norm_ over its params
            factor = (spec.grad_clip / (grad.norm(dim=1, keepdim=True) + 1e-6)).clamp(max=1.0)
            if skips:  # a row at a time: the same multiply; a NaN factor scales
                for row in torch.nonzero(~(factor == 1.0).flatten()).flatten().tolist():
                    grad[row].mul_(factor[row])
            else:
                grad.mul_(factor)
        if not (skips and bool(alive.all())):
            grad.masked_fill_(~alive.unsqueeze(1), 0.0)  # a stopped member: no update
        lrs = self.hp["lr"] * (factors * alive).unsqueeze(1)  # (K, groups)
        # nGPT: then back onto the sphere, per member
        if torch.compiler.is_compiling():
            self._update_traced(grad, lrs, bias1, bias2_sqrt)
            self._renormalise_traced()
        else:
            self._update_by_group(grad, lrs, bias1, bias2_sqrt)
            self._renormalise_by_block()
        return alive

    def _update_by_group(self, grad: torch.Tensor, lrs: torch.Tensor, bias1: torch.Tensor,
                         bias2_sqrt: torch.Tensor) -> None:
        """AdamW, eager: a few in-place ops per optimizer group on its column range, with
        that group's (K, 1) hyper-parameters."""
        spec = self.spec
        for g, (start, stop) in enumerate(self.segments):
            p, m, v, grad_g, scratch = (t[:, start:stop] for t in (
                self.flat, self.exp_avg, self.exp_avg_sq, grad, self.scratch))
            lr = lrs[:, g:g + 1]
            if self.decays[g]:
                p.mul_(1 - lr * self.hp["weight_decay"][:, g:g + 1])
            m.lerp_(grad_g, 1 - spec.beta1)
            v.mul_(spec.beta2).addcmul_(grad_g, grad_g, value=1 - spec.beta2)
            # written straight into scratch buffers (out=): one pass each, no temporaries
            denom = torch.sqrt(v, out=scratch).div_(bias2_sqrt).add_(self.hp["eps"][:, g:g + 1])
            # exp_avg / denom, then times lr / bias1 (AdamW's order), in grad's spent columns
            p.sub_(torch.div(m, denom, out=grad_g).mul_(lr / bias1))

    def _update_traced(self, grad: torch.Tensor, lrs: torch.Tensor, bias1: torch.Tensor,
                       bias2_sqrt: torch.Tensor) -> None:
        """The same AdamW arithmetic for torch.compile: one pass over whole buffers, each
        column reading its group's numbers through `column_group`. Traced, the by-group
        version's in-place ops on column slices became a copy of whole buffers per group:
        6x slower than eager at width 64 (K = 8, 2 threads, ad hoc)."""
        spec, col = self.spec, self.column_group
        lr = lrs[:, col]  # (K, P)
        if any(self.decays):  # x * (1 - lr * 0) is x: the groups without decay are unmoved
            self.flat.mul_(1 - lr * self.hp["weight_decay"][:, col])
        self.exp_avg.lerp_(grad, 1 - spec.beta1)
        self.exp_avg_sq.mul_(spec.beta2).addcmul_(grad, grad, value=1 - spec.beta2)
        denom = self.exp_avg_sq.sqrt().div_(bias2_sqrt).add_(self.hp["eps"][:, col])
        self.flat.sub_(self.exp_avg.div(denom).mul_(lr / bias1))

    def _renormalise_by_block(self) -> None:
        """nGPT's renormalisation, eager: each unit-norm matrix in place in its view."""
        for n, axis in self.ngpt_axes.items():
            block = self._block(self.flat, n)
            block.copy_(unit(block, dim=axis + 1))

    def _renormalise_traced(self) -> None:
        """nGPT's renormalisation for torch.compile: the whole buffer rebuilt in column order
        and written back once. Traced, a copy into each matrix's view became a pass over the
        whole buffer per matrix: the traced nGPT step took 13.6 ms against eager's 10.4 at width
        64, 6.6 ms now (K = 8, 2 threads, ad hoc)."""
        if not self.ngpt_axes:
            return
        pieces = []
        for n in self.names:  # the buffer's column order
            block = self._block(self.flat, n)
            axis = self.ngpt_axes.get(n)
            pieces.append((block if axis is None else unit(block, dim=axis + 1)).flatten(1))
        self.flat.copy_(torch.cat(pieces, dim=1))

    def _compact(self) -> None:
        """Drop members that stopped (diverged, pruned) from the stacks."""
        keep = [r for r, i in enumerate(self.rows) if self.members[i].progress.running]
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[r] for r in keep]
        if not keep:  # every member stopped: nothing left to train (the loop ends)
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self._set_params(self.flat.detach()[idx])
        self.exp_avg, self.exp_avg_sq = self.exp_avg[idx], self.exp_avg_sq[idx]
        self.grad, self.scratch = self.grad[idx], self.scratch[idx]
        self.hp = {key: table[idx] for key, table in self.hp.items()}
        self.div_factor = self.div_factor[idx]
        if self.initial is not None:
            self.initial = self.initial[idx]
        self._row_idx = torch.tensor(self.rows, device=self.device)
