"""AdamW on one flat buffer per parameter group: torch.optim.AdamW's CPU foreach arithmetic,
a few ops per group instead of a few per parameter.

On the CPU, torch's foreach AdamW has no multi-tensor kernel: every `_foreach_*` op loops over
the parameters in C++ (and `addcdiv_` with per-parameter step sizes makes a scalar tensor per
parameter), so a model of a few hundred small tensors pays ~10 dispatches per tensor per step.
Here each group's parameters are views into one contiguous buffer (as are their AdamW moments),
and each op of foreach's sequence runs once per group on the whole buffer, with the same
Python-float scalars. The two ops that read gradients stay foreach ops over the per-parameter
gradients and moment views: gathering the gradients into one buffer first cost a copy of them
all, which made the step 1.03-1.12x slower at every shape from 40 x 4 to 512 x 4 and no faster
at 16 x 24 (ad hoc, the step alone, one thread, Xeon host, 2026-12-03). Elementwise ops compute
each element on its own, so the result is foreach's to the bit (tests/test_flat_adamw.py):
the trainer's numbers do not move, only its optimizer step time.

`fused=True` (torch's one-kernel AdamW) would be faster still, but rounds differently, and
packed trials (workers/packed.py) follow foreach's update; this keeps one numeric reference.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


class _FlatGroup:
    """One param group: its parameters re-pointed into one buffer, its AdamW moments (one
    buffer each, with per-parameter views) and a scratch buffer for the step."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        with torch.no_grad():
            self.flat = torch.cat([p.detach().reshape(-1) for p in params])
        start = 0
        for p in params:
            n = p.numel()
            # the Parameter object stays (the model and clipping keep seeing it); its data
            # becomes a view, so updating the buffer updates the model
            p.data = self.flat[start:start + n].view_as(p)
            start += n
        self.exp_avg = torch.zeros_like(self.flat)
        self.exp_avg_sq = torch.zeros_like(self.flat)
        sizes = [p.numel() for p in params]
        self.exp_avg_views = [m.view_as(p) for m, p in
                              zip(self.exp_avg.split(sizes), params, strict=True)]
        self.exp_avg_sq_views = [m.view_as(p) for m, p in
                                 zip(self.exp_avg_sq.split(sizes), params, strict=True)]
        # the step's denominator, the temporary foreach allocates, kept from step to step
        self.denom = torch.empty_like(self.flat)
        self.steps = 0


class FlatAdamW:
    """The subset of torch.optim.AdamW the trainer uses: `param_groups` (dicts with "params",
    "lr", "weight_decay", "eps" and any extra keys, which it keeps), `zero_grad`, `step`.
    Dense CPU float parameters whose gradients all exist at every step (the trainer's models);
    anything else raises rather than silently diverging from torch's semantics."""

    def __init__(self, groups: Iterable[dict[str, Any]], betas: tuple[float, float]) -> None:
        from torch.distributed.tensor import DTensor

        self.beta1, self.beta2 = betas
        self.param_groups = [dict(g) for g in groups]
        if any(isinstance(p, DTensor) for g in self.param_groups for p in g["params"]):
            # re-pointing a shard's storage would cut it off from FSDP's own buffers
            raise TypeError("FlatAdamW takes whole CPU parameters, not FSDP's DTensor shards: "
                            "use torch.optim.AdamW(foreach=True) (workers/sharding.py)")
        self._flat = [_FlatGroup(list(g["params"])) for g in self.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient (always to None: backward then hands over fresh ones)."""
        for group in self._flat:
            for p in group.params:
                p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        beta1, beta2 = self.beta1, self.beta2
        for g, flat in zip(self.param_groups, self._flat, strict=True):
            grads = [p.grad for p in flat.params]
            if any(grad is None for grad in grads):
                raise RuntimeError(f"FlatAdamW: a parameter of group {g.get('name', '?')!r} "
                                   "has no gradient (use torch.optim.AdamW for such models)")
            flat.steps += 1
            lr, wd, eps = g["lr"], g["weight_decay"], g["eps"]
            # the scalars exactly as torch.optim.adam._multi_tensor_adam computes them
            bias_correction1 = 1 - beta1 ** float(flat.steps)
            bias_correction2 = 1 - beta2 ** float(flat.steps)
            step_size = (lr / bias_correction1) * -1
            if wd != 0:
                flat.flat.mul_(1 - lr * wd)
            torch._foreach_lerp_(flat.exp_avg_views, grads, 1 - beta1)
            flat.exp_avg_sq.mul_(beta2)
            torch._foreach_addcmul_(flat.exp_avg_sq_views, grads, grads, value=1 - beta2)
            denom = torch.sqrt(flat.exp_avg_sq, out=flat.denom)
            denom.div_(bias_correction2**0.5)
            denom.add_(eps)
            flat.flat.addcdiv_(flat.exp_avg, denom, value=step_size)

    def state_dict(self) -> dict[str, Any]:
        """The moments and step count of each group (for a checkpoint; the LRs are set from
        the schedule every step, the parameters come with the model)."""
        return {"groups": [{"steps": f.steps, "exp_avg": f.exp_avg.clone(),
                            "exp_avg_sq": f.exp_avg_sq.clone()} for f in self._flat]}

    def set_moments(self, steps: int, exp_avg: list[torch.Tensor],
                    exp_avg_sq: list[torch.Tensor]) -> None:
        """The state after `steps` steps with these moments, one per parameter in the
        groups' order (a packed member's, to checkpoint it in this optimizer's format)."""
        views = [(m, v) for f in self._flat
                 for m, v in zip(f.exp_avg_views, f.exp_avg_sq_views, strict=True)]
        for (m, v), saved_m, saved_v in zip(views, exp_avg, exp_avg_sq, strict=True):
            m.copy_(saved_m)
            v.copy_(saved_v)
        for f in self._flat:
            f.steps = steps

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["groups"]
        if len(saved) != len(self._flat) or any(
                s["exp_avg"].shape != f.exp_avg.shape for s, f in zip(saved, self._flat,
                                                                      strict=False)):
            raise ValueError("the checkpoint's optimizer state is for another model")
        for s, f in zip(saved, self._flat, strict=True):
            f.steps = int(s["steps"])
            f.exp_avg.copy_(s["exp_avg"])  # in place: the per-parameter views stay valid
            f.exp_avg_sq.copy_(s["exp_avg_sq"])
