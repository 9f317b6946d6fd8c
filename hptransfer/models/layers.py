"""Position encodings shared by the architectures (pure torch)."""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator

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

    @staticmethod
    def vmap(info, in_dims, x):  # noqa: ANN001, ANN205 (torch.func's signature)
        """Elementwise: apply to the stacked tensor as it is (packed trials). The generated
        rule (generate_vmap_rule) re-traced forward and backward per call: 6x slower."""
        return _ReluSquared.apply(x), (in_dims[0], in_dims[0])


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    return _ReluSquared.apply(x)[0]


def residual_add(x: torch.Tensor, branch: torch.Tensor, scale: float) -> torch.Tensor:
    """x + scale * branch in one op (no separate multiply; none at all when scale is 1)."""
    return x + branch if scale == 1.0 else torch.add(x, branch, alpha=scale)


# set by the packed trainer on the CPU while it runs the model under vmap (see attention())
_FOLD_VMAP_ATTENTION = contextvars.ContextVar("fold_vmap_attention", default=False)


@contextlib.contextmanager
def vmapped_attention() -> Iterator[None]:
    """Within: attention() is being called under torch.func.vmap on the CPU (packed trials)."""
    token = _FOLD_VMAP_ATTENTION.set(True)
    try:
        yield
    finally:
        _FOLD_VMAP_ATTENTION.reset(token)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """Causal scaled dot-product attention, (..., heads, T, d); `bias`: an additive (heads,
    T, T) mask that replaces the causal flag (ALiBi)."""
    # torch.compile (CUDA only) cannot trace ContextVar.get: asking would break the graph at
    # every layer; the fold is for packed trials on the CPU, which never compile
    if not torch.compiler.is_compiling() and _FOLD_VMAP_ATTENTION.get():
        return _VmapAttention.apply(q, k, v, bias, scale)
    return _sdpa(q, k, v, bias, scale)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
          scale: float) -> torch.Tensor:
    if bias is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)


class _VmapAttention(torch.autograd.Function):
    """SDPA with a vmap rule: the CPU flash kernel has none, so vmap would run it once per
    packed member (and copy); this folds the vmapped dim into the batch dim and calls SDPA
    once on the stacked tensors, where autograd records SDPA's own backward. Outside vmap
    (not used there) forward/backward are plain SDPA, the backward by recomputation."""

    @staticmethod
    def forward(q, k, v, bias, scale):  # noqa: ANN001, ANN205
        return _sdpa(q, k, v, bias, scale)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
        q, k, v, bias, scale = inputs
        ctx.save_for_backward(q, k, v)
        ctx.bias, ctx.scale = bias, scale

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_() for t in ctx.saved_tensors)
            out = _sdpa(q, k, v, ctx.bias, ctx.scale)
            return (*torch.autograd.grad(out, (q, k, v), grad), None, None)

    @staticmethod
    def vmap(info, in_dims, q, k, v, bias, scale):  # noqa: ANN001, ANN205
        if in_dims[3] is not None:  # a per-member mask: not how the models call it
            raise NotImplementedError("attention(): the mask cannot differ per packed member")
        size = info.batch_size
        q, k, v = (t.movedim(d, 0) if d is not None else t.expand(size, *t.shape)
                   for t, d in zip((q, k, v), in_dims[:3], strict=True))
        # (members, batch, heads, T, d) -> (members * batch, heads, T, d): one kernel call
        out = _sdpa(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), bias, scale)
        return out.unflatten(0, (size, -1)), 0
