"""Coord-check training: one model trained on the fixed batch while forward hooks record the
mean |activation| of each module at every step (the modules are described in
`hptransfer.coordcheck`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hptransfer.models.build import BuiltModel
from hptransfer.models.parameterization import optimizer_groups

MODULES = ("embedding", "attn_out", "mlp_out", "final_residual", "logits")


def ordered_modules(names: Iterable[str]) -> list[str]:
    """The modules among `names`, in MODULES order, each once."""
    present = set(names)
    return [m for m in MODULES if m in present]


def _mean_abs(t: torch.Tensor) -> float:
    return float(t.detach().float().abs().mean())


class _Recorder:
    """Forward hooks collecting mean|act| per module (per-block modules: one value per block)."""

    def __init__(self, model: nn.Module) -> None:
        self.values: dict[str, list[float]] = {}
        self.handles: list[Any] = []
        self._hook(model.embed, "embedding")
        for block in model.blocks:
            self._hook(block.attn, "attn_out")
            self._hook(block.mlp, "mlp_out")
        final = model.ln_final if hasattr(model, "ln_final") else model.unembed
        self.handles.append(final.register_forward_pre_hook(self._pre("final_residual")))
        self._hook(model, "logits")

    def _hook(self, module: nn.Module, name: str) -> None:
        def hook(_mod: nn.Module, _inp: Any, out: torch.Tensor) -> None:
            self.values.setdefault(name, []).append(_mean_abs(out))

        self.handles.append(module.register_forward_hook(hook))

    def _pre(self, name: str) -> Callable:
        def hook(_mod: nn.Module, inp: tuple) -> None:
            self.values.setdefault(name, []).append(_mean_abs(inp[0]))

        return hook

    def take(self) -> dict[str, float]:
        out = {k: float(np.mean(v)) for k, v in self.values.items()}
        self.values = {}
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def train_and_record(
    built: BuiltModel, x: torch.Tensor, y: torch.Tensor, steps: int
) -> tuple[list[dict[str, float]], list[float]]:
    """([{module: mean|act|} per step], [loss per step]) over `steps` forward passes of AdamW
    on (x, y); step 1 is the forward pass at init."""
    model = built.model
    model.train()
    opt = torch.optim.AdamW(optimizer_groups(model, built.table), betas=(0.9, 0.95))
    recorder = _Recorder(model)
    per_step: list[dict[str, float]] = []
    loss_curve: list[float] = []
    try:
        for t in range(1, steps + 1):
            logits = model(x)
            per_step.append(recorder.take())
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss_curve.append(float(loss.detach()))
            if t == steps:
                break  # the last recorded forward needs no update after it
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            built.after_step()
    finally:
        recorder.remove()
    return per_step, loss_curve
