"""run_trial on the embedded corpus: learning, divergence, determinism, reporting, bad specs."""

import math

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from hptransfer.spec.trial import Schedule, TrialSpec
from hptransfer.workers.trainer import clip_gradients, run_trial

SMALL = dict(width=64, depth=2, head_dim=32, batch_size=8, seq_len=32,
             data={"val_tokens": 2048}, budget={"steps": 30})


def spec(**kw):
    return TrialSpec(**{**SMALL, **kw})


@pytest.mark.parametrize(
    "arch, param, lr, opts",
    [
        ("gpt", "completep", 2**-5, {}),
        ("gpt", "sp", 2**-7, {}),
        ("gpt", "mup", 2**-5, {"x0_mixing": True, "extra_embeddings": 1, "value_embeddings": 1}),
        ("ngpt", "ngpt", 2**-5, {}),
    ],
)
def test_loss_decreases_on_embedded_corpus(arch, param, lr, opts, tmp_path):
    r = run_trial(spec(arch=arch, parameterization=param, lr=lr, arch_options=opts),
                  cache_dir=str(tmp_path))
    assert r.status == "completed", r.error
    first = r.curve[0]["train_loss"]
    assert abs(first - math.log(256)) < 0.5  # starts near uniform over bytes
    assert r.final_val_loss < math.log(256) - 1.0
    assert r.tokens == 30 * 8 * 32 and r.steps == 30
    assert r.flops == pytest.approx(r.flops_per_token * r.tokens)
    assert r.param_table["groups"] and r.data_hash and r.spec_hash


def test_huge_lr_diverges_early(tmp_path):
    r = run_trial(spec(lr=100.0, budget={"steps": 200}), cache_dir=str(tmp_path))
    assert r.status == "diverged"
    assert r.steps < 200 and r.final_val_loss is None and r.error is None


def test_same_spec_same_loss(tmp_path):
    a = run_trial(spec(lr=2**-6, seed=3), cache_dir=str(tmp_path))
    b = run_trial(spec(lr=2**-6, seed=3), cache_dir=str(tmp_path))
    c = run_trial(spec(lr=2**-6, seed=4), cache_dir=str(tmp_path))
    assert a.final_val_loss == b.final_val_loss
    assert a.final_val_loss != c.final_val_loss


def test_reporter_sees_val_loss_and_can_prune(tmp_path):
    seen = []

    def reporter(m):
        seen.append(m)
        return "val_loss" in m and m["step"] >= 10  # stop at the first evaluation past step 10

    r = run_trial(spec(eval_every=5), reporter=reporter, cache_dir=str(tmp_path))
    assert r.status == "pruned"
    assert r.steps == 10
    assert [m["step"] for m in seen if "val_loss" in m] == [5, 10]



def test_evaluations_are_capped_so_a_curve_stays_bounded(tmp_path, monkeypatch):
    from hptransfer.workers import plan as plan_module

    # eval_every=1 on a 100k-step trial: at most MAX_EVALUATIONS evaluations (curve points)
    long = spec(eval_every=1, budget={"steps": 100_000})
    data = plan_module.load_trial_data(long, str(tmp_path))
    planned = plan_module.plan_trial(long, data)
    steps = range(1, planned.total_steps + 1)
    assert sum(map(planned.is_eval_step, steps)) == plan_module.MAX_EVALUATIONS == 200
    assert sum(planned.is_curve_step(d) or planned.is_eval_step(d) for d in steps) <= 250
    assert "eval_every raised from 1 to 500" in " ".join(planned.notes)
    # a short trial keeps the eval_every it asked for, without a note
    short = plan_module.plan_trial(spec(eval_every=1), data)
    assert short.eval_every == 1 and not any("eval_every" in n for n in short.notes)
    # and a trained trial evaluates where its plan says, saying why in its notes
    monkeypatch.setattr(plan_module, "MAX_EVALUATIONS", 4)
    r = run_trial(spec(eval_every=1), cache_dir=str(tmp_path))
    assert [p["step"] for p in r.curve if "val_loss" in p] == [8, 16, 24, 30]
    assert any("eval_every raised from 1 to 8" in n for n in r.notes)

def test_tokens_per_param_budget(tmp_path):
    s = spec(budget={"tokens_per_param": 0.5})
    r = run_trial(s, cache_dir=str(tmp_path))
    assert r.tokens == math.ceil(0.5 * r.params_non_embedding / 256) * 256


