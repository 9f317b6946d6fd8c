"""SP, muP, depth-alpha and CompleteP as plain numbers (Table 1 of Dey et al., 2025).

`param_table(model_cfg, parameterization)` turns (preset or alpha, width, depth, base shape,
base HPs) into per-group init, lr, weight decay and AdamW eps, plus the forward multipliers.
Every parameter must be claimed by exactly one rule, by name; an unclaimed or doubly claimed
parameter raises, so a new layer can never silently get the wrong rule.

Rules beyond the table (named, so they show up in every trial's group table):
- ``extra_embedding``: modded-nanogpt's extra input tables are input embeddings, so they take
  the embedding row (init sigma, LR eta, eps eps_base) - their fan-in is the vocabulary, which
  does not grow with width or depth.
- ``value_embedding``: an embedding row is looked up like a bias (a vector-like parameter,
  fan-in 1), and these tables feed the values inside a residual branch; so they take the
  hidden-bias LR (eta * m_L^(alpha-1)) and the residual-block eps, with the embedding init.
- ``mixing_scalars``: the x0 / value-embedding lambdas are width-independent scalars outside
  the branches: LR eta, eps_base, no weight decay (as modded-nanogpt, own group, no WD).
- LayerNorm gains start at 1 and biases at 0 (the table's sigma^2 row for LayerNorm is a
  no-op in the reference implementations); weight decay is applied to matrices only.
- nGPT has its own scheme (``ngpt``): every matrix is projected back to the unit sphere after
  each step, so width-scaled init variance and weight decay have nothing to act on; all
  groups get LR eta, no weight decay, eps_base. SP/muP/alpha on nGPT is rejected.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from .config import PRESETS, ForwardMultipliers, ModelConfig

if TYPE_CHECKING:  # torch at use: a spec validates without it (`hpt train bad.yaml`: 4 s less)
    import torch
    from torch import nn

PRESET_ALPHA = {"depth_mup": 0.5, "completep": 1.0}


class ParameterizationError(ValueError):
    """Bad parameterization settings, an invalid arch pairing, or an unclaimed parameter."""


@dataclass(frozen=True)
class Parameterization:
    """A preset (or depth-alpha with alpha in [0.5, 1]) and the tuned base hyper-parameters."""

    name: str = "completep"
    alpha: float | None = None
    base_width: int = 256
    base_depth: int = 2
    lr: float = 2.0**-8  # eta_base
    sigma: float = 0.02  # sigma_base
    weight_decay: float = 0.0  # lambda_base
    eps: float = 1e-12  # epsilon_base

    def __post_init__(self) -> None:
        problems = []
        if self.name not in PRESETS:
            problems.append(f"parameterization must be one of {PRESETS}, got {self.name!r}")
        elif self.name == "depth_alpha":
            if self.alpha is None or not 0.5 <= float(self.alpha) <= 1.0:
                problems.append(f"depth_alpha needs alpha in [0.5, 1], got {self.alpha}")
        elif self.alpha is not None and PRESET_ALPHA.get(self.name) != self.alpha:
            problems.append(
                f"alpha is only set with parameterization 'depth_alpha' "
                f"(got alpha={self.alpha} with {self.name!r})"
            )
        for key in ("base_width", "base_depth", "lr", "sigma", "eps"):
            value = getattr(self, key)
            if not (value > 0 and math.isfinite(value)):
                problems.append(f"{key} must be a positive finite number, got {value}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            problems.append(f"weight_decay must be >= 0, got {self.weight_decay}")
        if problems:
            raise ParameterizationError("; ".join(problems))

    @property
    def kind(self) -> str:
        """'sp', 'mup', 'alpha' or 'ngpt'."""
        if self.name in ("sp", "mup", "ngpt"):
            return self.name
        return "alpha"

    @property
    def depth_alpha(self) -> float | None:
        if self.kind != "alpha":
            return None
        return float(self.alpha if self.alpha is not None else PRESET_ALPHA[self.name])

    def label(self) -> str:
        return f"depth_alpha({self.alpha:g})" if self.name == "depth_alpha" else self.name


@dataclass(frozen=True)
class ParamGroup:
    name: str
    params: list[str]
    init: str  # normal | layernorm | zeros | as_constructed (see apply_init)
    init_std: float | None
    lr: float
    weight_decay: float
    eps: float


@dataclass(frozen=True)
class ParamTable:
    """What a trial logs: the groups, the forward multipliers and the width/depth ratios."""

    parameterization: str
    alpha: float | None
    m_width: float
    m_depth: float
    groups: list[ParamGroup]
    multipliers: ForwardMultipliers
    notes: list[str] = field(default_factory=list)

    def group(self, name: str) -> ParamGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["multipliers"] = asdict(self.multipliers)
        return d

    def format_text(self) -> str:
        m = self.multipliers
        head = (
            f"parameterization {self.parameterization}  alpha={self.alpha}  "
            f"m_N={self.m_width:g}  m_L={self.m_depth:g}\n"
            f"forward: residual x{m.residual:.6g}  logits x{m.logits:.6g}  "
            f"attn scale {m.attn_scale:.6g}\n"
        )
        rows = [f"{'group':<17}{'#':>4} {'init':<15}{'lr':>12}{'wd':>10}{'eps':>11}"]
        for g in self.groups:
            init = g.init if g.init_std is None else f"normal({g.init_std:.4g})"
            rows.append(
                f"{g.name:<17}{len(g.params):>4} {init:<15}{g.lr:>12.4e}"
                f"{g.weight_decay:>10.4g}{g.eps:>11.3e}"
            )
        return head + "\n".join(rows) + ("\n" + "\n".join(self.notes) if self.notes else "")


@dataclass(frozen=True)
class _Rule:
    name: str
    pattern: str
    init: str
    init_std: float | None
    lr: float
    weight_decay: float
    eps: float


def _gpt_rules(p: Parameterization, m_n: float, m_l: float) -> list[_Rule]:
    eta, sigma, lam, eps = p.lr, p.sigma, p.weight_decay, p.eps
    if p.kind == "sp":
        hidden_std, hidden_lr, bias_lr, ln_lr, hidden_wd, block_eps = sigma, eta, eta, eta, lam, eps
    elif p.kind == "mup":
        hidden_std, hidden_lr, bias_lr, ln_lr = sigma / math.sqrt(m_n), eta / m_n, eta, eta
        hidden_wd, block_eps = lam * m_n, eps / m_n
    else:
        a = p.depth_alpha
        depth_lr = m_l ** (a - 1.0)
        hidden_std, hidden_lr = sigma / math.sqrt(m_n), eta / m_n * depth_lr
        bias_lr = ln_lr = eta * depth_lr
        hidden_wd, block_eps = lam * m_n, eps / m_n * m_l ** (-a)
    block = r"blocks\.\d+\."
    linears = r"(attn\.(q|k|v|proj)|mlp\.(up|down))"
    return [
        _Rule("embedding", r"embed\.weight", "normal", sigma, eta, lam, eps),
        _Rule("extra_embedding", r"extra_embeds\.\d+\.weight", "normal", sigma, eta, lam, eps),
        _Rule("value_embedding", r"value_embeds\.\d+\.weight", "normal", sigma, bias_lr, lam,
              block_eps),
        _Rule("pre_ln", block + r"ln_(attn|mlp)\.(weight|bias)", "layernorm", None, ln_lr, 0.0,
              block_eps),
        _Rule("hidden_weight", block + linears + r"\.weight", "normal", hidden_std, hidden_lr,
              hidden_wd, block_eps),
        _Rule("hidden_bias", block + linears + r"\.bias", "zeros", None, bias_lr, 0.0, block_eps),
        _Rule("mixing_scalars", r"x0_lambdas|" + block + r"attn\.ve_lambdas", "as_constructed",
              None, eta, 0.0, eps),
        _Rule("final_ln", r"ln_final\.(weight|bias)", "layernorm", None, eta, 0.0, eps),
        _Rule("unembedding", r"unembed\.weight", "normal", sigma, eta, lam, eps),
    ]


def _ngpt_rules(p: Parameterization) -> list[_Rule]:
    eta, sigma, eps = p.lr, p.sigma, p.eps
    block = r"blocks\.\d+\."
    scales = r"(attn\.s_qk|mlp\.s_u|mlp\.s_v|alpha_attn|alpha_mlp)"
    return [
        _Rule("embedding", r"embed\.weight", "normal", sigma, eta, 0.0, eps),
        _Rule("hidden_weight", block + r"(attn\.(q|k|v|proj)|mlp\.(up_u|up_v|down))\.weight",
              "normal", sigma, eta, 0.0, eps),
        _Rule("scale_vectors", block + scales + r"\.weight|s_z\.weight", "as_constructed", None,
              eta, 0.0, eps),
        _Rule("unembedding", r"unembed\.weight", "normal", sigma, eta, 0.0, eps),
    ]


def check_pairing(cfg: ModelConfig, p: Parameterization) -> None:
    if cfg.arch == "ngpt" and p.kind != "ngpt":
        raise ParameterizationError(
            f"arch 'ngpt' cannot use parameterization {p.label()!r}: nGPT renormalizes every "
            "matrix to the unit sphere after each step, so width/depth init and weight-decay "
            "rules have nothing to act on; use parameterization 'ngpt'"
        )
    if cfg.arch != "ngpt" and p.kind == "ngpt":
        raise ParameterizationError(
            f"parameterization 'ngpt' is only for arch 'ngpt', not {cfg.arch!r}; "
            "use sp, mup, depth_mup, completep or depth_alpha"
        )


def forward_multipliers(cfg: ModelConfig, p: Parameterization) -> ForwardMultipliers:
    check_pairing(cfg, p)
    m_n, m_l = cfg.width / p.base_width, cfg.depth / p.base_depth
    if p.kind == "ngpt":
        return ForwardMultipliers(residual=1.0, logits=1.0, attn_scale=math.sqrt(cfg.head_dim))
    if p.kind == "sp":
        return ForwardMultipliers(residual=1.0, logits=1.0, attn_scale=cfg.head_dim**-0.5)
    residual = 1.0 if p.kind == "mup" else m_l ** (-p.depth_alpha)
    # muP and alpha-modes use 1/d_head attention (as the reference implementation)
    return ForwardMultipliers(residual=residual, logits=1.0 / m_n, attn_scale=1.0 / cfg.head_dim)


def param_table(
    cfg: ModelConfig, p: Parameterization, param_names: Iterable[str]
) -> ParamTable:
    """Assign every parameter name to exactly one rule and return the numbers per group."""
    check_pairing(cfg, p)
    m_n, m_l = cfg.width / p.base_width, cfg.depth / p.base_depth
    rules = _ngpt_rules(p) if p.kind == "ngpt" else _gpt_rules(p, m_n, m_l)
    claimed: dict[str, list[str]] = {r.name: [] for r in rules}
    for name in param_names:
        owners = [r.name for r in rules if re.fullmatch(r.pattern, name)]
        if not owners:
            raise ParameterizationError(
                f"unhandled parameter {name!r}: no {p.label()} rule claims it; "
                "add a rule in hptransfer/models/parameterization.py"
            )
        if len(owners) > 1:
            raise ParameterizationError(f"parameter {name!r} is claimed by {owners}")
        claimed[owners[0]].append(name)
    groups = [
        ParamGroup(r.name, claimed[r.name], r.init, r.init_std, r.lr, r.weight_decay, r.eps)
        for r in rules
        if claimed[r.name]
    ]
    notes = []
    if p.kind == "ngpt":
        notes.append(
            "ngpt: matrices renormalized to unit norm after every step; residual strength is "
            "the learned eigen learning rates alpha_A/alpha_M, logit scale the learned s_z"
        )
    return ParamTable(
        parameterization=p.label(),
        alpha=p.depth_alpha,
        m_width=m_n,
        m_depth=m_l,
        groups=groups,
        multipliers=forward_multipliers(cfg, p),
        notes=notes,
    )


def apply_init(model: nn.Module, table: ParamTable, generator: torch.Generator) -> None:
    """Initialise every parameter as its group says (deterministic for a given generator)."""
    import torch

    params = dict(model.named_parameters())
    with torch.no_grad():
        for g in table.groups:
            for name in g.params:
                t = params[name]
                if g.init == "normal":
                    t.copy_(torch.randn(t.shape, generator=generator) * g.init_std)
                elif g.init == "zeros":
                    t.zero_()
                elif g.init == "layernorm":
                    t.fill_(1.0 if name.endswith("weight") else 0.0)
                # as_constructed: the module's constructor already set the documented init


def optimizer_groups(model: nn.Module | Mapping[str, torch.Tensor],
                     table: ParamTable) -> list[dict]:
    """AdamW param groups carrying the table's lr / weight_decay / eps as plain numbers.
    `model`: a model, or its parameters by name (a packed member's, workers/pack.py)."""
    params = dict(model) if isinstance(model, Mapping) else dict(model.named_parameters())
    return [
        {
            "params": [params[n] for n in g.params],
            "lr": g.lr,
            "initial_lr": g.lr,  # the schedule multiplies this
            "weight_decay": g.weight_decay,
            "eps": g.eps,
            "name": g.name,
        }
        for g in table.groups
    ]
