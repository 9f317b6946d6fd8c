"""run_trials: K trial specs of one shape trained together as one batched model.

The members' parameters are stacked on a new leading axis and the unchanged model code runs
once for all of them under `torch.func.vmap(functional_call(...))`, so every linear layer is
one batched matmul. Each member keeps what makes it its own trial: its init (built exactly as
run_trial builds it), its data order (its seed), LR / sigma / weight decay / eps / schedule,
its AdamW state and gradient clipping, its curve, evaluations and status. A member that
diverges has its updates masked on the device from that very step (no host round trip); a
member that diverges or is pruned by the reporter is dropped from the stacks at the next
sync step, so the others go on at the cost of the smaller pack.

Every member's result equals run_trial's for its spec alone up to fp32 rounding
(tests/test_packed.py), because both share the plan, the divergence rule and the result
assembly (plan.py) and the batched AdamW below follows torch.optim.AdamW's update exactly.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from hptransfer.models import ParamTable
from hptransfer.models.build import build_from_config
from hptransfer.models.layers import vmapped_attention
from hptransfer.models.ngpt import NGPT, unit

from .device import Compiled, autocast, resolve_device
from .plan import Progress, TrialPlan, failed_result, load_trial_data, plan_trial, trial_result
from .trial import TrialResult, TrialSpec

# reporter(member, metrics) -> True stops that member (pruned); member indexes `specs`
PackedReporter = Callable[[int, dict[str, Any]], bool | None]

# the fields packed members may differ in; every other field defines the shared shape
PACKABLE_FIELDS = frozenset(
    {"lr", "sigma_base", "weight_decay", "eps", "seed", "schedule", "divergence_factor"}
)


def check_packable(specs: Sequence[TrialSpec]) -> None:
    """Raise ValueError naming the first field (other than PACKABLE_FIELDS) that differs."""
    if not specs:
        raise ValueError("run_trials needs at least one spec")
    first = specs[0].model_dump(exclude=set(PACKABLE_FIELDS))
    for i, spec in enumerate(specs[1:], start=1):
        other = spec.model_dump(exclude=set(PACKABLE_FIELDS))
        for key, value in first.items():
            if other[key] != value:
                raise ValueError(
                    f"specs 0 and {i} cannot be packed: field {key!r} differs ({value!r} vs "
                    f"{other[key]!r}); packed members may differ only in "
                    f"{', '.join(sorted(PACKABLE_FIELDS))}"
                )


def run_trials(
    specs: Sequence[TrialSpec | dict],
    reporter: PackedReporter | None = None,
    cache_dir: str | None = None,
) -> list[TrialResult]:
    """Train K specs of one shape together; one TrialResult per spec, in order.

    Raises ValueError if the specs are not packable; training problems never raise (every
    member's result then says failed, as run_trial's would).
    """
    started = time.perf_counter()
    specs = [s if isinstance(s, TrialSpec) else TrialSpec.model_validate(s) for s in specs]
    check_packable(specs)
    try:
        return _Pack(specs, reporter, cache_dir).train(started)
    except Exception as exc:
        return [failed_result(spec, exc, started) for spec in specs]


@dataclass
class _Member:
    spec: TrialSpec
    plan: TrialPlan
    table: ParamTable
    progress: Progress
    train_time: float = 0.0


class _Pack:
    def __init__(self, specs: list[TrialSpec], reporter: PackedReporter | None,
                 cache_dir: str | None):
        spec = specs[0]
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        self.spec, self.reporter = spec, reporter
        self.device = device = resolve_device(spec.device)
        self.data = data = load_trial_data(spec, cache_dir)
        self.notes: list[str] = [f"trained packed: {len(specs)} trials in one batched model"]
        built = []
        self.members: list[_Member] = []
        for s in specs:
            plan = plan_trial(s, data, device)
            # built on the CPU exactly as run_trial builds it (same init for the same seed)
            b = build_from_config(plan.cfg, s.parameterization_obj(), seed=s.seed)
            built.append(b)
            self.members.append(_Member(s, plan, b.table, Progress()))
        self.plan = self.members[0].plan  # shape, steps, curve and eval points are shared
        self.template: nn.Module = built[0].model.to(device)  # code + buffers, not weights
        self.ngpt_axes = (self.template.unit_norm_axes()
                          if isinstance(self.template, NGPT) else {})
        names = [n for n, _ in self.template.named_parameters()]
        self.names = names
        self.params = {
            n: torch.stack([dict(b.model.named_parameters())[n].detach() for b in built])
            .to(device).requires_grad_() for n in names
        }
        self.exp_avg = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self.exp_avg_sq = {n: torch.zeros_like(p) for n, p in self.params.items()}
        # per-member, per-parameter AdamW numbers from each member's own group table
        hp = {key: {n: [] for n in names} for key in ("lr", "weight_decay", "eps")}
        for b in built:
            for g in b.table.groups:
                for n in g.params:
                    hp["lr"][n].append(g.lr)
                    hp["weight_decay"][n].append(g.weight_decay)
                    hp["eps"][n].append(g.eps)
        self.hp = {key: {n: torch.tensor(v, device=device) for n, v in d.items()}
                   for key, d in hp.items()}
        self.factors = torch.tensor(  # (steps, K): each member's own LR schedule
            [[m.plan.factor(step) for m in self.members] for step in range(self.plan.total_steps)],
            device=device,
        )
        # AdamW bias corrections of every step, on the device: a host scalar made into a device
        # tensor each step would be a blocking copy (a host sync) on CUDA
        t = torch.arange(1, self.plan.total_steps + 1, dtype=torch.float64)
        self.bias1 = (1 - spec.beta1**t).float().to(device)
        self.bias2_sqrt = (1 - spec.beta2**t).sqrt().float().to(device)
        self.div_factor = torch.tensor([s.divergence_factor for s in specs],
                                       dtype=torch.float64, device=device)
        self.rows = list(range(len(specs)))  # member index of each stacked row
        self.initial: torch.Tensor | None = None
        # on the CPU, attention folds the members into its batch (no flash batching rule);
        # CUDA has one, and compiles the model, which the fold's ContextVar would break
        self.fold_attention = device.type == "cpu"
        self.loss_fn = Compiled(vmap(self._member_loss), device, self.notes, "packed model")
        self.update_fn = Compiled(self._update, device, self.notes, "packed AdamW step")

    # ---- the batched model -------------------------------------------------------------
    def _logits(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        folded = vmapped_attention() if self.fold_attention else contextlib.nullcontext()
        with autocast(self.device, self.spec.precision), folded:
            return functional_call(self.template, params, (x,))

    def _member_loss(self, params: dict[str, torch.Tensor], x: torch.Tensor,
                     y: torch.Tensor) -> torch.Tensor:
        logits = self._logits(params, x)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def _member_val_loss(self, params: dict[str, torch.Tensor], x: torch.Tensor,
                         y: torch.Tensor) -> torch.Tensor:
        logits = self._logits(params, x)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")

    @torch.no_grad()
    def evaluate(self) -> list[float]:
        """Every active member's mean validation loss (the same batches as run_trial)."""
        self.template.eval()
        params = {n: p.detach() for n, p in self.params.items()}
        total = torch.zeros(len(self.rows), dtype=torch.float64, device=self.device)
        count = 0
        fn = vmap(self._member_val_loss, in_dims=(0, None, None))
        for x, y in self.data.val_batches(self.spec.batch_size, self.spec.seq_len):
            x, y = x.to(self.device), y.to(self.device)
            total += fn(params, x, y).double()
            count += y.numel()
        self.template.train()
        return (total / count).tolist()

    # ---- one optimizer step for all active members ---------------------------------------
    def _update(self, grads: list[torch.Tensor], losses: torch.Tensor, alive: torch.Tensor,
                initial: torch.Tensor, factors: torch.Tensor, bias1: torch.Tensor,
                bias2_sqrt: torch.Tensor) -> torch.Tensor:
        """Divergence mask, per-member clipping and torch.optim.AdamW's update; returns the
        new alive mask. All on the device, nothing read back."""
        spec = self.spec
        lossd = losses.detach().double()
        ok = torch.isfinite(lossd) & ~(lossd > self.div_factor[self._row_idx] * initial)
        alive = alive & ok
        if spec.grad_clip:
            norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads])
            coef = (spec.grad_clip / (norms.norm(dim=0) + 1e-6)).clamp(max=1.0)
        else:
            coef = torch.ones_like(losses)
        beta1, beta2 = spec.beta1, spec.beta2
        for n, g in zip(self.names, grads, strict=True):
            p, m, v = self.params[n], self.exp_avg[n], self.exp_avg_sq[n]
            shape = (-1,) + (1,) * (p.dim() - 1)
            keep = alive.view(shape)
            g = torch.where(keep, g * coef.view(shape), 0.0)  # a stopped member: no update
            lr = (self.hp["lr"][n][self._row_idx] * factors * alive).view(shape)
            wd = self.hp["weight_decay"][n][self._row_idx].view(shape)
            eps = self.hp["eps"][n][self._row_idx].view(shape)
            p.mul_(1 - lr * wd)
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v.sqrt() / bias2_sqrt).add_(eps)
            p.sub_((lr / bias1) * m / denom)
        for n, axis in self.ngpt_axes.items():  # nGPT: back onto the sphere, per member
            p = self.params[n]
            p.copy_(unit(p, dim=axis + 1))
        return alive

    def _compact(self) -> None:
        """Drop members that stopped (diverged, pruned) from the stacks."""
        keep = [r for r, i in enumerate(self.rows) if self.members[i].progress.running]
        if len(keep) == len(self.rows):
            return
        idx = torch.tensor(keep, device=self.device)
        self.rows = [self.rows[r] for r in keep]
        self.params = {n: p.detach()[idx].requires_grad_() for n, p in self.params.items()}
        self.exp_avg = {n: t[idx] for n, t in self.exp_avg.items()}
        self.exp_avg_sq = {n: t[idx] for n, t in self.exp_avg_sq.items()}
        if self.initial is not None:
            self.initial = self.initial[idx]
        self._row_idx = torch.tensor(self.rows, device=self.device)

    # ---- the loop ----------------------------------------------------------------------
    def train(self, started: float) -> list[TrialResult]:
        spec, plan, device = self.spec, self.plan, self.device
        self._row_idx = torch.tensor(self.rows, device=device)
        alive = torch.ones(len(self.rows), dtype=torch.bool, device=device)
        pending_steps: list[int] = []
        pending_losses: list[torch.Tensor] = []
        t_train = time.perf_counter()
        for step in range(plan.total_steps):
            xs, ys = zip(*(self.data.train_batch(step, spec.batch_size, spec.seq_len,
                                                 self.members[i].spec.seed)
                           for i in self.rows), strict=True)
            x = torch.stack(xs).to(device, non_blocking=True)
            y = torch.stack(ys).to(device, non_blocking=True)
            losses = self.loss_fn(self.params, x, y)
            for p in self.params.values():
                p.grad = None
            losses.sum().backward()  # members are independent: each gets its own gradient
            if self.initial is None:
                self.initial = losses.detach().double().clone()
            t = step + 1
            with torch.no_grad():
                alive = self.update_fn(
                    [self.params[n].grad for n in self.names], losses, alive, self.initial,
                    self.factors[step, self._row_idx], self.bias1[step], self.bias2_sqrt[step],
                )
            pending_steps.append(step)
            pending_losses.append(losses.detach())
            if plan.is_sync_step(t):
                self._sync(step, pending_steps, torch.stack(pending_losses).tolist(),
                           time.perf_counter() - t_train)
                pending_steps, pending_losses = [], []
                self._compact()
                if not self.rows:
                    break
                alive = torch.ones(len(self.rows), dtype=torch.bool, device=device)
        end = time.perf_counter() - t_train
        return [
            trial_result(m.plan, m.progress, table=m.table, device=device,
                         train_time=m.train_time or end, started=started,
                         notes=list(self.notes))
            for m in self.members
        ]

    def _sync(self, step: int, steps: list[int], losses: list[list[float]],
              elapsed: float) -> None:
        """Host side of a sync step: divergence, curve points, evaluation, the reporter."""
        done = step + 1
        for r, i in enumerate(self.rows):
            self.members[i].progress.absorb(self.members[i].plan, steps, [row[r] for row in losses])
        self._compact()  # diverged members are not evaluated
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
        for m in self.members:
            if not m.progress.running and not m.train_time:
                m.train_time = elapsed