def test_a_budget_rounded_up_by_more_than_a_tenth_says_so(tmp_path):
    from hptransfer.workers import plan as plan_module

    data = plan_module.load_trial_data(spec(), str(tmp_path))
    # a step is 256 tokens here: 1 token trains 256, 250 trains 256 (within a tenth), 231
    # trains 256 (10.8 % more)
    for budget, noted in (({"tokens": 1}, True), ({"tokens": 250}, False),
                          ({"tokens": 231}, True), ({"tokens": 256}, False),
                          ({"steps": 1}, False)):
        planned = plan_module.plan_trial(spec(budget=budget), data)
        said = [n for n in planned.notes if "whole step" in n]
        assert planned.total_steps * planned.tokens_per_step == 256
        assert bool(said) == noted, (budget, planned.notes)
    (note,) = [n for n in plan_module.plan_trial(spec(budget={"tokens": 1}), data).notes
               if "whole step" in n]
    assert note == "the budget of 1 tokens is trained as 1 whole step(s) of 256 tokens: 256 tokens"


def test_failed_trial_reports_error(tmp_path):
    r = run_trial(spec(data={"source": str(tmp_path / "missing.bin"), "vocab_size": 256}))
    assert r.status == "failed" and r.curve == []
    assert "does not exist" in r.error or "not found" in r.error.lower()


def test_a_trial_that_fails_midway_keeps_the_curve_it_reported(tmp_path):
    """MLflow showed those points live: the app DB, which owns the result, holds them too."""
    from hptransfer.workers.packed import run_trials

    seen = []

    def reporter(metrics):
        seen.append(dict(metrics))
        if metrics["step"] == 12:
            raise RuntimeError("the node's disk is full")

    r = run_trial(spec(), reporter=reporter, cache_dir=str(tmp_path))
    assert r.status == "failed" and "disk is full" in r.error
    assert r.curve == seen and [p["step"] for p in r.curve] == list(range(1, 13))

    def packed_reporter(member, metrics):
        if member == 1 and metrics["step"] == 7:
            raise RuntimeError("the node's disk is full")

    out = run_trials([spec(seed=0), spec(seed=1)], reporter=packed_reporter,
                     cache_dir=str(tmp_path))
    assert [x.status for x in out] == ["failed", "failed"]  # one pack: it fails as a whole
    assert [len(x.curve) for x in out] == [7, 7]  # both had their step-7 point


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(width=100), "divisible"),
        (dict(parameterization="ngpt"), "only for arch 'ngpt'"),
        (dict(lr=0), "lr"),
        (dict(budget={"steps": 10, "tokens": 5}), "exactly one"),
        (dict(unknown_field=1), "unknown_field"),
        (dict(parameterization="depth_alpha", alpha=2.0), "alpha"),
    ],
)
def test_bad_specs_rejected(bad, field):
    with pytest.raises(ValidationError, match=field):
        spec(**bad)


def test_schedules():
    s = Schedule(warmup_fraction=0.1, decay="linear")
    assert s.factor(0, 100) == pytest.approx(0.1)
    assert s.factor(9, 100) == pytest.approx(1.0)
    assert s.factor(55, 100) == pytest.approx(0.5)
    cos = Schedule(warmup_fraction=0.0, decay="cosine")
    assert cos.factor(50, 100) == pytest.approx(0.5)
    wsd = Schedule(warmup_fraction=0.0, decay="wsd", wsd_decay_fraction=0.2)
    assert wsd.factor(70, 100) == 1.0 and wsd.factor(90, 100) == pytest.approx(0.5)
    assert Schedule(warmup_fraction=0.5).factor(0, 10, warmup=False) == 1.0


def test_content_hash_ignores_device_only():
    assert spec(device="cpu").content_hash() == spec(device="auto").content_hash()
    assert spec(lr=0.1).content_hash() != spec(lr=0.2).content_hash()


def test_bpe_tokenizer_sets_the_vocabulary(tmp_path):
    r = run_trial(spec(data={"tokenizer": "bpe", "bpe_vocab_size": 512,
                             "max_corpus_bytes": 300_000, "val_tokens": 2048}),
                  cache_dir=str(tmp_path))
    assert r.status == "completed", r.error
    # the embedding tables follow the trained BPE vocabulary, not the 256 bytes
    assert r.params_embedding == 2 * 512 * 64
    assert r.curve[0]["train_loss"] == pytest.approx(math.log(512), abs=0.5)


