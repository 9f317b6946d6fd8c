"""Position encodings shared by the architectures (pure torch)."""

from __future__ import annotations

import math

import torch


class Rotary(torch.nn.Module):
    """Standard rotary embedding (RoFormer): rotates pairs (i, i + d/2) by position * freq_i.

    Norm-preserving and relative, unlike the official nGPT code's variant.
    """

    def __init__(self, head_dim: int, max_seq_len: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
        # buffers are not parameters, so no parameterization rule needs to claim them
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, heads, T, head_dim)."""
        t = x.shape[-2]
        cos = self.cos[:t].to(x.dtype)
        sin = self.sin[:t].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def alibi_bias(n_heads: int, t: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Causal ALiBi additive bias (heads, T, T): -slope_h * distance, -inf above the diagonal."""
    # geometric slopes 2^(-8 i / H) as in Press et al.; exact for powers of two
    slopes = torch.tensor(
        [2.0 ** (-8.0 * (i + 1) / n_heads) for i in range(n_heads)], device=device
    )
    pos = torch.arange(t, device=device)
    distance = (pos[:, None] - pos[None, :]).clamp(min=0).float()
    bias = -slopes[:, None, None] * distance
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    return bias.masked_fill(~causal, -math.inf).to(dtype)
