"""Position encodings shared by the architectures (pure torch)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class Rotary(torch.nn.Module):
    """Standard rotary embedding (RoFormer): rotates pairs (i, i + d/2) by position * freq_i.

    Norm-preserving and relative, unlike the official nGPT code's variant.
    """

    def __init__(self, head_dim: int, max_seq_len: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
        cos, sin = angles.cos(), angles.sin()
        # full-width tables so that rotating is x * cos + swap_halves(x) * sin: three ops
        # instead of seven; buffers are not parameters, so no parameterization rule claims them
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), dim=-1), persistent=False)

    def forward(self, x: torch.Tensor, seq_dim: int = -2) -> torch.Tensor:
        """x: (..., T, ..., head_dim) with T at `seq_dim` (negative), e.g. (batch, heads, T,
        head_dim) with the default, or (batch, T, 2, heads, head_dim) with -4 for q and k at
        once."""
        t = x.shape[seq_dim]
        shape = (t,) + (1,) * (-seq_dim - 2) + (x.shape[-1],)
        cos = self.cos[:t].to(x.dtype).view(shape)
        sin = self.sin[:t].to(x.dtype).view(shape)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), sin)


def fused_qkv(x: torch.Tensor, q: torch.nn.Linear, k: torch.nn.Linear, v: torch.nn.Linear,
              n_heads: int) -> torch.Tensor:
    """(batch, T, width) -> (batch, T, 3, heads, head_dim): q, k and v in one matmul.

    They stay three Linear modules (their names, init and optimizer groups are the
    parameterization's contract); one matmul on the concatenated weights is faster than
    three at the small widths a sweep trains, and rotary then rotates q and k together."""
    weight = torch.cat((q.weight, k.weight, v.weight))
    bias = None if q.bias is None else torch.cat((q.bias, k.bias, v.bias))
    b, t, _ = x.shape
    return F.linear(x, weight, bias).view(b, t, 3, n_heads, -1)


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


class _ReluSquared(torch.autograd.Function):
    """relu(x)^2 with a two-pass backward (2 relu(x) * grad): autograd's pow + threshold
    backward of `F.relu(x).square()` is ~3x slower on the CPU, where it was a tenth of a
    width-128 training step. Same values; vmap-able (packed trials), compiles on CUDA."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = F.relu(x)
        return r * r, r

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # noqa: ANN001 (autograd's signature)
        ctx.save_for_backward(output[1])
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)  # no zeros tensor for r's (absent) gradient

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None, _grad_r: None) -> torch.Tensor | None:  # noqa: ANN001
        if grad is None:  # not materialised: the squared output took no part in the loss
            return None
        (r,) = ctx.saved_tensors
        return (grad * r).mul_(2.0)  # in place: no second large allocation


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    return _ReluSquared.apply(x)[0]


def residual_add(x: torch.Tensor, branch: torch.Tensor, scale: float) -> torch.Tensor:
    """x + scale * branch in one op (no separate multiply; none at all when scale is 1)."""
    return x + branch if scale == 1.0 else torch.add(x, branch, alpha=scale)
