"""run_trials: every packed member gives run_trial's result for its spec alone (fp32 rounding
apart), for each arch x parameterization; divergence and pruning stop one member only."""

import math

import pytest
import torch

from hptransfer.spec.trial import TrialSpec
from hptransfer.workers.packed import run_trials
from hptransfer.workers.trainer import run_trial

# tiny and off the base shape (m_N = m_L = 2) so every width/depth multiplier is exercised
TINY = dict(width=64, depth=2, head_dim=32, base_width=32, base_depth=1, batch_size=4,
            seq_len=32, data={"val_tokens": 1024, "max_corpus_bytes": 300_000},
            budget={"steps": 60}, eval_every=20)
# members differ in everything a pack allows: lr, sigma, seed, weight decay, eps, schedule
MEMBERS = [
    dict(lr=2**-8, seed=0),
    dict(lr=2**-7, seed=1, sigma_base=0.03, schedule={"decay": "cosine"}),
    dict(lr=2**-9, seed=2, weight_decay=0.1, eps=1e-10,
         schedule={"warmup_fraction": 0.0, "decay": "wsd"}),
]
CASES = {
    "gpt-sp": dict(arch="gpt", parameterization="sp", lr_scale=0.5),  # SP: unstable at 2^-7
    "gpt-mup": dict(arch="gpt", parameterization="mup"),
    "gpt-depth_mup": dict(arch="gpt", parameterization="depth_mup"),
    "gpt-completep": dict(arch="gpt", parameterization="completep"),
    "gpt-alpha": dict(arch="gpt", parameterization="depth_alpha", alpha=0.75),
    "gpt-x0-ve": dict(arch="gpt", parameterization="completep",
                      arch_options={"x0_mixing": True, "extra_embeddings": 1,
                                    "value_embeddings": 1}),
    "gpt-alibi-bias": dict(arch="gpt", parameterization="mup",
                           arch_options={"position": "alibi", "bias": True,
                                         "activation": "gelu"}),
    "ngpt": dict(arch="ngpt", parameterization="ngpt", lr_scale=2),
}


def specs_for(case: dict, members=MEMBERS) -> list[TrialSpec]:
    case = dict(case)
    scale = case.pop("lr_scale", 1)  # into each arm's stable range: chaotic runs amplify rounding
    return [TrialSpec(**{**TINY, **case, **m, "lr": m["lr"] * scale}) for m in members]


def assert_same_result(packed, solo):
    assert packed.status == solo.status, (packed.error, solo.error)
    assert packed.steps == solo.steps and packed.tokens == solo.tokens
    assert packed.flops == solo.flops and packed.spec_hash == solo.spec_hash
    assert packed.param_table == solo.param_table
    assert [p["step"] for p in packed.curve] == [p["step"] for p in solo.curve]
    assert [p["lr"] for p in packed.curve] == [p["lr"] for p in solo.curve]
    assert [("val_loss" in p) for p in packed.curve] == [("val_loss" in p) for p in solo.curve]
    # same init and data order: the first loss agrees to fp32 rounding
    assert packed.curve[0]["train_loss"] == pytest.approx(solo.curve[0]["train_loss"], rel=1e-6)
    if solo.final_val_loss is None:
        assert packed.final_val_loss is None
    else:
        assert packed.final_val_loss == pytest.approx(solo.final_val_loss, rel=1e-3)


@pytest.mark.parametrize("name", list(CASES))
def test_members_match_run_trial(name, tmp_path):
    specs = specs_for(CASES[name])
    packed = run_trials(specs, cache_dir=str(tmp_path))
    for spec, result in zip(specs, packed, strict=True):
        solo = run_trial(spec, cache_dir=str(tmp_path))
        assert solo.status == "completed", solo.error
        assert_same_result(result, solo)
        assert result.final_val_loss < math.log(256) - 0.5  # they learned something
        assert any("packed" in note for note in result.notes)


def test_diverging_member_stops_alone(tmp_path):
    members = [MEMBERS[0], dict(lr=50.0, seed=5), MEMBERS[1]]
    specs = specs_for(CASES["gpt-completep"], members)
    delivered: list[tuple[int, dict]] = []
    packed = run_trials(specs, cache_dir=str(tmp_path),
                        on_result=lambda i, r: delivered.append((i, r.model_dump())))
    solo = [run_trial(s, cache_dir=str(tmp_path)) for s in specs]
    assert [r.status for r in packed] == ["completed", "diverged", "completed"]
    assert packed[1].steps < 60 and packed[1].error is None
    # the diverged member's result was handed over once, as it stopped; the others return
    assert delivered == [(1, packed[1].model_dump())]
    for p, s in zip(packed, solo, strict=True):
        assert_same_result(p, s)


