"""Parameterization tables against Table 1 and the worked case in shared/notes."""

import dataclasses
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


def exactly(value: float) -> object:
    """pytest.approx without its default absolute slack of 1e-12, under which any eps near
    EPS = 1e-12 (eps_base, eps/m_N, eps/m_N/m_L alike) compares equal."""
    return pytest.approx(value, rel=1e-12, abs=0.0)


@pytest.mark.parametrize("name", list(WORKED))
def test_worked_case(name):
    hidden_lr, ln_lr, bias_lr, residual, block_eps, wd, std = WORKED[name]
    t = table(name, bias=True)
    h = t.group("hidden_weight")
    assert h.lr == pytest.approx(hidden_lr, rel=1e-12)
    assert h.eps == exactly(block_eps)
    assert h.weight_decay == pytest.approx(wd, rel=1e-12)
    assert h.init_std == pytest.approx(std, rel=1e-12)
    assert t.group("pre_ln").lr == pytest.approx(ln_lr, rel=1e-12)
    assert t.group("pre_ln").eps == exactly(block_eps)
    assert t.group("hidden_bias").eps == exactly(block_eps)
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
    assert t.group("hidden_weight").eps == exactly(EPS / 4 * 16 ** (-0.75))


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
    assert group.lr == pytest.approx(bias_lr) and group.eps == exactly(block_eps)
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


def test_optimizer_groups_carry_the_weight_decay_and_the_schedules_base_lr() -> None:
    """Each AdamW group's weight_decay is the table's (lambda * m_N for hidden weights, 0 for
    LayerNorms), and its initial_lr, which the trainer's schedule multiplies, is its lr."""
    from hptransfer.models import build_model, optimizer_groups

    b = build_model("gpt", 512, 8, "completep", lr=0.01, weight_decay=0.1)  # m_N = 2
    groups = {g["name"]: g for g in optimizer_groups(b.model, b.table)}
    assert groups["hidden_weight"]["weight_decay"] == pytest.approx(0.1 * 2)
    assert groups["embedding"]["weight_decay"] == pytest.approx(0.1)
    assert groups["pre_ln"]["weight_decay"] == 0.0
    for g in groups.values():
        assert g["initial_lr"] == g["lr"], g["name"]
    assert groups["hidden_weight"]["initial_lr"] == pytest.approx(0.01 / 2)  # m_L^(1-1) = 1


@pytest.mark.parametrize("alpha, preset", [(0.5, "depth_mup"), (1.0, "completep")])
def test_depth_alpha_takes_both_ends_of_its_range(alpha: float, preset: str) -> None:
    """alpha in [0.5, 1] is a closed interval: its ends are depth-muP and CompleteP."""
    t = table("depth_alpha", alpha=alpha)
    hidden_lr, ln_lr, _, residual, block_eps, _, _ = WORKED[preset]
    assert t.group("hidden_weight").lr == exactly(hidden_lr)
    assert t.group("pre_ln").lr == exactly(ln_lr)
    assert t.group("hidden_weight").eps == exactly(block_eps)
    assert t.multipliers.residual == exactly(residual)


@pytest.mark.parametrize("key", ["base_width", "base_depth", "lr", "sigma", "eps"])
def test_zero_base_values_are_rejected_but_zero_weight_decay_is_not(key: str) -> None:
    """The base shape, eta, sigma and eps must be > 0 (m_N = N / 0, eps 0 divides by zero in
    AdamW); lambda = 0 is the default and allowed."""
    with pytest.raises(ParameterizationError, match=f"{key} must be a positive"):
        Parameterization(name="sp", **{key: 0})
    assert Parameterization(name="sp", weight_decay=0.0).weight_decay == 0.0


ALL_OPTIONS = dict(bias=True, x0_mixing=True, extra_embeddings=2, value_embeddings=1)


@pytest.mark.parametrize("name", list(WORKED))
def test_rows_table_1_does_not_scale_and_the_no_decay_groups(name: str) -> None:
    """Table 1 rows that never scale with width or depth (embedding, unembedding, final LN:
    sigma, eta, eps_base) plus the module's own rules: extra input embeddings are embeddings,
    the x0 / value-embedding lambdas take eta and eps_base; weight decay (lambda_base,
    unscaled) on the embedding matrices only - none on LayerNorms, biases or scalars."""
    t = table(name, **ALL_OPTIONS)
    for g in ("embedding", "extra_embedding", "unembedding"):
        group = t.group(g)
        assert (group.init, group.init_std) == ("normal", SIGMA)
        assert group.lr == ETA and group.eps == EPS and group.weight_decay == LAM
    for g in ("final_ln", "mixing_scalars"):
        assert t.group(g).lr == ETA and t.group(g).eps == EPS
    for g in ("pre_ln", "final_ln", "hidden_bias", "mixing_scalars"):
        assert t.group(g).weight_decay == 0.0, g
    assert t.group("value_embedding").eps == exactly(WORKED[name][4])


def test_ngpt_groups_take_the_base_numbers() -> None:
    """nGPT's own scheme: every group LR eta, eps_base, no weight decay."""
    t = table("ngpt", arch="ngpt")
    assert {g.name for g in t.groups} >= {"embedding", "hidden_weight", "scale_vectors",
                                          "unembedding"}
    for g in t.groups:
        assert (g.lr, g.eps, g.weight_decay) == (ETA, EPS, 0.0), g.name


def test_a_parameter_claimed_by_two_rules_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """A name two rules match would otherwise silently take the first rule's numbers."""
    from hptransfer.models import parameterization as pm

    rules = pm._gpt_rules

    def overlapping(*args: object) -> list:
        out = rules(*args)
        return [*out, dataclasses.replace(out[0], name="also_embedding")]

    monkeypatch.setattr(pm, "_gpt_rules", overlapping)
    with pytest.raises(ParameterizationError,
                       match=r"'embed.weight' is claimed by \['embedding', 'also_embedding'\]"):
        param_table(ModelConfig(width=256, depth=2), Parameterization("mup"), ["embed.weight"])


def test_only_groups_with_parameters_are_listed() -> None:
    """A plain GPT (no biases, no extra tables, no mixing) logs and optimizes exactly the
    groups it has parameters in: no empty optimizer group, no empty row."""
    t = table("completep", width=256, depth=2)
    assert sorted(g.name for g in t.groups) == sorted(
        ["embedding", "pre_ln", "hidden_weight", "final_ln", "unembedding"])
    assert all(g.params for g in t.groups)
