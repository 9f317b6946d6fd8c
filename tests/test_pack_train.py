"""One pack's optimizer step against torch's own (`workers/pack.py`): each member's rows
of the (K, P) buffer move exactly as torch.optim.AdamW, after clip_grad_norm_, moves that
member's parameters alone with its own LR, schedule, weight decay and eps."""

from __future__ import annotations

import torch
from test_packed import CASES, TINY

from hptransfer.models.parameterization import optimizer_groups
from hptransfer.spec.trial import TrialSpec
from hptransfer.workers.pack import Pack

# members whose AdamW numbers all differ; eps large in one so that it decides the step
# where a gradient is small
MEMBERS = [dict(lr=2**-8, seed=0, weight_decay=0.0, eps=1e-8),
           dict(lr=2**-7, seed=1, weight_decay=0.1, eps=1e-6,
                schedule={"warmup_fraction": 0.0, "decay": "cosine"}),
           dict(lr=2**-9, seed=2, weight_decay=0.0, eps=1e-10)]
STEPS = 3


def _gradients(shape, step: int) -> torch.Tensor:
    """Per member a gradient of another size: member 0's far under the clipping norm,
    member 1's far over it, member 2's near it; within each, entries from 1e-9 to 1."""
    gen = torch.Generator().manual_seed(step)
    g = torch.randn(shape, generator=gen) * 10.0 ** torch.empty(shape).uniform_(
        -9, 0, generator=gen)
    return g * torch.tensor([[1e-3], [50.0], [0.05]])


def test_a_pack_step_is_torch_adamw_after_clipping_for_each_member_alone():
    specs = [TrialSpec(**{**TINY, **CASES["gpt-completep"], **m, "grad_clip": 0.5})
             for m in MEMBERS]
    pack = Pack(specs, None, None)
    k = len(specs)
    start = pack.flat.clone()
    grads = [_gradients(pack.flat.shape, step) for step in range(STEPS)]
    norms = [g.norm(dim=1) for g in grads]
    assert (norms[0][0] < 0.5).all() and (norms[0][1] > 0.5).all()  # clipped and not
    alive = torch.ones(k, dtype=torch.bool)
    losses = torch.ones(k)
    for step in range(STEPS):
        pack.grad.copy_(grads[step])
        with torch.no_grad():
            pack._update(pack.grad, losses, alive, losses.double(),
                         pack.factors[step, torch.arange(k)], pack.bias1[step],
                         pack.bias2_sqrt[step])
    for row, member in enumerate(pack.members):
        # the member alone: its parameters, its group table, torch's AdamW
        params = {n: torch.nn.Parameter(pack._block(start, n)[row].clone())
                  for n in pack.names}
        groups = optimizer_groups(params, member.table)
        opt = torch.optim.AdamW(groups, betas=(specs[row].beta1, specs[row].beta2),
                                foreach=False)
        factors = member.plan.factors(member.plan.total_steps)
        for step in range(STEPS):
            for n, p in params.items():
                p.grad = pack._block(grads[step], n)[row].clone()
            torch.nn.utils.clip_grad_norm_(list(params.values()), 0.5)
            for g in opt.param_groups:
                g["lr"] = g["initial_lr"] * factors[step]
            opt.step()
        alone = torch.cat([params[n].detach().flatten() for n in pack.names])
        # to fp32 rounding of parameters up to ~1 (norm gains); the steps are ~1e-3
        torch.testing.assert_close(pack.flat[row], alone, rtol=1e-5, atol=1e-7)
        moved = (pack.flat[row] - start[row]).abs().max().item()
        assert moved > 1e-4, row  # every member stepped


def test_a_stop_asked_at_the_last_step_leaves_the_member_completed_as_alone(tmp_path):
    """run_trial ignores a reporter's stop at its last step (nothing is left to save): the
    trial completed. A packed member too."""
    from test_packed import assert_same_result, specs_for

    from hptransfer.workers.packed import run_trials
    from hptransfer.workers.trainer import run_trial

    specs = specs_for(CASES["gpt-mup"])[:2]
    last = specs[1].budget.steps
    solo = run_trial(specs[1], reporter=lambda m: m["step"] == last, cache_dir=str(tmp_path))
    assert solo.status == "completed" and solo.steps == last
    packed = run_trials(specs, reporter=lambda i, m: i == 1 and m["step"] == last,
                        cache_dir=str(tmp_path))
    assert [r.status for r in packed] == ["completed", "completed"]
    assert_same_result(packed[1], solo)