def test_reporter_prunes_one_member(tmp_path):
    specs = specs_for(CASES["gpt-mup"])
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}

    def packed_reporter(member, metrics):
        seen[member].append(metrics["step"])
        return member == 1 and "val_loss" in metrics and metrics["step"] >= 20

    delivered: list[tuple[int, dict, int]] = []  # (member, result, member 0's last step)

    def on_result(member, result):
        delivered.append((member, result.model_dump(), seen[0][-1]))

    packed = run_trials(specs, reporter=packed_reporter, cache_dir=str(tmp_path),
                        on_result=on_result)
    assert [r.status for r in packed] == ["completed", "pruned", "completed"]
    # the pruned member's result was handed over as it stopped, while the others trained
    # on (a pack that dies later does not take it along), and is the one returned
    assert delivered == [(1, packed[1].model_dump(), 20)]
    solo_seen: list[int] = []

    def solo_reporter(metrics):
        solo_seen.append(metrics["step"])
        return "val_loss" in metrics and metrics["step"] >= 20

    solo = run_trial(specs[1], reporter=solo_reporter, cache_dir=str(tmp_path))
    assert solo.status == "pruned" and solo.steps == 20
    assert_same_result(packed[1], solo)
    assert seen[1] == solo_seen  # the member saw exactly the points a solo trial reports
    assert seen[0] == seen[2] == list(range(1, 61))
    assert_same_result(packed[0], run_trial(specs[0], cache_dir=str(tmp_path)))


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(width=128), "width"),
        (dict(arch="ngpt", parameterization="ngpt"), "arch"),
        (dict(budget={"steps": 61}), "budget"),
        (dict(batch_size=8), "batch_size"),
        (dict(beta2=0.99), "beta2"),
    ],
)
def test_unpackable_specs_name_the_field(change, field):
    a = TrialSpec(**TINY)
    b = TrialSpec(**{**TINY, **change})
    with pytest.raises(ValueError, match=f"field '{field}' differs"):
        run_trials([a, b])


def test_single_member_pack_and_dict_specs(tmp_path):
    spec = specs_for(CASES["gpt-sp"])[0]
    [packed] = run_trials([spec.model_dump()], cache_dir=str(tmp_path))
    assert_same_result(packed, run_trial(spec, cache_dir=str(tmp_path)))


@pytest.mark.parametrize("name", ["gpt-completep", "ngpt"])
def test_micro_batches_give_the_same_run_solo_and_packed(name, tmp_path, monkeypatch):
    """micro_batch_size 3 of batch 4 (pieces of 3 and 1 sequences, gradients accumulated):
    the same run as the whole batch at once, solo and packed, while the model never sees
    more than 3 sequences per pass, evaluations included (they ran the whole batch per pass,
    and a pack K batches: past what the memory split planned for)."""
    import hptransfer.workers.pack as pack_module
    import hptransfer.workers.trainer as trainer_module

    seen: list[int] = []  # sequences per training forward pass
    seen_eval: list[int] = []  # and per evaluation pass
    real_build = trainer_module.build_from_config

    def build_and_watch(*args, **kwargs):
        built = real_build(*args, **kwargs)
        built.model.register_forward_pre_hook(lambda module, inputs: (
            seen if module.training else seen_eval).append(inputs[0].shape[-2]))
        return built

    whole = specs_for(CASES[name])[:2]
    micro = [TrialSpec(**{**s.model_dump(), "micro_batch_size": 3}) for s in whole]
    assert [s.content_hash() for s in micro] == [s.content_hash() for s in whole]
    ref_solo = run_trial(whole[0], cache_dir=str(tmp_path))
    ref_packed = run_trials(whole, cache_dir=str(tmp_path))
    for module in (trainer_module, pack_module):
        monkeypatch.setattr(module, "build_from_config", build_and_watch)
    solo = run_trial(micro[0], cache_dir=str(tmp_path))
    assert seen[:4] == [3, 1, 3, 1] and max(seen) == 3  # two passes per step
    n_solo = len(seen)
    n_solo_eval = len(seen_eval)
    assert n_solo_eval and max(seen_eval) == 3
    packed = run_trials(micro, cache_dir=str(tmp_path))
    assert seen[n_solo:n_solo + 4] == [3, 1, 3, 1] and max(seen[n_solo:]) == 3
    assert len(seen_eval) > n_solo_eval and max(seen_eval[n_solo_eval:]) == 3
    for result, ref in ((solo, ref_solo), *zip(packed, ref_packed, strict=True)):
        assert result.status == ref.status == "completed", (result.error, ref.error)
        assert result.steps == ref.steps and result.tokens == ref.tokens
        assert result.curve[0]["train_loss"] == pytest.approx(ref.curve[0]["train_loss"],
                                                              rel=1e-6)
        assert result.final_val_loss == pytest.approx(ref.final_val_loss, rel=1e-4)


