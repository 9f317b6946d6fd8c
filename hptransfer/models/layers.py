"""Layers shared by the architectures (pure torch), written once for one trial and for packs.

Packed trials (workers/pack.py) stack K members' parameters on a new leading axis and run
the same model code once, on inputs with that member axis in front: (K, batch, T, ...). Every
parameter is used through the helpers below, which take a plain parameter or a stacked one
(one more dimension than its natural rank); with plain parameters they are the ordinary
torch calls, so a single trial computes exactly what it always did.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import small_heads  # the rule, with its measurements


def member_view(p: torch.Tensor, like: torch.Tensor, rank: int) -> torch.Tensor:
    """`p` (natural rank `rank`) ready to broadcast against `like`: a plain p as it is, a
    stacked one (K, *p) as (K, 1, ..., 1, *p) with like's number of dimensions."""
    if p.dim() == rank:
        return p
    return p.view(p.shape[0], *(1,) * (like.dim() - p.dim()), *p.shape[1:])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; a stacked weight (K, out, in) applies member k's matrix to x[k]: one bmm."""
    if weight.dim() == 2:
        return F.linear(x, weight, bias)
    k = weight.shape[0]
    flat = x.reshape(k, -1, x.shape[-1])  # (K, rows, in): the member's tokens in one matmul
    if bias is None:
        y = torch.bmm(flat, weight.transpose(1, 2))
    else:
        y = torch.baddbmm(bias.unsqueeze(1), flat, weight.transpose(1, 2))
    return y.view(*x.shape[:-1], weight.shape[1])


