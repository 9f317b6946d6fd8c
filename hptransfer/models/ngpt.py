"""nGPT: the normalized transformer (Loshchilov et al., 2024), as in shared/notes/variants.md.

Hidden state on the unit sphere; every matrix unit-norm along its d_model axis (call
`normalize_matrices()` before step 0 and after every optimizer step); learned scale vectors
use the init/scale trick (stored value starts at `scale`, used as stored * init / scale).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import Embedding, Linear, Rotary, attention, fused_qkv, member_view


def unit(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return F.normalize(x, dim=dim)


class ScaleVector(nn.Module):
    """A learned per-coordinate scale with the init/scale trick (effective value = init)."""

    def __init__(self, size: int, init: float, scale: float):
        super().__init__()
        self.init, self.scale = init, scale
        self.weight = nn.Parameter(torch.full((size,), scale))

    def forward(self, like: torch.Tensor, groups: tuple[int, ...] = ()) -> torch.Tensor:
        """The effective scale, broadcastable against `like` (one trial's or a pack's);
        `groups` splits the last axis, e.g. (heads, head_dim)."""
        value = self.weight * (self.init / self.scale)
        if groups:
            value = value.unflatten(-1, groups)
        return member_view(value, like, len(groups) or 1)


class NormalizedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, base_scale: float):
        super().__init__()
        n = cfg.width
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.q = Linear(n, n, bias=False)
        self.k = Linear(n, n, bias=False)
        self.v = Linear(n, n, bias=False)
        self.proj = Linear(n, n, bias=False)
        self.s_qk = ScaleVector(n, init=1.0, scale=base_scale)

    def forward(self, h: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        *lead, t, n = h.shape  # lead: (batch,), or (members, batch) in a pack
        qkv = fused_qkv(h, self.q, self.k, self.v, self.n_heads)  # (.., t, 3, heads, d)
        qk, v = qkv.split((2, 1), dim=-3)  # split/unbind: no zero-filled slice gradients
        # q and k rotated, normalised and scaled together: (.., t, 2, heads, d)
        qk = unit(rotary(qk, -4))
        qk = self.s_qk(qk, (self.n_heads, self.head_dim)) * qk
        q, k, v = (t_.transpose(-3, -2) for t_ in (*qk.unbind(-3), v.squeeze(-3)))
        # q, k are unit-norm per head, so the softmax scale is sqrt(d_head), not its inverse
        y = attention(q, k, v, math.sqrt(self.head_dim))
        return self.proj(y.transpose(-3, -2).reshape(*lead, t, n))


class NormalizedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        n, hidden = cfg.width, cfg.mlp_ratio * cfg.width
        self.up_u = Linear(n, hidden, bias=False)
        self.up_v = Linear(n, hidden, bias=False)
        self.down = Linear(hidden, n, bias=False)
        self.s_u = ScaleVector(hidden, init=1.0, scale=1.0)
        self.s_v = ScaleVector(hidden, init=1.0, scale=1.0)
        self.sqrt_width = math.sqrt(n)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        u = self.up_u(h)
        u = self.s_u(u) * u
        # sqrt(d_model) keeps the SiLU input in its non-linear range for unit-norm h
        v = self.up_v(h)
        v = self.s_v(v) * v * self.sqrt_width
        return self.down(u * F.silu(v))


class NormalizedBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, base_scale: float):
        super().__init__()
        self.attn = NormalizedAttention(cfg, base_scale)
        self.mlp = NormalizedMLP(cfg)
        self.alpha_attn = ScaleVector(cfg.width, init=0.05, scale=base_scale)
        self.alpha_mlp = ScaleVector(cfg.width, init=0.05, scale=base_scale)

    def forward(self, h: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        h_a = unit(self.attn(h, rotary))
        h = unit(h + self.alpha_attn(h) * (h_a - h))
        h_m = unit(self.mlp(h))
        return unit(h + self.alpha_mlp(h) * (h_m - h))


class NGPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        n, v = cfg.width, cfg.vocab_size
        self.base_scale = 1.0 / math.sqrt(n)
        self.embed = Embedding(v, n)
        self.blocks = nn.ModuleList(NormalizedBlock(cfg, self.base_scale) for _ in range(cfg.depth))
        self.unembed = Linear(n, v, bias=False)
        self.s_z = ScaleVector(v, init=1.0, scale=self.base_scale)
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_base)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)  # rows are unit-norm after normalize_matrices()
        for block in self.blocks:
            h = block(h, self.rotary)
        logits = self.unembed(h)
        return self.s_z(logits) * logits  # no final norm: h is already on the sphere

    def unit_norm_axes(self) -> dict[str, int]:
        """Parameter name -> the d_model axis that matrix is kept unit-norm along.

        (vocab, d_model) tables and (out, d_model) input projections: rows (axis 1);
        (d_model, in) output projections: columns (axis 0). Packed training stacks members on
        a new leading axis and normalises along axis + 1.
        """
        axes = {"embed.weight": 1, "unembed.weight": 1}
        for i in range(len(self.blocks)):
            for name in ("attn.q", "attn.k", "attn.v", "mlp.up_u", "mlp.up_v"):
                axes[f"blocks.{i}.{name}.weight"] = 1
            for name in ("attn.proj", "mlp.down"):
                axes[f"blocks.{i}.{name}.weight"] = 0
        return axes

    @torch.no_grad()
    def normalize_matrices(self) -> None:
        """Project every matrix back to unit norm along its d_model axis."""
        params = dict(self.named_parameters())
        for name, axis in self.unit_norm_axes().items():
            params[name].copy_(unit(params[name], dim=axis))
