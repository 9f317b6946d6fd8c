"""Forward-pass behaviour of the architectures."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hptransfer.models import ModelConfigError, build_model

VOCAB = 256


def loss_of(model, x):
    return F.cross_entropy(model(x).flatten(0, 1), x.flatten()).item()


@pytest.mark.parametrize(
    "arch, param, opts",
    [
        ("gpt", "sp", {}),
        ("gpt", "completep", {"position": "alibi", "activation": "gelu", "bias": True}),
        ("gpt", "mup", {"x0_mixing": True, "extra_embeddings": 2, "value_embeddings": 1}),
        ("ngpt", "ngpt", {}),
    ],
)
def test_step0_loss_near_uniform(arch, param, opts):
    b = build_model(arch, 128, 3, param, head_dim=32, **opts)
    x = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))
    assert abs(loss_of(b.model, x) - math.log(VOCAB)) < 0.15


def test_x0_mixing_at_init_equals_plain_gpt_on_the_normed_embedding():
    # variants.md (modded-nanogpt): x = x00 = norm(embed(tokens)), lambdas init [1, 0, ...]
    plain = build_model("gpt", 128, 4, "completep", head_dim=32, seed=3)
    mixed = build_model(
        "gpt", 128, 4, "completep", head_dim=32, seed=3,
        x0_mixing=True, extra_embeddings=3, value_embeddings=2,
    )
    # copy the shared weights; the extra tables stay random (their lambdas are 0)
    missing, unexpected = mixed.model.load_state_dict(plain.model.state_dict(), strict=False)
    assert not unexpected
    assert all("extra_embeds" in k or "value_embeds" in k or "lambdas" in k for k in missing)
    x = torch.randint(0, VOCAB, (2, 16))
    assert not torch.allclose(mixed.model(x), plain.model(x))  # x00 enters normed
    plain.model.embed.register_forward_hook(lambda _m, _i, out: F.rms_norm(out, (128,)))
    torch.testing.assert_close(mixed.model(x), plain.model(x), rtol=0, atol=0)
    # x00 and an extra table enter the stream at the same RMS (1), whatever the init's sigma
    seen = []
    mixed.model.blocks[0].register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    with torch.no_grad():
        mixed.model(x)
        mixed.model.x0_lambdas[0] = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0])  # only x01
        mixed.model(x)
    rms = [float(t.pow(2).mean(-1).sqrt().mean()) for t in seen]
    assert rms == pytest.approx([1.0, 1.0], rel=1e-3)
    # and moving a lambda changes the output, so the extra path is really wired in
    with torch.no_grad():
        mixed.model.x0_lambdas[1, 2] = 0.5
        mixed.model.blocks[0].attn.ve_lambdas[1] = 0.5
    assert not torch.allclose(mixed.model(x), plain.model(x))


@pytest.mark.parametrize("depth", [1, 2, 3, 4, 5])
def test_every_value_embedding_table_feeds_a_block(depth):
    """Table j feeds blocks j and depth-1-j: at most half the depth (rounded up) tables, each
    of which gets a gradient; a table more is refused (it would feed no block: no gradient,
    and the CPU optimizer's step raised on it)."""
    tables = (depth + 1) // 2
    b = build_model("gpt", 64, depth, "completep", head_dim=32, value_embeddings=tables)
    with torch.no_grad():  # mixed in (init [1, 0]: a table gets a zero gradient at first)
        for block in b.model.blocks:
            if block.attn.ve_lambdas is not None:
                block.attn.ve_lambdas[1] = 0.5
    x = torch.randint(0, VOCAB, (2, 8))
    b.model(x).square().mean().backward()
    assert all(e.weight.grad is not None and e.weight.grad.abs().sum() > 0
               for e in b.model.value_embeds)
    assert sorted(set(b.model.ve_layer.values())) == list(range(tables))
    with pytest.raises(ModelConfigError, match=r"cannot exceed half the depth, rounded up "
                                               rf"\({tables} at depth {depth}\)"):
        build_model("gpt", 64, depth, "completep", head_dim=32, value_embeddings=tables + 1)


def test_an_odd_head_is_built_with_alibi_and_refused_with_rope():
    # RoPE rotates pairs of a head's dimensions: an odd head failed in the first forward
    for arch, param in [("gpt", "sp"), ("ngpt", "ngpt")]:
        with pytest.raises(ModelConfigError, match="head_dim must be even with position 'rope'"):
            build_model(arch, 9, 1, param, head_dim=3)
    m = build_model("gpt", 9, 1, "sp", head_dim=3, position="alibi").model
    assert m(torch.randint(0, VOCAB, (1, 5))).shape[:2] == (1, 5)


def test_causality():
    for arch, param, opts in [("gpt", "sp", {}), ("gpt", "sp", {"position": "alibi"}),
                              ("ngpt", "ngpt", {})]:
        m = build_model(arch, 64, 2, param, head_dim=32, **opts).model
        x = torch.randint(0, VOCAB, (1, 12))
        y = x.clone()
        y[0, 8:] = (y[0, 8:] + 1) % VOCAB
        torch.testing.assert_close(m(x)[:, :8], m(y)[:, :8])


def test_rotary_is_norm_preserving_and_relative():
    from hptransfer.models.layers import Rotary

    rot = Rotary(16, 64)
    q = torch.randn(1, 1, 64, 16)
    torch.testing.assert_close(rot(q).norm(dim=-1), q.norm(dim=-1))
    # <R_m q, R_n k> depends only on m - n
    a, b = torch.randn(16), torch.randn(16)
    qs = rot(a.expand(1, 1, 64, 16).contiguous())
    ks = rot(b.expand(1, 1, 64, 16).contiguous())
    d1 = (qs[0, 0, 10] * ks[0, 0, 7]).sum()
    d2 = (qs[0, 0, 40] * ks[0, 0, 37]).sum()
    torch.testing.assert_close(d1, d2, rtol=1e-4, atol=1e-4)


def test_ngpt_matrices_unit_norm_after_steps():
    from hptransfer.models import optimizer_groups

    b = build_model("ngpt", 64, 2, "ngpt", head_dim=32, lr=0.05)
    opt = torch.optim.AdamW(optimizer_groups(b.model, b.table))
    x = torch.randint(0, VOCAB, (2, 16))

    def check():
        m = b.model
        rows = [m.embed.weight, m.unembed.weight]
        for blk in m.blocks:
            rows += [blk.attn.q.weight, blk.attn.k.weight, blk.attn.v.weight,
                     blk.mlp.up_u.weight, blk.mlp.up_v.weight]
        for w in rows:
            torch.testing.assert_close(w.norm(dim=1), torch.ones(w.shape[0]))
        for blk in m.blocks:
            for w in (blk.attn.proj.weight, blk.mlp.down.weight):
                torch.testing.assert_close(w.norm(dim=0), torch.ones(w.shape[1]))

    check()  # renormalised before step 0
    for _ in range(3):
        opt.zero_grad()
        F.cross_entropy(b.model(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
        b.after_step()
        check()
    # scale vectors are not renormalised and do move
    assert not torch.allclose(b.model.blocks[0].alpha_attn.weight, torch.full((64,), 64**-0.5))


def test_ngpt_hidden_state_on_sphere():
    b = build_model("ngpt", 64, 2, "ngpt", head_dim=32)
    seen = []
    b.model.blocks[-1].register_forward_hook(lambda m, i, o: seen.append(o))
    b.model(torch.randint(0, VOCAB, (2, 8)))
    torch.testing.assert_close(seen[0].norm(dim=-1), torch.ones(2, 8))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(width=100), "not divisible by head_dim"),
        (dict(depth=0), r"depth must be in \[1, 1024\]"),
        (dict(width=1 << 30, head_dim=64), r"width must be in \[1, 65536\]"),
        (dict(extra_embeddings=1), "needs x0_mixing"),
        (dict(activation="swish"), "activation must be one of"),
    ],
)
def test_bad_model_config(kwargs, message):
    args = dict(arch="gpt", width=128, depth=2, parameterization="sp")
    args.update(kwargs)
    with pytest.raises(ModelConfigError, match=message):
        build_model(**args)


