"""Pre-LN decoder-only GPT with optional modded-nanogpt x0 mixing and value embeddings.

Parameter names are part of the contract with `parameterization.py`, which claims every
parameter by name; a new layer without a rule fails fast there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ForwardMultipliers, ModelConfig
from .layers import (
    Embedding,
    LayerNorm,
    Linear,
    Rotary,
    alibi_bias,
    attention,
    fused_qkv,
    member_view,
    relu_squared,
    residual_add,
)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, mult: ForwardMultipliers, uses_value_embed: bool):
        super().__init__()
        n = cfg.width
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.q = Linear(n, n, bias=cfg.bias)
        self.k = Linear(n, n, bias=cfg.bias)
        self.v = Linear(n, n, bias=cfg.bias)
        self.proj = Linear(n, n, bias=cfg.bias)
        self.scale = mult.attn_scale if mult.attn_scale is not None else cfg.head_dim**-0.5
        self.position = cfg.position
        if uses_value_embed:
            # v = lambda0 * v + lambda1 * ve; init (1, 0) so the block starts as plain GPT
            self.ve_lambdas = nn.Parameter(torch.tensor([1.0, 0.0]))
        else:
            self.ve_lambdas = None

    def forward(
        self, x: torch.Tensor, rotary: Rotary | None, ve: torch.Tensor | None
    ) -> torch.Tensor:
        *lead, t, n = x.shape  # lead: (batch,), or (members, batch) in a pack
        qkv = fused_qkv(x, self.q, self.k, self.v, self.n_heads)
        if self.position == "rope":
            q, k, v = rotary.turn_qk(qkv)
        else:
            q, k, v = qkv.unbind(-3)
        if self.ve_lambdas is not None and ve is not None:
            lam0, lam1 = (member_view(lam, v, 0) for lam in self.ve_lambdas.unbind(-1))
            v = lam0 * v + lam1 * ve.view_as(v)
        q, k, v = q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2)  # (.., heads, t, d)
        bias = None if self.position == "rope" else alibi_bias(self.n_heads, t, x.device,
                                                               q.dtype)
        y = attention(q, k, v, self.scale, bias)
        return self.proj(y.transpose(-3, -2).reshape(*lead, t, n))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.width
        self.up = Linear(cfg.width, hidden, bias=cfg.bias)
        self.down = Linear(hidden, cfg.width, bias=cfg.bias)
        self.activation = cfg.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)  # fresh, read by nothing else: the activation may overwrite it
        h = relu_squared(h, in_place=True) if self.activation == "relu2" else F.gelu(h)
        return self.down(h)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, mult: ForwardMultipliers, uses_value_embed: bool):
        super().__init__()
        self.ln_attn = LayerNorm(cfg.width)
        self.attn = Attention(cfg, mult, uses_value_embed)
        self.ln_mlp = LayerNorm(cfg.width)
        self.mlp = MLP(cfg)
        self.residual = mult.residual

    def forward(self, x: torch.Tensor, rotary: Rotary | None, ve: torch.Tensor | None):
        x = residual_add(x, self.attn(self.ln_attn(x), rotary, ve), self.residual)
        return residual_add(x, self.mlp(self.ln_mlp(x)), self.residual)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, mult: ForwardMultipliers | None = None):
        super().__init__()
        mult = mult or ForwardMultipliers()
        self.cfg, self.mult = cfg, mult
        n, v = cfg.width, cfg.vocab_size
        self.embed = Embedding(v, n)
        self.extra_embeds = nn.ModuleList(Embedding(v, n) for _ in range(cfg.extra_embeddings))
        self.value_embeds = nn.ModuleList(Embedding(v, n) for _ in range(cfg.value_embeddings))
        self.ve_layer = self._value_embedding_layout(cfg)
        self.blocks = nn.ModuleList(
            Block(cfg, mult, uses_value_embed=i in self.ve_layer) for i in range(cfg.depth)
        )
        if cfg.x0_mixing:
            # per block: [residual, x00, x01..x0k]; init [1, 0, ...]: plain GPT on the
            # RMS-normed embedding (x00, like the extra tables, enters normed)
            lambdas = torch.zeros(cfg.depth, 2 + cfg.extra_embeddings)
            lambdas[:, 0] = 1.0
            self.x0_lambdas = nn.Parameter(lambdas)
        else:
            self.x0_lambdas = None
        self.ln_final = LayerNorm(n)
        self.unembed = Linear(n, v, bias=False)
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_base)

    @staticmethod
    def _value_embedding_layout(cfg: ModelConfig) -> dict[int, int]:
        """Block index -> value-embedding table: table j feeds block j and block L-1-j."""
        layout: dict[int, int] = {}
        for j in range(cfg.value_embeddings):
            layout[j] = j
            layout[cfg.depth - 1 - j] = j
        return layout

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab); (K, B, T) -> (K, B, T, vocab) packed."""
        n = self.cfg.width
        x = x00 = self.embed(idx)
        if self.x0_lambdas is not None:  # modded-nanogpt: x = x00 = norm(embed(tokens))
            x = x00 = F.rms_norm(x00, (n,))
        extras = [F.rms_norm(e(idx), (n,)) for e in self.extra_embeds]
        ves = [e(idx) for e in self.value_embeds]
        for i, block in enumerate(self.blocks):
            if self.x0_lambdas is not None:
                lam = [member_view(c, x, 0) for c in self.x0_lambdas[..., i, :].unbind(-1)]
                x = lam[0] * x + lam[1] * x00
                for j, extra in enumerate(extras):
                    x = x + lam[2 + j] * extra
            ve = ves[self.ve_layer[i]] if i in self.ve_layer else None
            x = block(x, self.rotary, ve)
        logits = self.unembed(self.ln_final(x))
        # x * 1.0 is x exactly: skip the pass (and its backward) over the largest activation
        return logits if self.mult.logits == 1.0 else logits * self.mult.logits
