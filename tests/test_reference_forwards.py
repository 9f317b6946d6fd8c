"""The models' forward passes against plain references written from the papers' equations.

The references below use nothing from `hptransfer.models` but the parameter names (the
contract with parameterization.py): `build_model` only supplies the model under test, whose
weights are perturbed off their init (x0 lambdas [1, 0, ...], value-embedding lambdas
[1, 0], zero biases and unit LayerNorm gains would hide a wrong term) and read by name.
Every equation is the one in ../shared/notes/variants.md (nGPT, x0 mixing) and
parameterizations.md (Table 1 of Dey et al., 2025: the forward multipliers), written
out op by op: explicit softmax attention with its mask, rotary pairs turned by cos/sin,
LayerNorm/RMSNorm from their formulas, no fused kernels.

Everything runs in float64 (`model.double()`), so model and reference agree to rounding:
at most 7e-16 relative on the logits and 2e-14 on any parameter's gradient when written.
RTOL (1e-9) leaves room for other BLAS builds and still sees a wrong multiplier, sign or
term by many orders of magnitude. One scale is invisible by construction: nGPT normalizes
each branch's output, so a constant factor on u (not inside the SiLU) cannot show.
"""

from __future__ import annotations

import math

import pytest
import torch

from hptransfer.models import build_model

VOCAB = 61  # not a power of two: a vocab/width mix-up cannot line up by accident
RTOL = 1e-9
F64 = torch.float64


# --------------------------------------------------------------------- shared pieces


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """modded-nanogpt's norm(): x / sqrt(mean(x^2) + eps), no gain (eps: torch's default)."""
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + torch.finfo(x.dtype).eps)


def layer_norm(x: torch.Tensor, gain: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)  # biased variance, eps 1e-5 (torch's)
    return (x - mean) / torch.sqrt(var + 1e-5) * gain + bias


