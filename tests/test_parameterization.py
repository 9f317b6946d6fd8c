"""Parameterization tables against Table 1 and the worked case in shared/notes."""

import math

import pytest
import torch

from hptransfer.models import ModelConfig, Parameterization, ParameterizationError, table_for
from hptransfer.models.parameterization import param_table

ETA, SIGMA, LAM, EPS = 2.0**-8, 0.02, 0.1, 1e-12


def table(name, width=1024, depth=32, alpha=None, **cfg):
    p = Parameterization(name=name, alpha=alpha, lr=ETA, sigma=SIGMA, weight_decay=LAM, eps=EPS)
    return table_for(ModelConfig(width=width, depth=depth, **cfg), p)


# Worked case N=1024, L=32 -> m_N = 4, m_L = 16 (notes/parameterizations.md), plus SP and muP
# from Table 1: (hidden lr, pre-LN lr, bias lr, residual, block eps, hidden wd, hidden std)
WORKED = {
    "sp": (ETA, ETA, ETA, 1.0, EPS, LAM, SIGMA),
    "mup": (ETA / 4, ETA, ETA, 1.0, EPS / 4, 4 * LAM, SIGMA / 2),
    "depth_mup": (ETA / 16, ETA / 4, ETA / 4, 1 / 4, EPS / 16, 4 * LAM, SIGMA / 2),
    "completep": (ETA / 4, ETA, ETA, 1 / 16, EPS / 64, 4 * LAM, SIGMA / 2),
}


@pytest.mark.parametrize("name", list(WORKED))
def test_worked_case(name):
    hidden_lr, ln_lr, bias_lr, residual, block_eps, wd, std = WORKED[name]
    t = table(name, bias=True)
    h = t.group("hidden_weight")
    assert h.lr == pytest.approx(hidden_lr, rel=1e-12)
    assert h.eps == pytest.approx(block_eps, rel=1e-12)
    assert h.weight_decay == pytest.approx(wd, rel=1e-12)
    assert h.init_std == pytest.approx(std, rel=1e-12)
    assert t.group("pre_ln").lr == pytest.approx(ln_lr, rel=1e-12)
    assert t.group("pre_ln").eps == pytest.approx(block_eps, rel=1e-12)
    assert t.group("hidden_bias").lr == pytest.approx(bias_lr, rel=1e-12)
    assert t.multipliers.residual == pytest.approx(residual, rel=1e-12)
    # width-independent rows: embedding, final LN, unembedding
    for g in ("embedding", "final_ln", "unembedding"):
        assert t.group(g).lr == ETA and t.group(g).eps == EPS
    assert t.group("embedding").init_std == SIGMA == t.group("unembedding").init_std
    assert t.multipliers.logits == pytest.approx(1.0 if name == "sp" else 0.25)
    assert t.multipliers.attn_scale == pytest.approx(1 / 8 if name == "sp" else 1 / 64)


def test_per_step_decay_is_width_independent():
    # AdamW decays by lr * wd: with eta/m_N and lambda*m_N that product must not change
    products = [table("mup", width=w).group("hidden_weight") for w in (256, 512, 2048)]
    assert len({round(g.lr * g.weight_decay, 15) for g in products}) == 1


def test_continuous_alpha_interpolates():
    t = table("depth_alpha", alpha=0.75)
    assert t.group("hidden_weight").lr == pytest.approx(ETA / 4 * 16 ** (-0.25))
    assert t.multipliers.residual == pytest.approx(16 ** (-0.75))
    assert t.group("hidden_weight").eps == pytest.approx(EPS / 4 * 16 ** (-0.75))


def test_base_shape_is_identity_for_all_width_depth_presets():
    for name in ("mup", "depth_mup", "completep"):
        t = table(name, width=256, depth=2)
        assert t.group("hidden_weight").lr == pytest.approx(ETA)
        assert t.multipliers.residual == pytest.approx(1.0)
        assert t.multipliers.logits == pytest.approx(1.0)


def test_every_parameter_claimed_exactly_once_for_all_options():
    cfg = dict(x0_mixing=True, extra_embeddings=2, value_embeddings=1, bias=True)
    t = table("completep", width=128, depth=4, **cfg)
    names = [n for g in t.groups for n in g.params]
    assert len(names) == len(set(names))
    from hptransfer.models import build_model

    model = build_model("gpt", 128, 4, "completep", head_dim=32, **cfg).model
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert {"extra_embedding", "value_embedding", "mixing_scalars"} <= {g.name for g in t.groups}


@pytest.mark.parametrize("name", list(WORKED))
def test_value_embeddings_take_the_bias_lr_and_block_eps_of_the_worked_case(name):
    """modded-nanogpt's value-embedding tables: embedding init, the hidden-bias LR
    (eta * m_L^(alpha-1)) and the residual blocks' eps, as the module docstring argues."""
    _, _, bias_lr, _, block_eps, _, _ = WORKED[name]
    t = table(name, value_embeddings=1, bias=True)
    group = t.group("value_embedding")
    assert group.lr == pytest.approx(bias_lr) and group.eps == pytest.approx(block_eps)
    assert group.init_std == pytest.approx(SIGMA) and group.weight_decay == pytest.approx(LAM)


def test_unclaimed_parameter_raises():
    cfg = ModelConfig(width=256, depth=2)
    with pytest.raises(ParameterizationError, match="unhandled parameter 'blocks.0.gate.weight'"):
        param_table(cfg, Parameterization("mup"), ["embed.weight", "blocks.0.gate.weight"])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(name="depth_alpha", alpha=0.3), r"alpha in \[0.5, 1\]"),
        (dict(name="depth_alpha"), "needs alpha"),
        (dict(name="mup", alpha=0.5), "alpha is only set with"),
        (dict(name="umup"), "parameterization must be one of"),
        (dict(name="sp", lr=-1.0), "lr must be a positive"),
        (dict(name="sp", weight_decay=math.nan), "weight_decay must be"),
    ],
)
def test_bad_parameterization_rejected(kwargs, message):
    with pytest.raises(ParameterizationError, match=message):
        Parameterization(**kwargs)


def test_ngpt_pairing():
    with pytest.raises(ParameterizationError, match="use parameterization 'ngpt'"):
        table("completep", arch="ngpt")
    with pytest.raises(ParameterizationError, match="only for arch 'ngpt'"):
        table("ngpt")
    t = table("ngpt", arch="ngpt")
    assert {g.weight_decay for g in t.groups} == {0.0}
    assert t.multipliers.attn_scale == pytest.approx(8.0)


def test_init_follows_table():
    from hptransfer.models import build_model

    b = build_model("gpt", 1024, 4, "mup", sigma=0.02, seed=1, bias=True)
    params = dict(b.model.named_parameters())
    assert params["blocks.0.attn.q.weight"].std().item() == pytest.approx(0.01, rel=0.02)
    assert params["embed.weight"].std().item() == pytest.approx(0.02, rel=0.02)
    assert torch.equal(params["blocks.0.ln_attn.weight"], torch.ones(1024))
    assert torch.equal(params["blocks.0.mlp.up.bias"], torch.zeros(4096))


def test_optimizer_groups_carry_numbers():
    from hptransfer.models import build_model, optimizer_groups

    b = build_model("gpt", 512, 8, "completep", lr=0.01, eps=1e-10)
    opt = torch.optim.AdamW(optimizer_groups(b.model, b.table))
    by_name = {g["name"]: g for g in opt.param_groups}
    assert by_name["hidden_weight"]["lr"] == pytest.approx(0.01 / 2)
    assert by_name["hidden_weight"]["eps"] == pytest.approx(1e-10 / 2 / 4)