def test_trains_on_modded_nanogpt_shards(tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    for i in range(2):  # header: magic 20240520, version 1, token count; then uint16 tokens
        tokens = rng.integers(0, 300, size=40_000, dtype=np.uint16)
        header = np.zeros(256, dtype=np.int32)
        header[:3] = (20240520, 1, tokens.size)
        with open(tmp_path / f"shard_{i:02d}.bin", "wb") as f:
            f.write(header.tobytes())
            f.write(tokens.tobytes())
    r = run_trial(spec(data={"source": str(tmp_path), "vocab_size": 300, "val_tokens": 2048}),
                  cache_dir=str(tmp_path / "cache"))
    assert r.status == "completed", r.error
    assert r.params_embedding == 2 * 300 * 64
    assert r.final_val_loss < math.log(300) + 0.2  # random tokens: nothing to learn, no blow-up


def test_trial_and_sweep_data_sections_are_the_data_layer_spec():
    # One definition: the sweep's and the trial's data sections are DataSpec itself.
    from hptransfer.data import DataSpec
    from hptransfer.spec import SweepSpec
    from hptransfer.spec.trial import TrialSpec

    assert TrialSpec.model_fields["data"].annotation is DataSpec
    assert SweepSpec.model_fields["data"].annotation is DataSpec


def test_the_content_hash_changes_with_the_result_revision(monkeypatch):
    """Results trained before a change that alters them are not reused after it."""
    from hptransfer.spec import trial

    before = spec().content_hash()
    monkeypatch.setattr(trial, "RESULT_REVISION", trial.RESULT_REVISION + 1)
    assert spec().content_hash() != before
    assert spec(device="cpu").content_hash() == spec(device="auto").content_hash()


@pytest.mark.parametrize("packed", [False, True])
def test_training_flushes_subnormals_on_every_thread_and_then_restores_the_setting(
        packed, tmp_path):
    import torch

    from hptransfer.workers.packed import run_trials

    # a batch of subnormal matrices: on two threads a bmm splits the batch between them, and
    # each row of the product is 64 subnormals added up, a normal float unless they read as 0
    tiny = torch.full((8, 64, 64), 2.0**-130)
    ones = torch.ones(64, 64).expand(8, 64, 64)
    assert torch.all(torch.bmm(tiny, ones) > 0)  # the caller keeps subnormals (x86's default)
    inside = []

    def reporter(*args):
        inside.append(bool(torch.all(torch.bmm(tiny, ones) == 0)))

    s = spec(num_threads=2, budget={"steps": 3}, lr=2**-6)
    if packed:
        results = run_trials([s, s.model_copy(update={"lr": 2**-7})], reporter=reporter,
                             cache_dir=str(tmp_path))
        assert [r.status for r in results] == ["completed"] * 2
    else:
        assert run_trial(s, reporter=reporter, cache_dir=str(tmp_path)).status == "completed"
    assert inside and all(inside)  # flushed on both threads while training
    assert torch.all(torch.bmm(tiny, ones) > 0)  # and the caller's setting back afterwards


@pytest.mark.parametrize("max_norm", [10.0, 1000.0])  # the norm is ~144: clipped, not
def test_clip_gradients_gives_clip_grad_norm_s_numbers_and_skips_a_scale_by_one(max_norm):
    """Bit for bit torch.nn.utils.clip_grad_norm_'s gradients, clipped or not; when not,
    no gradient is written (torch multiplies every one by 1.0, which changes nothing)."""
    shapes = [(64, 64), (64,), (256, 64), (3, 5, 7), (1,)]
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen) for s in shapes]

    def params_with(gs: list[torch.Tensor]) -> list[torch.nn.Parameter]:
        out = [torch.nn.Parameter(torch.zeros_like(g)) for g in gs]
        for p, g in zip(out, gs, strict=True):
            p.grad = g.clone()
        return out

    theirs, ours = params_with(grads), params_with(grads)
    torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    before = [p.grad._version for p in ours]
    clip_gradients(ours, max_norm)
    for a, b in zip(theirs, ours, strict=True):
        assert torch.equal(a.grad, b.grad)
    clipped = bool(max_norm < torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
    assert clipped == (max_norm == 10.0)
    assert [p.grad._version for p in ours] != before if clipped else \
        [p.grad._version for p in ours] == before
    if not clipped:  # torch did scale, by exactly 1.0
        assert all(torch.equal(p.grad, g) for p, g in zip(theirs, grads, strict=True))
        assert all(p.grad._version > 0 for p in theirs)
    # a NaN gradient makes the norm NaN, and torch then scales every gradient by NaN
    grads[1][0] = math.nan
    theirs, ours = params_with(grads), params_with(grads)
    torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    clip_gradients(ours, max_norm)
    assert all(p.grad.isnan().all() for p in ours)
    for a, b in zip(theirs, ours, strict=True):
        assert torch.equal(a.grad.isnan(), b.grad.isnan())


def test_a_failed_trials_traceback_names_files_by_import_path_chained_ones_too():
    """The traceback a failed trial stores (and the API returns) names each file by its
    import path, never where the server installed it: the exception's own frames and those
    of the one it was raised from."""
    import json

    from hptransfer.workers.outcome import shown_traceback

    try:
        try:
            json.loads("{")
        except json.JSONDecodeError as exc:
            raise ValueError("the spec is not JSON") from exc
    except ValueError as exc:
        text = shown_traceback(exc)
    assert 'File "json/decoder.py"' in text and 'File "tests/test_trainer.py"' not in text
    assert 'File "test_trainer.py"' in text  # tests/ is no package: its bare name
    assert 'File "/' not in text and "direct cause" in text
    assert text.rstrip().endswith("ValueError: the spec is not JSON")


def _curve_losses(r) -> list[float]:
    return [p["train_loss"] for p in r.curve]


def test_micro_batches_train_what_the_whole_batch_trains(tmp_path):
    """Gradient accumulation: a batch of 8 in passes of 3, 3 and 2 sequences, each pass's
    mean loss weighted by its share (3/8, 3/8, 2/8), trains the whole batch's numbers and
    reports the whole batch's mean loss (up to the order of float sums)."""
    s = dict(budget={"steps": 6}, eval_every=3, grad_clip=None)
    whole = run_trial(spec(**s), cache_dir=str(tmp_path))
    micro = run_trial(spec(micro_batch_size=3, **s), cache_dir=str(tmp_path))
    assert whole.status == micro.status == "completed", (whole.error, micro.error)
    assert len(whole.curve) == len(micro.curve) == 6
    assert _curve_losses(micro) == pytest.approx(_curve_losses(whole), rel=1e-4)
    assert micro.final_val_loss == pytest.approx(whole.final_val_loss, rel=1e-4)


def _recording_lrs(monkeypatch) -> list[list[tuple[float, float]]]:
    """Make the trainer's optimizer record each group's (lr, initial_lr) at every step."""
    from hptransfer.workers import trainer as trainer_module

    steps: list[list[tuple[float, float]]] = []
    real = trainer_module.lone_optimizer

    def recording(*args, **kwargs):
        opt = real(*args, **kwargs)
        step = opt.step

        def step_and_record():
            steps.append([(g["lr"], g["initial_lr"]) for g in opt.param_groups])
            return step()

        opt.step = step_and_record
        return opt

    monkeypatch.setattr(trainer_module, "lone_optimizer", recording)
    return steps


def test_each_groups_lr_follows_the_schedule_and_points_count_tokens(tmp_path, monkeypatch):
    """10 steps, 20 % linear warmup then linear decay to 0: factors 1/2, 1, then
    1 - (s - 2) / 8 for s = 2..9 (worked out by hand). Every param group's LR at step s is
    its table LR times that factor, the curve's lr is the spec's lr times it, and the point
    after step s counts s steps' tokens."""
    factors = [0.5, 1.0] + [1 - (s - 2) / 8 for s in range(2, 10)]
    steps = _recording_lrs(monkeypatch)
    r = run_trial(spec(budget={"steps": 10}, lr=2**-6,
                       schedule={"warmup_fraction": 0.2, "decay": "linear"}),
                  cache_dir=str(tmp_path))
    assert r.status == "completed", r.error
    assert len(steps) == 10
    table_lrs = sorted(g["lr"] for g in r.param_table["groups"])
    for factor, groups in zip(factors, steps, strict=True):
        assert sorted(initial for _, initial in groups) == table_lrs
        for lr, initial in groups:
            assert lr == pytest.approx(initial * factor, rel=1e-12)
    assert [p["lr"] for p in r.curve] == pytest.approx([2**-6 * f for f in factors])
    # each point's tokens: its step count times 8 sequences of 32 tokens
    assert [(p["step"], p["tokens"]) for p in r.curve] == [(s, s * 8 * 32) for s in range(1, 11)]


def test_a_stop_asked_at_the_last_step_leaves_the_trial_completed(tmp_path):
    """A reporter's stop at the final point comes too late to prune anything: the trial
    trained its whole budget, so it is completed, with its final validation loss."""
    r = run_trial(spec(budget={"steps": 4}), reporter=lambda m: m["step"] == 4,
                  cache_dir=str(tmp_path))
    assert r.status == "completed" and r.steps == 4 and r.final_val_loss is not None


@pytest.mark.parametrize("grad_clip", [0.25, None])
def test_gradients_are_clipped_at_every_step_to_the_specs_norm(grad_clip, tmp_path,
                                                                 monkeypatch):
    """grad_clip: clip_gradients(params, grad_clip) before each of the 3 steps; None: never."""
    from hptransfer.workers import trainer as trainer_module

    calls: list[float] = []

    def spy(params, max_norm):
        calls.append(max_norm)
        return clip_gradients(params, max_norm)

    monkeypatch.setattr(trainer_module, "clip_gradients", spy)
    r = run_trial(spec(budget={"steps": 3}, grad_clip=grad_clip), cache_dir=str(tmp_path))
    assert r.status == "completed", r.error
    assert calls == ([grad_clip] * 3 if grad_clip else [])


def test_evaluate_is_the_mean_token_loss_over_every_validation_window(tmp_path):
    """evaluate() over passes of 3 windows (the last one shorter) equals torch's mean
    cross-entropy over all windows at once: a mean per token, not per pass or per window."""
    from hptransfer.workers import plan as plan_module
    from hptransfer.workers.trainer import evaluate

    s = spec(micro_batch_size=3, data={"val_tokens": 1000})
    plan = plan_module.plan_trial(s, plan_module.load_trial_data(s, str(tmp_path)))
    windows = (1000 - 1) // 32
    assert plan.pass_size == 3 and windows % 3 != 0
    table = torch.nn.Embedding(256, 256)
    torch.nn.init.normal_(table.weight, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        (x, y), = plan.data.val_batches(windows, 32)
        expected = F.cross_entropy(table(x).flatten(0, 1), y.flatten()).item()
    assert x.shape == (windows, 32)
    assert evaluate(table, plan) == pytest.approx(expected, rel=1e-6)


def test_the_default_eval_every_gives_about_ten_evaluations(tmp_path):
    """eval_every unset: every total_steps // 10 steps (at least 1), plus the last step."""
    from hptransfer.workers import plan as plan_module

    data = plan_module.load_trial_data(spec(), str(tmp_path))
    for steps, every in ((30, 3), (25, 2), (5, 1)):
        planned = plan_module.plan_trial(spec(budget={"steps": steps}), data)
        assert planned.eval_every == every, steps
    planned = plan_module.plan_trial(spec(budget={"steps": 25}), data)
    assert [d for d in range(1, 26) if planned.is_eval_step(d)] == [*range(2, 25, 2), 25]


def test_a_resumed_attempt_counts_all_its_tokens_but_its_speed_from_its_own_steps(tmp_path):
    """Resumed at step 6 and done at 10, in 2 s of training, batches of 8 x 32 tokens: the
    result counts 10 steps' tokens (2560) and FLOPs, 4 steps' retrained tokens if it
    redid 4, but its speed is the 4 steps it trained itself: 1024 tokens / 2 s."""
    from hptransfer.models import table_for
    from hptransfer.workers import plan as plan_module
    from hptransfer.workers.outcome import Progress, trial_result

    s = spec(budget={"steps": 10})
    planned = plan_module.plan_trial(s, plan_module.load_trial_data(s, str(tmp_path)))
    progress = Progress(steps_done=10, train_loss=3.0, val_loss=3.1)
    r = trial_result(planned, progress, table=table_for(planned.cfg, s.parameterization_obj()),
                     train_time=2.0, started=0.0, notes=[], resumed_from=6, retrained=4)
    assert (r.steps, r.tokens, r.retrained_tokens) == (10, 2560, 1024)
    assert r.tokens_per_s == pytest.approx(1024 / 2.0)
    assert r.flops == pytest.approx(r.flops_per_token * 2560)
    assert r.resumed_from_step == 6