def unit(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """nGPT's norm(x) = x / ||x||_2."""
    return x / x.norm(dim=dim, keepdim=True)


def rotary(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """RoFormer (Su et al., eq. 34) on (B, H, T, d): pair (2i, 2i+1) at position m turned by
    the angle m * base^(-2i/d). The model keeps one float32 table of cos/sin for every dtype,
    so in float64 its turn is float32-accurate (~1e-7); the reference takes its cos and sin
    from the same float32 arithmetic so that RTOL can stay at 1e-9 for everything else."""
    t, d = x.shape[-2], x.shape[-1]
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    angle = torch.arange(t, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angle.cos().to(F64), angle.sin().to(F64)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = even * sin + odd * cos
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     alibi: bool = False) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v on (B, H, T, d); ALiBi adds -slope_h * (i - j) with
    slopes 2^(-8 h / H), h = 1..H (Press et al.), rounded to float32 as the model's table."""
    h, t = q.shape[1], q.shape[2]
    scores = torch.einsum("bhid,bhjd->bhij", q, k) * scale
    pos = torch.arange(t)
    distance = (pos[:, None] - pos[None, :]).to(F64)
    if alibi:  # the model's table is float32 in every dtype, as its rotary table is
        slopes = (2.0 ** (-8.0 * torch.arange(1, h + 1, dtype=F64) / h)).float().to(F64)
        scores = scores - (slopes[:, None, None] * distance).float().to(F64)
    scores = scores.masked_fill(distance < 0, -math.inf)
    return torch.einsum("bhij,bhjd->bhid", scores.softmax(-1), v)


def heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(B, T, n) -> (B, H, T, head_dim)."""
    b, t, n = x.shape
    return x.view(b, t, n // head_dim, head_dim).transpose(1, 2)


def merge(y: torch.Tensor) -> torch.Tensor:
    """(B, H, T, d) -> (B, T, H * d)."""
    b, h, t, d = y.shape
    return y.transpose(1, 2).reshape(b, t, h * d)


def lin(x: torch.Tensor, p: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    y = x @ p[f"{name}.weight"].T
    return y + p[f"{name}.bias"] if f"{name}.bias" in p else y


# --------------------------------------------------------------------- GPT and x0 mixing


def table1_multipliers(param: str, alpha: float | None, width: int, depth: int,
                       base_width: int, base_depth: int, head_dim: int
                       ) -> tuple[float, float, float]:
    """(residual, logits, attention scale) from parameterizations.md: the residual branch
    m_L^(-alpha) (alpha-modes only), the unembedding forward 1/m_N (all but SP), attention
    1/d_head under muP and alpha-modes, 1/sqrt(d_head) under SP."""
    m_n, m_l = width / base_width, depth / base_depth
    a = {"depth_mup": 0.5, "completep": 1.0, "depth_alpha": alpha}.get(param)
    residual = 1.0 if a is None else m_l ** (-a)
    logits = 1.0 if param == "sp" else 1.0 / m_n
    scale = head_dim ** -0.5 if param == "sp" else 1.0 / head_dim
    return residual, logits, scale


def reference_gpt(p: dict[str, torch.Tensor], idx: torch.Tensor, *, depth: int, head_dim: int,
                  residual: float, logit_mult: float, attn_scale: float, activation: str,
                  alibi: bool, x0_mixing: bool, extra: int, value_embeddings: int
                  ) -> torch.Tensor:
    """Pre-LN GPT: x <- x + r * Attn(LN x); x <- x + r * MLP(LN x); logits = m * W_u LN(x).

    x0 mixing (modded-nanogpt): x = x00 = norm(E idx), x0j = norm(E_j idx), and before block
    i: x = lam[i,0] x + lam[i,1] x00 + sum_j lam[i,1+j] x0j. Value embeddings: table j feeds
    blocks j and L-1-j as v = lam0 v + lam1 ve (ve = VE_j idx)."""
    x = p["embed.weight"][idx]
    if x0_mixing:
        x = x00 = rms_norm(x)
        x0s = [x00] + [rms_norm(p[f"extra_embeds.{j}.weight"][idx]) for j in range(extra)]
    feeds = {}
    for j in range(value_embeddings):
        feeds[j] = feeds[depth - 1 - j] = j
    for i in range(depth):
        if x0_mixing:
            lam = p["x0_lambdas"][i]
            x = lam[0] * x + sum(lam[1 + j] * x0j for j, x0j in enumerate(x0s))
        pre = f"blocks.{i}."
        a = layer_norm(x, p[pre + "ln_attn.weight"], p[pre + "ln_attn.bias"])
        q, k, v = (heads(lin(a, p, pre + f"attn.{w}"), head_dim) for w in "qkv")
        if i in feeds:
            ve = heads(p[f"value_embeds.{feeds[i]}.weight"][idx], head_dim)
            lam0, lam1 = p[pre + "attn.ve_lambdas"]
            v = lam0 * v + lam1 * ve
        if not alibi:
            q, k = rotary(q), rotary(k)
        y = lin(merge(causal_attention(q, k, v, attn_scale, alibi)), p, pre + "attn.proj")
        x = x + residual * y
        m = lin(layer_norm(x, p[pre + "ln_mlp.weight"], p[pre + "ln_mlp.bias"]), p,
                pre + "mlp.up")
        m = torch.relu(m) ** 2 if activation == "relu2" else 0.5 * m * (
            1 + torch.erf(m / math.sqrt(2)))
        x = x + residual * lin(m, p, pre + "mlp.down")
    h = layer_norm(x, p["ln_final.weight"], p["ln_final.bias"])
    return logit_mult * (h @ p["unembed.weight"].T)


# --------------------------------------------------------------------- nGPT


def reference_ngpt(p: dict[str, torch.Tensor], idx: torch.Tensor, *, depth: int, width: int,
                   head_dim: int) -> torch.Tensor:
    """nGPT (Loshchilov et al., 2024) as variants.md states it.

    Scale vectors are used as stored * (init / scale), base_scale = 1/sqrt(d_model):
    alpha_A, alpha_M (0.05, base_scale), s_qk (1, base_scale), s_u, s_v (1, 1),
    s_z (1, base_scale). Per block:
      q, k, v = W h; q, k rotated, then s_qk * norm(.) per head; softmax scale sqrt(d_head)
      h_A = norm(W_o attn);  h <- norm(h + alpha_A * (h_A - h))
      u = s_u * W_u h;  v = s_v * W_v h * sqrt(d_model);  h_M = norm(W_down (u * SiLU(v)))
      h <- norm(h + alpha_M * (h_M - h))
    logits = s_z * (W_unembed h), no final norm."""
    base = 1.0 / math.sqrt(width)

    def eff(name: str, init: float, scale: float) -> torch.Tensor:
        return p[name] * (init / scale)

    h = p["embed.weight"][idx]
    for i in range(depth):
        pre = f"blocks.{i}."
        q, k, v = (heads(lin(h, p, pre + f"attn.{w}"), head_dim) for w in "qkv")
        s_qk = heads(eff(pre + "attn.s_qk.weight", 1.0, base).view(1, 1, width), head_dim)
        q, k = s_qk * unit(rotary(q)), s_qk * unit(rotary(k))
        y = lin(merge(causal_attention(q, k, v, math.sqrt(head_dim))), p, pre + "attn.proj")
        h_a = unit(y)
        h = unit(h + eff(pre + "alpha_attn.weight", 0.05, base) * (h_a - h))
        u = eff(pre + "mlp.s_u.weight", 1.0, 1.0) * lin(h, p, pre + "mlp.up_u")
        v = eff(pre + "mlp.s_v.weight", 1.0, 1.0) * lin(h, p, pre + "mlp.up_v") * math.sqrt(width)
        h_m = unit(lin(u * (v * torch.sigmoid(v)), p, pre + "mlp.down"))
        h = unit(h + eff(pre + "alpha_mlp.weight", 0.05, base) * (h_m - h))
    return eff("s_z.weight", 1.0, base) * (h @ p["unembed.weight"].T)


# --------------------------------------------------------------------- comparison


@torch.no_grad()
def perturb(model: torch.nn.Module, seed: int) -> None:
    """Move every parameter off its init: noise of half its RMS (0.1 where it is all zero)."""
    g = torch.Generator().manual_seed(seed)
    for _, t in sorted(model.named_parameters()):
        rms = float(t.pow(2).mean().sqrt())
        t.add_(torch.randn(t.shape, generator=g, dtype=t.dtype) * (0.5 * rms if rms else 0.1))


def compare(model: torch.nn.Module, reference, idx: torch.Tensor, seed: int) -> None:  # noqa: ANN001
    """Logits and the gradient of a random linear functional of them w.r.t. every parameter."""
    named = dict(model.named_parameters())
    logits = model(idx)
    ref_params = {n: t.detach().clone().requires_grad_(True) for n, t in named.items()}
    ref_logits = reference(ref_params, idx)
    assert logits.shape == ref_logits.shape == (*idx.shape, VOCAB)
    torch.testing.assert_close(logits, ref_logits, rtol=RTOL, atol=RTOL * float(
        ref_logits.detach().abs().max()))
    probe = torch.randn(logits.shape, generator=torch.Generator().manual_seed(seed), dtype=F64)
    grads = torch.autograd.grad((logits * probe).sum(), list(named.values()))
    ref_grads = torch.autograd.grad((ref_logits * probe).sum(), list(ref_params.values()))
    # relative to each tensor's own gradient, floored at 1e-6 of the largest: a key bias
    # under ALiBi shifts every score of a query alike, which softmax ignores, so its true
    # gradient is 0 and both sides hold only rounding there
    floor = 1e-6 * max(float(g.norm()) for g in ref_grads)
    for name, got, want in zip(named, grads, ref_grads, strict=True):
        err = float((got - want).norm()) / max(float(want.norm()), floor)
        assert err < RTOL, f"gradient of {name}: relative error {err:.3g}"


GPT_CASES = [
    # width, depth, head_dim, seq, parameterization, alpha, options
    (32, 1, 8, 12, "sp", None, {}),
    (32, 3, 8, 12, "mup", None, {"x0_mixing": True, "extra_embeddings": 1}),
    (48, 4, 16, 10, "completep", None,
     {"x0_mixing": True, "extra_embeddings": 3, "value_embeddings": 2}),
    (48, 2, 16, 9, "sp", None, {"x0_mixing": True, "position": "alibi", "bias": True,
                                "activation": "gelu"}),
    (32, 5, 8, 12, "depth_alpha", 0.75, {"x0_mixing": True, "extra_embeddings": 2,
                                         "activation": "gelu", "bias": True}),
    (48, 3, 16, 10, "depth_mup", None, {"position": "alibi", "value_embeddings": 1}),
    (64, 2, 32, 7, "completep", None, {"bias": True}),
]


@pytest.mark.parametrize("case", GPT_CASES, ids=lambda c: f"{c[4]}-{c[0]}x{c[1]}-h{c[2]}-"
                         f"k{c[6].get('extra_embeddings', 0) if c[6].get('x0_mixing') else 'off'}")
def test_gpt_matches_the_reference_forward(case) -> None:  # noqa: ANN001
    width, depth, head_dim, seq, param, alpha, opts = case
    base_width, base_depth = 16, 1  # m_N, m_L != 1: every multiplier is in play
    built = build_model("gpt", width, depth, param, alpha, head_dim=head_dim, vocab_size=VOCAB,
                        max_seq_len=64, base_width=base_width, base_depth=base_depth, seed=1,
                        **opts)
    model = built.model.double()  # not .to(F64): that casts the complex rotary table to real
    perturb(model, seed=depth)
    residual, logit_mult, scale = table1_multipliers(param, alpha, width, depth, base_width,
                                                     base_depth, head_dim)

    def reference(p: dict[str, torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
        return reference_gpt(
            p, idx, depth=depth, head_dim=head_dim, residual=residual, logit_mult=logit_mult,
            attn_scale=scale, activation=opts.get("activation", "relu2"),
            alibi=opts.get("position") == "alibi", x0_mixing=opts.get("x0_mixing", False),
            extra=opts.get("extra_embeddings", 0),
            value_embeddings=opts.get("value_embeddings", 0))

    idx = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(width))
    compare(model, reference, idx, seed=depth)


@pytest.mark.parametrize("width, depth, head_dim, seq", [(32, 1, 8, 12), (48, 3, 16, 10),
                                                         (64, 4, 32, 7)])
def test_ngpt_matches_the_reference_forward(width, depth, head_dim, seq) -> None:  # noqa: ANN001
    built = build_model("ngpt", width, depth, "ngpt", head_dim=head_dim, vocab_size=VOCAB,
                        max_seq_len=64, seed=2)
    model = built.model.double()  # not .to(F64): that casts the complex rotary table to real
    perturb(model, seed=depth)
    built.after_step()  # matrices back on the sphere, as every forward in training sees them

    def reference(p: dict[str, torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
        return reference_ngpt(p, idx, depth=depth, width=width, head_dim=head_dim)

    idx = torch.randint(0, VOCAB, (3, seq), generator=torch.Generator().manual_seed(width))
    compare(model, reference, idx, seed=depth)


def test_ngpt_matrices_are_unit_norm_along_their_d_model_axis() -> None:
    # variants.md: embedding/unembedding rows, q/k/v and MLP-up rows (dim=1 of (out, in)),
    # attention-out and MLP-down columns (dim=0 of (d_model, .)); q, k, v and proj are
    # square at width 48, so only the axis (not the shape) tells right from wrong
    width = 48
    built = build_model("ngpt", width, 2, "ngpt", head_dim=16, vocab_size=VOCAB, seed=4)
    perturb(built.model, seed=4)
    built.after_step()
    for name, t in built.model.named_parameters():
        if t.dim() != 2:
            continue
        axis = 0 if name.endswith(("attn.proj.weight", "mlp.down.weight")) else 1
        assert t.shape[axis] == width, name
        norms = t.detach().double().norm(dim=axis)
        torch.testing.assert_close(norms, torch.ones_like(norms), rtol=0, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
