"""FlatAdamW against torch.optim.AdamW(foreach=True) on the CPU: the same parameters and
moments to the bit after many steps, for every model variant the trainer builds (each has
its own mix of parameter shapes and groups), with weight decay, a changing LR and clipping
as the trainer applies them."""

import copy

import pytest
import torch

from hptransfer.models import optimizer_groups
from hptransfer.models.build import build_model
from hptransfer.workers.flat_adamw import FlatAdamW

VARIANTS = {
    "gpt-sp": dict(arch="gpt", parameterization="sp"),
    "gpt-completep-x0-ve": dict(arch="gpt", parameterization="completep", x0_mixing=True,
                                extra_embeddings=1, value_embeddings=1),
    "gpt-mup-alibi-bias": dict(arch="gpt", parameterization="mup", position="alibi",
                               bias=True, activation="gelu"),
    "ngpt": dict(arch="ngpt", parameterization="ngpt"),
}
STEPS = 25


def _train(built, make_opt, steps: int = STEPS) -> list[torch.Tensor]:
    """The trainer's step (LR schedule, clipping, nGPT renormalisation) on random batches;
    the losses, for comparison."""
    gen = torch.Generator().manual_seed(0)
    opt = make_opt(optimizer_groups(built.model, built.table))
    losses = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = g["initial_lr"] * (step + 1) / steps  # a warmup: the LR changes
        x = torch.randint(0, 256, (2, 16), generator=gen)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(built.model(x).flatten(0, 1), x.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(built.model.parameters(), 1.0)
        opt.step()
        built.after_step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("name", list(VARIANTS))
def test_flat_adamw_equals_torch_foreach_to_the_bit(name):
    # odd widths and sizes: the buffers' vector tails fall at other elements than per tensor
    built = build_model(**VARIANTS[name], width=48, depth=3, head_dim=16, base_width=32,
                        base_depth=1, lr=2.0**-6, weight_decay=0.1, eps=1e-8, seed=3)
    twin = copy.deepcopy(built)
    betas = (0.9, 0.95)
    ref = _train(built, lambda g: torch.optim.AdamW(g, betas=betas, foreach=True))
    got = _train(twin, lambda g: FlatAdamW(g, betas=betas))
    assert torch.equal(torch.stack(ref), torch.stack(got))
    ref_params = dict(built.model.named_parameters())
    moved = 0
    for n, p in twin.model.named_parameters():
        assert torch.equal(p, ref_params[n]), n
        moved += int(not torch.equal(p, dict(build_model(
            **VARIANTS[name], width=48, depth=3, head_dim=16, base_width=32, base_depth=1,
            seed=3).model.named_parameters())[n]))
    assert moved > 0  # the comparison is not between two untouched models


def test_the_model_keeps_its_parameter_objects_and_trains_through_the_buffer():
    built = build_model(arch="gpt", parameterization="completep", width=32, depth=1,
                        head_dim=16, base_width=32, base_depth=1)
    before = list(built.model.parameters())
    opt = FlatAdamW(optimizer_groups(built.model, built.table), betas=(0.9, 0.95))
    assert [id(p) for p in built.model.parameters()] == [id(p) for p in before]
    start = [p.detach().clone() for p in before]
    _train(built, lambda g: opt, steps=2)
    assert all(not torch.equal(p, s) for p, s in zip(before, start, strict=True))


def test_a_parameter_without_gradient_is_an_error_not_a_silent_update():
    built = build_model(arch="gpt", parameterization="sp", width=32, depth=1, head_dim=16,
                        base_width=32, base_depth=1)
    opt = FlatAdamW(optimizer_groups(built.model, built.table), betas=(0.9, 0.95))
    with pytest.raises(RuntimeError, match="has no gradient"):
        opt.step()