def embedding(idx: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.embedding; a stacked table (K, vocab, d) looks idx[k] up in member k's table."""
    if weight.dim() == 2:
        return F.embedding(idx, weight)
    k, vocab = weight.shape[:2]
    # one lookup in the K tables laid end to end: member k's ids offset by k * vocab
    offsets = torch.arange(0, k * vocab, vocab, device=idx.device)
    return F.embedding(idx + offsets.view(k, *(1,) * (idx.dim() - 1)), weight.flatten(0, 1))


class Linear(nn.Linear):
    """nn.Linear (same parameters, names and init) that also runs stacked weights."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    """nn.Embedding (same parameters, names and init) that also runs a stacked table."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return embedding(idx, self.weight)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same parameters, names and init) that also runs stacked gains/biases."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None or self.weight.dim() == 1:
            return super().forward(x)
        y = F.layer_norm(x, self.normalized_shape, None, None, self.eps)
        gain = member_view(self.weight, x, 1)
        return y * gain if self.bias is None else torch.addcmul(member_view(self.bias, x, 1),
                                                                y, gain)


class Rotary(torch.nn.Module):
    """Rotary position embedding as RoFormer (Su et al. 2021, eq. 34) writes it: each pair of
    adjacent dimensions (2i, 2i + 1) turned by the angle position * base^(-2i / d).

    Norm-preserving and relative, unlike the official nGPT code's variant. Adjacent pairs make
    the turn one complex multiply per element, forward and backward, where halves (i, i + d/2)
    take x * cos + swap(x) * sin (three passes and more back). On this project's Xeon CPU
    host that took the rotation of q and k from 9.0 to 2.7 ms per forward and backward at
    (8, 128, 2, 8, 64), about a single multiply's cost. The two pairings are the same model up
    to a fixed relabelling of q's and k's output rows, which their i.i.d. init cannot tell
    apart. Under torch.compile, in half precision (torch has no complex bfloat16) or for
    strides a complex view cannot take, the same products in real arithmetic; on the CPU both
    give the same bits (`tests/test_models.py`).
    """

    def __init__(self, head_dim: int, max_seq_len: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
        # (T, d/2) tables; buffers are not parameters, so no parameterization rule claims them
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        self.register_buffer("turns", torch.complex(self.cos, self.sin), persistent=False)

    def forward(self, x: torch.Tensor, seq_dim: int = -2) -> torch.Tensor:
        """x: (..., T, ..., head_dim) with T at `seq_dim` (negative), e.g. (batch, heads, T,
        head_dim) with the default, or (batch, T, 2, heads, head_dim) with -4 for q and k at
        once."""
        t, half = x.shape[seq_dim], x.shape[-1] // 2
        shape = (t,) + (1,) * (-seq_dim - 2) + (half,)
        pairs = x.unflatten(-1, (half, 2))
        if _complex_view_fits(x):
            turned = torch.view_as_complex(pairs) * self.turns[:t].view(shape)
            return torch.view_as_real(turned).flatten(-2)
        cos = self.cos[:t].to(x.dtype).view(shape)
        sin = self.sin[:t].to(x.dtype).view(shape)
        even, odd = pairs.unbind(-1)
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)

    def turn_qk(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v of `fused_qkv`'s (..., T, 3, heads, head_dim), q and k turned.

        qkv must be a Linear's fresh output that nothing else reads: where it can, the turn
        overwrites it (see _TurnQKInPlace). Elsewhere (traced, bf16, odd strides) q and k
        are turned into a new tensor. Both give the same bits (tests/test_models.py)."""
        # the complex check first: it says no while tracing, where _whole_base would break
        if _complex_view_fits(qkv) and (base := _whole_base(qkv)) is not None:
            t = qkv.shape[-4]
            turns = self.turns[:t].view(t, 1, 1, qkv.shape[-1] // 2)
            return _TurnQKInPlace.apply(base, turns, qkv.shape).view(qkv.shape).unbind(-3)
        qk, v = qkv.split((2, 1), dim=-3)  # split/unbind: no zero-filled slice gradients
        q, k = self(qk, seq_dim=-4).unbind(-3)
        return q, k, v.squeeze(-3)


class _TurnQKInPlace(torch.autograd.Function):
    """Turns the q and k thirds of a fresh q/k/v matmul output in place, as complex numbers,
    and the gradient back the same way. Out of place, autograd builds a new tensor for the
    turned q and k and, backward, stacks their gradients, turns them into a third tensor and
    concatenates that with v's; here the forward writes nothing new and the backward turns
    the gradient that unbind's backward stacked for this node alone, in place. The same
    values and gradients to the bit; attention's forward and backward 1.04-1.10x faster at
    widths 512-128 (head_dim 64, batch 8 x 128 tokens, one thread, Xeon host)."""

    @staticmethod
    def forward(ctx, base: torch.Tensor, turns: torch.Tensor,  # noqa: ANN001
                shape: torch.Size) -> torch.Tensor:
        _qk_pairs(base, shape).mul_(turns)
        ctx.mark_dirty(base)
        ctx.save_for_backward(turns)
        ctx.shape = shape
        return base

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # noqa: ANN001
        (turns,) = ctx.saved_tensors
        grad = grad.contiguous()  # unbind's stack already is: no copy
        _qk_pairs(grad, ctx.shape).mul_(turns.conj())
        return grad, None, None


def _qk_pairs(base: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The complex view of the q and k thirds of `base` laid out as `shape`, (..., T, 3,
    heads, head_dim): (..., T, 2, heads, head_dim / 2) complex numbers."""
    pairs = base.view(*shape[:-1], shape[-1] // 2, 2)
    return torch.view_as_complex(pairs.narrow(-4, 0, 2))


def _whole_base(x: torch.Tensor) -> torch.Tensor | None:
    """The tensor x's memory belongs to, when x covers all of it in its own order: x itself
    when it is no view, or the base of a reshaped view of a whole tensor (a pack's batched
    matmul viewed per member). None otherwise. An op in place on that tensor changes x and
    nothing else; autograd would copy a view's gradient (CopySlices) for one on x itself."""
    if not x._is_view():
        return x
    base = x._base
    if base._is_view() or not _same_memory_in_order(x, base):
        return None
    return base


def _complex_view_fits(x: torch.Tensor) -> bool:
    """Whether `Rotary` turns x as complex numbers: eager fp32/fp64, pairs contiguous."""
    return (not torch.compiler.is_compiling() and x.dtype in (torch.float32, torch.float64)
            and x.stride(-1) == 1 and x.storage_offset() % 2 == 0
            and all(stride % 2 == 0 for stride in x.stride()[:-1]))


def fused_qkv(x: torch.Tensor, q: nn.Linear, k: nn.Linear, v: nn.Linear,
              n_heads: int) -> torch.Tensor:
    """(..., T, width) -> (..., T, 3, heads, head_dim): q, k and v in one matmul.

    They stay three Linear modules (their names, init and optimizer groups are the
    parameterization's contract); one matmul on the concatenated weights is faster than
    three at the small widths a sweep trains, and rotary then rotates q and k together."""
    weight = torch.cat((q.weight, k.weight, v.weight), dim=-2)  # the out axis, stacked or not
    bias = None if q.bias is None else torch.cat((q.bias, k.bias, v.bias), dim=-1)
    return linear(x, weight, bias).view(*x.shape[:-1], 3, n_heads, -1)


def alibi_bias(n_heads: int, t: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Causal ALiBi additive bias (heads, T, T): -slope_h * distance, -inf above the diagonal."""
    # geometric slopes 2^(-8 i / H) as in Press et al.; exact for powers of two. Made on the
    # device (float64, then float32: Python's 2.0 ** x to the bit): a table copied from the
    # host would make every forward on CUDA wait for the queued kernels
    i = torch.arange(1, n_heads + 1, dtype=torch.float64, device=device)
    slopes = torch.exp2(-8.0 * i / n_heads).float()
    pos = torch.arange(t, device=device)
    distance = (pos[:, None] - pos[None, :]).clamp(min=0).float()
    bias = -slopes[:, None, None] * distance
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    return bias.masked_fill(~causal, -math.inf).to(dtype)


class _ReluSquared(torch.autograd.Function):
    """relu(x)^2 with a one-pass backward (2 relu(x) * grad): autograd's pow + threshold
    backward of `F.relu(x).square()` is ~3x slower on the CPU, where it was a tenth of a
    width-128 training step. Same values; compiles on CUDA."""

    @staticmethod
    def forward(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = F.relu(x)
        return r * r, r

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # noqa: ANN001 (autograd's signature)
        ctx.save_for_backward(output[1])
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)  # no zeros tensor for r's (absent) gradient
        ctx.zero = output[1].new_zeros(())

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None, _grad_r: None) -> torch.Tensor | None:  # noqa: ANN001
        if grad is None:  # not materialised: the squared output took no part in the loss
            return None
        (r,) = ctx.saved_tensors
        return _doubled_product(ctx.zero, grad, r)


class _ReluSquaredInPlace(torch.autograd.Function):
    """The same values and gradient to the bit, with one new activation-sized buffer (the
    output) instead of three: relu in place on x, and the backward written into the saved
    relu(x). For x that nothing else reads, such as a Linear's fresh output. Autograd still
    guards it: had an op saved x, or were the graph run backward twice, it raises "modified by
    an inplace operation" instead of computing with the spent buffer. On this project's Xeon
    CPU host (one thread, steps interleaved with the out-of-place version in one process), a
    whole training step ran 1.01-1.03x faster at 128 x 2 to 512 x 2."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
        r = x.clamp_min_(0.0)  # F.relu(x), in place
        ctx.mark_dirty(r)
        ctx.mark_non_differentiable(r)
        ctx.save_for_backward(r)
        ctx.set_materialize_grads(False)  # no zero-filled gradient for r, which has none
        ctx.zero = r.new_zeros(())
        return r * r, r

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None, _grad_r: None) -> torch.Tensor | None:  # noqa: ANN001
        if grad is None:
            return None
        (r,) = ctx.saved_tensors
        return _doubled_product(ctx.zero, r, grad, out=r)  # r * grad is grad * r


def _doubled_product(zero: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """2 * a * b in one pass over memory (a product, then doubling, took two): 0 + 2 a b with
    a broadcast zero. Doubling is exact, so the values are those of (a * b) * 2; only the
    sign of an exact zero can differ (+0 where a * b was -0). The relu² backward on
    (8, 128, 1024), one thread on the Xeon host: 0.43 against 0.64 ms in place."""
    return torch.addcmul(zero, a, b, value=2.0, out=out)


def relu_squared(x: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """relu(x)^2; `in_place`: x may be overwritten (nothing else reads it). A traced graph
    takes the out-of-place version (torch.compile fuses the ops anyway)."""
    base = _whole_base(x) if in_place and not torch.compiler.is_compiling() else None
    if base is None:
        return _ReluSquared.apply(x)[0]
    return _ReluSquaredInPlace.apply(base)[0].view(x.shape)


def _same_memory_in_order(x: torch.Tensor, base: torch.Tensor) -> bool:
    return (x.is_contiguous() and base.is_contiguous() and x.numel() == base.numel()
            and x.data_ptr() == base.data_ptr())


def residual_add(x: torch.Tensor, branch: torch.Tensor, scale: float) -> torch.Tensor:
    """x + scale * branch in one op (no separate multiply; none at all when scale is 1)."""
    return x + branch if scale == 1.0 else torch.add(x, branch, alpha=scale)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """Causal scaled dot-product attention, (..., heads, T, d); `bias`: an additive (heads,
    T, T) mask that replaces the causal flag (ALiBi). torch's fused kernel, except for tiny
    heads on the CPU (uses_small_head_path)."""
    if q.dim() > 4:  # packed (K, batch, ...): the members are more batch for the kernel
        out = _sdpa(q.flatten(0, -4), k.flatten(0, -4), v.flatten(0, -4), bias, scale)
        return out.view(*q.shape[:-1], v.shape[-1])
    return _sdpa(q, k, v, bias, scale)


def uses_small_head_path(q: torch.Tensor) -> bool:
    """Whether attention on `q` (..., T, head_dim) takes the explicit small-head path."""
    return q.device.type == "cpu" and small_heads(q.shape[-1], q.shape[-2])


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
          scale: float) -> torch.Tensor:
    if uses_small_head_path(q):
        return _small_head_attention(q, k, v, bias, scale)
    if bias is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)


def _small_head_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          bias: torch.Tensor | None, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v over (batch, heads, T, d) by the explicit products."""
    t = q.shape[-2]
    if bias is None:  # causal: -inf above the diagonal
        mask = torch.full((t, t), -math.inf, dtype=q.dtype, device=q.device).triu_(1)
    else:  # (heads, T, T): one copy per (batch, head), as the batched product wants
        mask = bias.expand(*q.shape[:-1], t).reshape(-1, t, t)
    out = _SmallHeadAttention.apply(q.reshape(-1, t, q.shape[-1]), k.reshape(-1, t, k.shape[-1]),
                                    v.reshape(-1, t, v.shape[-1]), mask, scale)[0]
    return out.view(*q.shape[:-1], v.shape[-1])


class _SmallHeadAttention(torch.autograd.Function):
    """Attention on (N, T, d) with every product laid out as MKL runs it fastest at tiny d:
    the T x T matrix as the right-hand operand (o^T = v^T p^T and so on), which autograd's
    own backward of `p @ v` does not do."""

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        p = torch.baddbmm(mask, q, k.transpose(1, 2), alpha=scale).softmax(dim=-1)
        return torch.bmm(v.transpose(1, 2), p.transpose(1, 2)).transpose(1, 2), p

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:  # noqa: ANN001 (autograd's signature)
        q, k, v, _, scale = inputs
        ctx.save_for_backward(q, k, v, output[1])
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)
        ctx.scale = scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None, _grad_p: None):  # noqa: ANN001, ANN205
        if grad is None:
            return None, None, None, None, None
        q, k, v, p = ctx.saved_tensors
        grad_v = torch.bmm(grad.transpose(1, 2), p).transpose(1, 2)
        grad_p = torch.bmm(grad, v.transpose(1, 2))
        # autograd's own softmax backward, p * (dp - rowsum(dp * p)), in one kernel (twice as
        # fast as those four ops); the scale of the scores goes on the (N, d, T) products
        grad_s = torch._softmax_backward_data(grad_p, p, -1, p.dtype)
        grad_q = torch.bmm(k.transpose(1, 2), grad_s.transpose(1, 2)).mul_(ctx.scale)
        grad_k = torch.bmm(q.transpose(1, 2), grad_s).mul_(ctx.scale)
        return grad_q.transpose(1, 2), grad_k.transpose(1, 2), grad_v, None, None