def test_same_seed_same_weights():
    a = build_model("gpt", 64, 2, "completep", head_dim=32, seed=7).model.state_dict()
    b = build_model("gpt", 64, 2, "completep", head_dim=32, seed=7).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_relu_squared_matches_autograd_reference():
    """The hand-written relu^2 (forward and gradient) against autograd's relu().square()."""
    from hptransfer.models.layers import relu_squared

    x = torch.randn(3, 5, 7, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 5, 7, dtype=torch.float64)
    (ours,) = torch.autograd.grad(relu_squared(x), x, g)
    (ref,) = torch.autograd.grad(F.relu(x).square(), x, g)
    torch.testing.assert_close(relu_squared(x), F.relu(x).square())
    torch.testing.assert_close(ours, ref)
    assert torch.autograd.gradcheck(relu_squared, (x,))


class _RecordedOps(TorchDispatchMode):
    """The names of the aten ops that run inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_relu_squared_in_place_gives_the_same_bits_and_guards_its_buffer():
    """In place (a Linear's fresh output): values and gradients equal the out-of-place
    version's to the bit; a second backward through the graph raises instead of reading the
    spent buffer. A reshaped view of a whole tensor is done in place on that tensor; a view of
    part of one falls back to out of place and leaves the rest alone."""
    from hptransfer.models.layers import relu_squared

    w = torch.randn(16, 24, requires_grad=True)
    x, g = torch.randn(5, 16), torch.randn(5, 24)
    results = []
    for in_place in (False, True):
        h = x @ w
        y = relu_squared(h, in_place=in_place)
        assert torch.equal(h, F.relu(x @ w)) == in_place  # in place: relu(h) overwrote h
        (grad_w,) = torch.autograd.grad(y, w, g, retain_graph=True)
        results.append((y, grad_w))
        if in_place:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                torch.autograd.grad(y, w, g)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    for in_place in (False, True):  # no zero-filled gradient for relu(x), which gets none
        y = relu_squared(x @ w, in_place=in_place)
        with _RecordedOps() as ops:
            torch.autograd.grad(y, w, g)
        assert not {"fill_", "zero_", "zeros", "zeros_like"} & ops.names, ops.names
    # a pack's (K, B, T, hidden) view of its (K, B*T, hidden) batched matmul: in place on the
    # base, the same bits; a view of part of a tensor: out of place, its base left alone
    batched = torch.bmm(torch.randn(2, 6, 16), w.expand(2, 16, 24).detach())
    before = batched.clone()
    assert torch.equal(relu_squared(batched.view(2, 3, 2, 24), in_place=True),
                       F.relu(before).square().view(2, 3, 2, 24))
    assert torch.equal(batched, F.relu(before))
    base = torch.randn(4, 6)
    kept = base.clone()
    relu_squared(base[:2], in_place=True)
    assert torch.equal(base, kept)


@pytest.mark.parametrize("d", [4, 16], ids=["small-head-path", "fused-kernel"])
@pytest.mark.parametrize("alibi", [False, True])
def test_packed_attention_matches_per_member_softmax_attention(alibi, d):
    """attention() on a pack's (members, batch, heads, T, d) tensors: values and gradients
    equal textbook softmax attention of each member alone, on both of its CPU paths."""
    from hptransfer.models.layers import alibi_bias, attention, uses_small_head_path

    members, b, h, t = 3, 2, 2, 5
    q, k, v = (torch.randn(members, b, h, t, d, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    assert uses_small_head_path(q) == (d == 4)
    g = torch.randn(members, b, h, t, d, dtype=torch.float64)
    bias = alibi_bias(h, t, q.device, q.dtype) if alibi else None
    causal = torch.ones(t, t, dtype=torch.bool).tril()

    def reference(q, k, v):
        s = (q @ k.transpose(-2, -1)) * 0.7
        s = s + bias if alibi else s.masked_fill(~causal, float("-inf"))
        return s.softmax(-1) @ v

    ours = attention(q, k, v, 0.7, bias)
    ref = torch.stack([reference(q[i], k[i], v[i]) for i in range(members)])
    torch.testing.assert_close(ours, ref)
    grads = torch.autograd.grad(ours, (q, k, v), g)
    torch.testing.assert_close(grads, torch.autograd.grad(ref, (q, k, v), g))


@pytest.mark.parametrize("bias", [False, True])
def test_stacked_layers_apply_each_members_own_parameters(bias):
    """Linear, Embedding and LayerNorm with stacked (K, ...) parameters give, for member k,
    what the plain module with member k's parameters gives on input k; gradients too."""
    from hptransfer.models.layers import Embedding, LayerNorm, Linear

    torch.manual_seed(0)
    members = 3
    cases = [(Linear(6, 5, bias=bias), torch.randn(members, 2, 4, 6, dtype=torch.float64)),
             (LayerNorm(6, bias=bias), torch.randn(members, 2, 4, 6, dtype=torch.float64)),
             (Embedding(11, 6), torch.randint(0, 11, (members, 2, 4)))]
    for module, x in cases:
        module = module.double()
        plain = [{n: torch.randn_like(p) for n, p in module.named_parameters()}
                 for _ in range(members)]
        stacked = {n: torch.stack([m[n] for m in plain]).requires_grad_() for n in plain[0]}
        ours = torch.func.functional_call(module, stacked, (x,))
        g = torch.randn_like(ours)
        ours.backward(g)
        for i in range(members):
            member = {n: p.clone().requires_grad_() for n, p in plain[i].items()}
            ref = torch.func.functional_call(module, member, (x[i],))
            torch.testing.assert_close(ours[i], ref)
            ref.backward(g[i])
            for n, p in member.items():
                torch.testing.assert_close(stacked[n].grad[i], p.grad, msg=f"{module} {n}")


def test_rotary_matches_pairwise_rotation_formula():
    """Rotary against RoFormer's formula (eq. 34) on adjacent pairs (2i, 2i + 1), element by
    element, in both layouts."""
    from hptransfer.models.layers import Rotary

    d, t = 8, 10
    rot = Rotary(d, 16)
    x = torch.randn(2, 3, t, d)
    ref = torch.empty_like(x)
    for pos in range(t):
        for i in range(d // 2):
            angle = torch.tensor(pos * 10000.0 ** (-2 * i / d), dtype=torch.float32)
            even, odd = x[..., pos, 2 * i], x[..., pos, 2 * i + 1]
            ref[..., pos, 2 * i] = even * angle.cos() - odd * angle.sin()
            ref[..., pos, 2 * i + 1] = even * angle.sin() + odd * angle.cos()
    torch.testing.assert_close(rot(x), ref)
    # (batch, T, 2, heads, d) layout, T at dim -4: same rotation per position
    y = x.permute(0, 2, 1, 3).unsqueeze(2).expand(2, t, 2, 3, d)
    torch.testing.assert_close(rot(y, seq_dim=-4)[:, :, 1], ref.permute(0, 2, 1, 3))


def test_rotary_complex_and_real_paths_agree_to_the_bit():
    """Eager fp32 turns pairs as complex numbers; an odd storage offset (no complex view) takes
    the real products that torch.compile traces. Values and gradients: the same bits."""
    from hptransfer.models.layers import Rotary, _complex_view_fits

    rot = Rotary(16, 32)
    grad = torch.randn(4, 32, 2, 3, 16)
    values = torch.randn(grad.numel())
    shifted = torch.empty(values.numel() + 1)  # the same values one element further on
    shifted[1:] = values
    outs = []
    for flat, complex_path in ((values, True), (shifted[1:], False)):
        x = flat.view_as(grad).requires_grad_()
        assert _complex_view_fits(x) == complex_path
        y = rot(x, seq_dim=-4)
        (g,) = torch.autograd.grad(y, x, grad)
        outs.append((y, g))
    (y_complex, g_complex), (y_real, g_real) = outs
    assert torch.equal(y_complex, y_real) and torch.equal(g_complex, g_real)


@pytest.mark.parametrize("members", [None, 3])
def test_turn_qk_in_place_gives_the_same_bits_and_guards_its_buffer(members):
    """Rotary.turn_qk on a fresh q/k/v matmul output (a single model's, or a pack's batched
    one viewed per member) turns q and k in that output's memory; q, k, v and the gradients
    of the input and weight equal those of turning q and k out of place, to the bit, and v
    is left as it was. Had an op saved that output for its backward, autograd raises instead
    of using the turned values; a view of part of a tensor is turned out of place, its base
    left alone."""
    from hptransfer.models.layers import Rotary

    rot, t, heads, d = Rotary(16, 32), 12, 3, 16
    lead = (2,) if members is None else (members, 2)
    x = torch.randn(*lead, t, 8)
    w = torch.randn(*lead[:-1], 8, 3 * heads * d, requires_grad=True)
    grads = [torch.randn(*lead, t, heads, d) for _ in range(3)]

    def qkv_of(x, w):  # the matmul's own output, then the (..., T, 3, heads, d) view
        flat = (x @ w) if members is None else torch.bmm(x.flatten(1, 2), w)
        return flat, flat.view(*lead, t, 3, heads, d)

    flat, qkv = qkv_of(x, w)
    before = qkv.detach().clone()
    q, k, v = rot.turn_qk(qkv)
    assert q.data_ptr() == flat.data_ptr()  # turned in the matmul output's memory
    assert torch.equal(flat.view_as(before)[..., :2, :, :], torch.stack((q, k), dim=-3))
    grad_w = torch.autograd.grad((q, k, v), w, grads, retain_graph=True)[0]
    # nothing saved the overwritten output, so a second backward gives the same gradient
    assert torch.equal(torch.autograd.grad((q, k, v), w, grads)[0], grad_w)
    # had an op saved it before the turn, autograd refuses rather than use the turned values
    saved_flat, saved_qkv = qkv_of(x, w)
    reads_it = saved_flat.sin()
    q2, _, _ = rot.turn_qk(saved_qkv)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(reads_it.sum() + q2.sum(), w)
    _, fresh = qkv_of(x, w)
    qk_ref, v_ref = fresh.split((2, 1), dim=-3)
    (q_ref, k_ref), v_ref = rot(qk_ref, seq_dim=-4).unbind(-3), v_ref.squeeze(-3)
    grad_w_ref = torch.autograd.grad((q_ref, k_ref, v_ref), w, grads)[0]
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref) and torch.equal(v, v_ref)
    assert torch.equal(v, before[..., 2, :, :])
    assert torch.equal(grad_w, grad_w_ref)

    part = torch.randn(4, t, 3, heads, d)
    kept = part.clone()
    q, k, v = rot.turn_qk(part[:2])
    assert torch.equal(part, kept) and torch.equal(q, rot(kept[:2, :, :2], seq_dim=-4)[:, :, 0])


@pytest.mark.parametrize("n_heads", [1, 3, 5, 8, 12])
def test_alibi_bias_is_the_press_et_al_table_to_the_bit(n_heads):
    """ALiBi's (heads, T, T) bias against the formula, element by element in Python:
    -2^(-8 h / H) * (i - j) on and below the diagonal (h = 1..H), -inf above it."""
    import numpy as np

    from hptransfer.models.layers import alibi_bias

    t = 7
    bias = alibi_bias(n_heads, t, torch.device("cpu"), torch.float32)
    expected = torch.empty(n_heads, t, t)
    for h in range(n_heads):
        slope = float(np.float32(2.0 ** (-8.0 * (h + 1) / n_heads)))
        for i in range(t):
            for j in range(t):
                # a float32 slope times a small integer is exact in float64, so rounding the
                # product once to float32 is what a float32 multiply gives
                expected[h, i, j] = -slope * (i - j) if j <= i else -math.inf
    assert torch.equal(bias, expected)


def test_fused_qkv_equals_three_linears():
    from torch import nn

    from hptransfer.models.layers import fused_qkv

    q, k, v = (nn.Linear(16, 16, bias=True) for _ in range(3))
    x = torch.randn(2, 5, 16)
    out = fused_qkv(x, q, k, v, n_heads=4)
    for i, lin in enumerate((q, k, v)):
        torch.testing.assert_close(out[:, :, i], lin(x).view(2, 5, 4, 4))


@pytest.mark.parametrize("param, base_width, multiplier", [
    ("sp", 32, 1.0), ("mup", 32, 0.25), ("completep", 128, 1.0)])
def test_logits_are_the_unembedding_times_the_forward_multiplier(param, base_width,
                                                                 multiplier):
    """µP's logits are unembed(h)/m_N (Table 1); at m_N = 1, and under SP, exactly unembed(h):
    the skipped multiply by 1.0 must change nothing."""
    b = build_model("gpt", 128, 2, param, head_dim=32, base_width=base_width, seed=1)
    assert b.table.multipliers.logits == pytest.approx(multiplier)
    final: list[torch.Tensor] = []
    b.model.ln_final.register_forward_hook(lambda _m, _i, out: final.append(out))
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = b.model(x)
    assert torch.equal(logits, b.model.unembed(final[0]) * multiplier)
