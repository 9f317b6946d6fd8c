"""build_model: model fields of a trial spec -> initialised model + its parameterization table."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .config import ModelConfig, ModelConfigError
from .gpt import GPT
from .ngpt import NGPT
from .parameterization import (
    Parameterization,
    ParamTable,
    apply_init,
    forward_multipliers,
    param_table,
)


@dataclass
class BuiltModel:
    model: nn.Module
    table: ParamTable
    config: ModelConfig
    parameterization: Parameterization

    def after_step(self) -> None:
        """Hook the trainer calls after every optimizer step (nGPT renormalization)."""
        if isinstance(self.model, NGPT):
            self.model.normalize_matrices()


def build_model(
    arch: str = "gpt",
    width: int = 256,
    depth: int = 2,
    parameterization: str = "completep",
    alpha: float | None = None,
    *,
    head_dim: int = 64,
    vocab_size: int = 256,
    max_seq_len: int = 1024,
    base_width: int = 256,
    base_depth: int = 2,
    lr: float = 2.0**-8,
    sigma: float = 0.02,
    weight_decay: float = 0.0,
    eps: float = 1e-12,
    seed: int = 0,
    device: str | torch.device = "cpu",
    **arch_options,
) -> BuiltModel:
    """Build and initialise a model; ``arch_options`` are the other ModelConfig fields
    (activation, position, bias, mlp_ratio, x0_mixing, extra_embeddings, value_embeddings).
    """
    cfg = ModelConfig(
        arch=arch, width=width, depth=depth, head_dim=head_dim, vocab_size=vocab_size,
        max_seq_len=max_seq_len, **arch_options,
    )
    p = Parameterization(
        name=parameterization, alpha=alpha, base_width=base_width, base_depth=base_depth,
        lr=lr, sigma=sigma, weight_decay=weight_decay, eps=eps,
    )
    return build_from_config(cfg, p, seed=seed, device=device)


def build_from_config(
    cfg: ModelConfig, p: Parameterization, seed: int = 0, device: str | torch.device = "cpu"
) -> BuiltModel:
    problem = cfg.build_problem()
    if problem:
        raise ModelConfigError(problem)
    mult = forward_multipliers(cfg, p)  # also rejects invalid arch x parameterization pairs
    model = NGPT(cfg) if cfg.arch == "ngpt" else GPT(cfg, mult)
    table = param_table(cfg, p, (n for n, _ in model.named_parameters()))
    apply_init(model, table, torch.Generator().manual_seed(seed))
    built = BuiltModel(model.to(device), table, cfg, p)
    built.after_step()  # nGPT: unit-norm matrices before step 0
    return built


def table_for(cfg: ModelConfig, p: Parameterization) -> ParamTable:
    """The group table without allocating weights (built on the meta device)."""
    mult = forward_multipliers(cfg, p)
    with torch.device("meta"):
        model = NGPT(cfg) if cfg.arch == "ngpt" else GPT(cfg, mult)
    return param_table(cfg, p, (n for n, _ in model.named_parameters()))