def test_every_member_diverging_at_one_sync_step_ends_diverged(tmp_path):
    """All members stopped at once left no member to index: compaction built its index from
    an empty (float) list and every member ended failed with an IndexError, so a tune stage
    whose LRs all diverged read as "failed, the LR range is not the cause"."""
    specs = [TrialSpec(**{**TINY, "lr": lr, "seed": i})
             for i, lr in enumerate((256.0, 512.0, 1024.0))]
    packed = run_trials(specs, cache_dir=str(tmp_path))
    for spec, result in zip(specs, packed, strict=True):
        assert result.status == "diverged", result.error
        assert_same_result(result, run_trial(spec, cache_dir=str(tmp_path)))


def test_cpu_pack_skips_only_passes_that_change_nothing(tmp_path, monkeypatch):
    """On the CPU a pack reads its clipping factors and alive mask back, scales only the
    members whose factor is below 1 and masks only once one has stopped: the numbers equal,
    to the bit, a pack that makes every pass, as it must on CUDA. Members at a low and a high
    LR (clipped at some steps, not at others) and one that diverges (masked until the next
    sync step)."""
    from hptransfer.workers import pack as pack_trainer

    members = [dict(lr=2**-9, seed=0), dict(lr=2**-6, seed=1), dict(lr=50.0, seed=2)]
    specs = specs_for(CASES["gpt-completep"], members)
    calls = {"scaled rows": 0, "masks": 0}
    mul_, masked_fill_ = torch.Tensor.mul_, torch.Tensor.masked_fill_

    def counting_mul_(self, other, *args, **kwargs):
        # the clipping's scale: the whole (members, P) buffer times a (members, 1) column,
        # or one member's row times its factor (AdamW's scales are on column slices, which
        # are not contiguous)
        if isinstance(other, torch.Tensor) and self.is_contiguous():
            if self.dim() == 2 and tuple(other.shape) == (self.shape[0], 1):
                calls["scaled rows"] += self.shape[0]
            elif self.dim() == 1 and tuple(other.shape) == (1,):
                calls["scaled rows"] += 1
        return mul_(self, other, *args, **kwargs)

    def counting_masked_fill_(self, *args, **kwargs):
        calls["masks"] += 1
        return masked_fill_(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "mul_", counting_mul_)
    monkeypatch.setattr(torch.Tensor, "masked_fill_", counting_masked_fill_)
    skipping = run_trials(specs, cache_dir=str(tmp_path))
    skipped = dict(calls)
    calls.update({"scaled rows": 0, "masks": 0})
    monkeypatch.setattr(pack_trainer, "reading_back_is_free", lambda device: False)
    every_pass = run_trials(specs, cache_dir=str(tmp_path))
    assert [r.status for r in skipping] == ["completed", "completed", "diverged"]
    for a, b in zip(skipping, every_pass, strict=True):
        assert a.curve == b.curve and a.final_val_loss == b.final_val_loss
    # every step makes both passes on CUDA, over every member still in the stacks
    steps = len(every_pass[0].curve)  # a curve point per step
    # (the diverged member stays in the stacks for one step more, until its sync step)
    member_steps = 2 * steps + every_pass[2].steps + 1
    assert steps == 60 and calls == {"scaled rows": member_steps, "masks": steps}
    # on the CPU some rows and some masks, not all
    assert 0 < skipped["scaled rows"] < calls["scaled rows"], skipped
    assert 0 < skipped["masks"] < steps, skipped


@pytest.mark.parametrize("bad_loss", [math.nan, 1e9], ids=["nan", "above-divergence"])
def test_a_member_whose_loss_diverges_is_not_updated_while_the_others_are(bad_loss, tmp_path):
    """The device-side mask of one optimizer step: a member whose loss is NaN, or above its
    divergence factor x its initial loss, keeps its parameters and AdamW moments (weight
    decay included) while the others step. The host stops it at the next sync step; until
    then nothing of it may move."""
    from hptransfer.workers.pack import Pack

    members = [dict(lr=2**-8, seed=0), dict(lr=2**-7, seed=1), dict(lr=2**-9, seed=2)]
    specs = specs_for({**CASES["gpt-completep"], "weight_decay": 0.1}, members)
    pack = Pack(specs, None, str(tmp_path))
    pack._row_idx = torch.tensor(pack.rows)
    xs, ys = zip(*(pack.data.train_batch(0, s.batch_size, s.seq_len, s.seed) for s in specs),
                 strict=True)
    losses = pack._gradients(torch.stack(xs), torch.stack(ys)).detach()
    faked = losses.clone()
    faked[1] = bad_loss
    before = [t.clone() for t in (pack.flat, pack.exp_avg, pack.exp_avg_sq)]
    with torch.no_grad():
        alive = pack._update(pack.gather_grads(), faked, torch.ones(3, dtype=torch.bool),
                             losses.double(), pack.factors[0, pack._row_idx], pack.bias1[0],
                             pack.bias2_sqrt[0])
    assert alive.tolist() == [True, False, True]
    for old, new in zip(before, (pack.flat, pack.exp_avg, pack.exp_avg_sq), strict=True):
        assert torch.equal(new[1], old[1])  # the diverged member: not a bit moved
        assert not torch.equal(new[0], old[0]) and not torch.equal(new[2], old[2])
