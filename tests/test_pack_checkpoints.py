"""Packed trials checkpoint (workers/pack.py): a pack writes, for each member still training,
the checkpoint run_trial writes for that trial alone, so that a member of a pack stopped
after a checkpoint (killed, or preempted by SIGTERM) resumes alone through run_trial and ends
as its uninterrupted lone run does (to fp32 rounding: the pack's batched arithmetic is
run_trial's up to rounding, tests/test_packed.py)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from hptransfer.models.build import build_from_config
from hptransfer.models.parameterization import optimizer_groups
from hptransfer.spec.trial import TrialSpec
from hptransfer.workers import checkpoints as checkpoints_module
from hptransfer.workers import plan as plan_module
from hptransfer.workers.checkpoints import CheckpointPolicy, TrialCheckpoints
from hptransfer.workers.flat_adamw import FlatAdamW
from hptransfer.workers.packed import run_trials
from hptransfer.workers.plan import load_trial_data, plan_trial
from hptransfer.workers.trainer import run_trial

BASE = dict(width=32, depth=2, head_dim=16, seq_len=32, batch_size=8, budget={"steps": 48},
            data={"source": "stdlib", "tokenizer": "byte"}, eval_every=16, num_threads=1)
# members differ in what a pack allows: lr, seed, weight decay, schedule
MEMBERS = [dict(lr=2**-8, seed=0), dict(lr=2**-9, seed=1, weight_decay=0.1),
           dict(lr=2**-8, seed=2, schedule={"decay": "cosine"})]
EVERY = 12


class Killed(BaseException):
    """Ends a run as a dead process would (not an Exception: nothing turns it into a
    failed result)."""


def specs() -> list[dict]:
    return [{**BASE, **m} for m in MEMBERS]


def policy(root: Path, i: int, every_steps: int | None = EVERY) -> CheckpointPolicy:
    return CheckpointPolicy(url=str(root), key=f"sweep/trial{i}", every_steps=every_steps,
                            every_minutes=None)


def policies(root: Path, every_steps: int | None = EVERY) -> list[CheckpointPolicy]:
    return [policy(root, i, every_steps) for i in range(len(MEMBERS))]


@pytest.fixture(autouse=True)
def reached_every_step(monkeypatch):
    monkeypatch.setattr(checkpoints_module, "REACHED_EVERY_S", 0.0)  # runs take under 1 s


@pytest.fixture(scope="module")
def alone(tmp_path_factory) -> list:
    """Each member's uninterrupted lone run (the reference)."""
    cache = str(tmp_path_factory.mktemp("cache"))
    return [run_trial(s, cache_dir=cache) for s in specs()]


def assert_resumes_as_alone(resumed, whole, step: int) -> None:
    assert resumed.status == whole.status == "completed", resumed.error
    assert resumed.resumed_from_step == step
    assert (resumed.steps, resumed.tokens, resumed.flops) == (whole.steps, whole.tokens,
                                                              whole.flops)
    assert [p["step"] for p in resumed.curve] == [p["step"] for p in whole.curve]
    assert [p["lr"] for p in resumed.curve] == [p["lr"] for p in whole.curve]
    for got, want in zip(resumed.curve, whole.curve, strict=True):
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-3)
        assert ("val_loss" in got) == ("val_loss" in want)
        if "val_loss" in want:
            assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-3)
    assert resumed.final_val_loss == pytest.approx(whole.final_val_loss, rel=1e-3)


def test_a_killed_pack_resumes_each_member_alone(tmp_path, alone):
    """Checkpoints every 12 steps; the pack dies after step 40: each member resumes alone
    from step 36, re-training 4 steps (fewer than one interval), and ends as alone."""
    cache, root = str(tmp_path / "cache"), tmp_path / "ckpt"

    def reporter(i: int, metrics: dict) -> None:
        if metrics["step"] >= 40:
            raise Killed

    with pytest.raises(Killed):
        run_trials(specs(), reporter=reporter, cache_dir=cache, checkpoints=policies(root))
    for i, s in enumerate(specs()):
        resumed = run_trial(s, cache_dir=cache, checkpoints=policy(root, i))
        assert_resumes_as_alone(resumed, alone[i], 36)
        assert resumed.retrained_tokens == (40 - 36) * 8 * 32
        assert not (root / "sweep" / f"trial{i}").exists()  # finished alone: deleted


def test_a_pack_out_of_memory_goes_on_alone_from_each_members_checkpoint(tmp_path, alone):
    """Checkpoints every 12 steps; the pack fails to allocate at step 40 (raised from the
    reporter: the pack's path for any allocation failure): each member goes on alone from
    step 36 in the same call, re-training 4 steps, not the 40 a halved pack retrains from
    step 0; the reporter hears each step once, and the result is the lone run's."""
    cache, root = str(tmp_path / "cache"), tmp_path / "ckpt"
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    failed = []

    def reporter(i: int, metrics: dict) -> None:
        seen[i].append(metrics["step"])
        if metrics["step"] == 40 and not failed:
            failed.append(i)
            raise torch.OutOfMemoryError("can't allocate memory (injected)")

    results = run_trials(specs(), reporter=reporter, cache_dir=cache,
                         checkpoints=policies(root))
    assert failed == [0]
    for i, result in enumerate(results):
        assert_resumes_as_alone(result, alone[i], 36)
        assert result.retrained_tokens == (40 - 36) * 8 * 32
        assert any("a pack of 3 ran out of memory" in n and "went on alone from its "
                   "checkpoint" in n for n in result.notes), result.notes
        assert seen[i] == list(range(1, 49))  # each step once, the re-trained ones not again


def test_sigterm_checkpoints_the_pack_then_each_member_resumes_there(tmp_path, alone,
                                                                     monkeypatch):
    """Preemption: SIGTERM during step 30's sync; the pack finishes step 31, checkpoints
    every member there (no interval due) and hands the signal on; each resumes at 31."""
    cache, root = str(tmp_path / "cache"), tmp_path / "ckpt"

    def ray_worker(signum, frame):  # the handler before the pack's: Ray's raises SystemExit
        raise Killed

    previous = signal.signal(signal.SIGTERM, ray_worker)
    try:
        def reporter(i: int, metrics: dict) -> None:
            if metrics["step"] == 30 and i == 0:
                signal.raise_signal(signal.SIGTERM)

        with pytest.raises(Killed):
            run_trials(specs(), reporter=reporter, cache_dir=cache,
                       checkpoints=policies(root, every_steps=None))
    finally:
        signal.signal(signal.SIGTERM, previous)
    for i, s in enumerate(specs()):
        resumed = run_trial(s, cache_dir=cache, checkpoints=policy(root, i))
        assert_resumes_as_alone(resumed, alone[i], 31)
        assert resumed.retrained_tokens == 0


def test_a_member_checkpoint_is_the_lone_runs(tmp_path, monkeypatch):
    """A member's checkpoint loads into a lone model and optimizer with no missing or
    unexpected keys, and holds what run_trial's own checkpoint at that step holds: the
    weights, the AdamW moments and step count, the progress (fp32 rounding apart). With a
    curve point every 9 steps, step 12 is no sync step: the checkpoint makes it one."""
    monkeypatch.setattr(plan_module, "CURVE_POINTS", 5)  # 48 // 5: a point every 9 steps
    cache = str(tmp_path / "cache")
    pack_root, lone_root = tmp_path / "pack", tmp_path / "lone"

    def killed_at(step: int):
        def reporter(*args) -> None:
            if args[-1]["step"] >= step:
                raise Killed
        return reporter

    with pytest.raises(Killed):
        run_trials(specs(), reporter=killed_at(14), cache_dir=cache,
                   checkpoints=policies(pack_root))
    for i, s in enumerate(specs()):
        with pytest.raises(Killed):
            run_trial(s, reporter=killed_at(14), cache_dir=cache,
                      checkpoints=policy(lone_root, i))
        packed = TrialCheckpoints(policy(pack_root, i), []).latest()
        lone = TrialCheckpoints(policy(lone_root, i), []).latest()
        assert packed is not None and lone is not None
        assert packed[0] == lone[0] == EVERY
        got, want = packed[1], lone[1]
        assert got.keys() == want.keys()
        assert got["steps_done"] == want["steps_done"] == EVERY
        # the lone model and optimizer take it, strictly
        spec = TrialSpec.model_validate(s)
        plan = plan_trial(spec, load_trial_data(spec, cache))
        built = build_from_config(plan.cfg, spec.parameterization_obj(), seed=spec.seed)
        assert list(got["model"]) == list(built.model.state_dict())
        built.model.load_state_dict(got["model"])  # strict: no missing or unexpected keys
        opt = FlatAdamW(optimizer_groups(built.model, built.table), (spec.beta1, spec.beta2))
        opt.load_state_dict(got["optimizer"])
        for name, tensor in want["model"].items():
            assert got["model"][name].shape == tensor.shape
            torch.testing.assert_close(got["model"][name], tensor, rtol=1e-4, atol=1e-5)
        for g, w in zip(got["optimizer"]["groups"], want["optimizer"]["groups"], strict=True):
            assert g["steps"] == w["steps"] == EVERY
            assert w["exp_avg"].abs().max() > 0
            torch.testing.assert_close(g["exp_avg"], w["exp_avg"], rtol=1e-3, atol=1e-7)
            torch.testing.assert_close(g["exp_avg_sq"], w["exp_avg_sq"], rtol=1e-3, atol=1e-10)
        gp, wp = got["progress"], want["progress"]
        assert gp["steps_done"] == wp["steps_done"]
        assert [p["step"] for p in gp["curve"]] == [p["step"] for p in wp["curve"]]
        assert gp["train_loss"] == pytest.approx(wp["train_loss"], rel=1e-4)


def test_a_finished_pack_leaves_no_checkpoints(tmp_path):
    root = tmp_path / "ckpt"
    results = run_trials(specs()[:2], cache_dir=str(tmp_path / "cache"),
                         checkpoints=policies(root)[:2])
    assert [r.status for r in results] == ["completed", "completed"]
    assert not any((root / "sweep").glob("trial*"))


def test_the_dispatcher_gives_a_pack_its_members_policies_and_retries_them_alone(hpt_home):
    """The coordinator's pack task gets each member's policy (RayRunner._checkpoint, the
    lone path's); a pack killed after a checkpoint leaves each member one that the
    dispatcher sees (leased alone: may_resume) and run_trial resumes from."""
    import copy
    import dataclasses
    import inspect

    from conftest import TINY_SPEC

    from hptransfer.config import get_settings
    from hptransfer.coordinator.dispatch_context import DispatchContext
    from hptransfer.coordinator.plan import plan_sweep
    from hptransfer.coordinator.ray_runner import RayRunner
    from hptransfer.spec import load_spec
    from hptransfer.store.store import Store
    from hptransfer.workers.remote import execute_trials

    store = Store(get_settings().database_url)
    store.migrate()
    try:
        spec = load_spec({**copy.deepcopy(TINY_SPEC), "checkpoint": {"every_steps": 4}})
        sweep_id = store.create_sweep("packed", spec.model_dump(mode="json"), "packed",
                                      "grid", plan_sweep(spec))
        runner = RayRunner(DispatchContext(store, get_settings(), None, "me", 0.01),
                           should_prune=lambda *a: False, after_stored=lambda *a: None)
        calls = []

        class PackTask:  # stands in for ray.remote(execute_trials)
            def options(self, **options):
                return self

            def remote(self, *args, **kwargs):
                calls.append(inspect.signature(execute_trials).bind(*args, **kwargs))
                return object()

        runner.run_pack = PackTask()
        # the two stable LRs (2^-4 may diverge in 10 steps: a final member has none)
        trials = [t for t in store.trials(sweep_id, limit=None) if t.spec["lr"] <= 2**-6]
        assert len(trials) == 2
        runner.submit(spec, trials)
        task = calls[0].arguments
        assert task["checkpoints"] == [runner._checkpoint(spec, t) for t in trials]
        policies_given = [CheckpointPolicy(**c) for c in task["checkpoints"]]

        def dies_after_step_6(i: int, metrics: dict) -> None:
            if metrics["step"] >= 6:
                raise Killed

        with pytest.raises(Killed):  # what the task runs, with what it was given
            run_trials(task["specs"], reporter=dies_after_step_6,
                       cache_dir=task["cache_dir"], checkpoints=policies_given)
        for t, s, p in zip(trials, task["specs"], policies_given, strict=True):
            assert runner.may_resume(spec, dataclasses.replace(t, attempts=1))
            resumed = run_trial(s, cache_dir=task["cache_dir"], checkpoints=p)
            assert resumed.status == "completed" and resumed.resumed_from_step == 4
    finally:
        store.close()


def test_with_torch_adamw_the_checkpoint_is_torch_adamw_s(tmp_path, monkeypatch):
    """Where the lone trial steps torch.optim.AdamW (fused, on CUDA), a member's checkpoint
    holds that optimizer's state dict: checked here on the CPU with fused AdamW standing in,
    loaded strictly into a lone one, each parameter's moments the FlatAdamW checkpoint's."""
    from hptransfer.workers import pack as pack_module
    from hptransfer.workers.pack import Pack

    members = [TrialSpec.model_validate({**s, "budget": {"steps": 5}}) for s in specs()[:2]]
    spec = members[1]  # with weight decay
    pack = Pack(members, None, str(tmp_path / "cache"))
    pack.train()
    flat_state = pack.member_state(1, 5)
    monkeypatch.setattr(pack_module, "lone_optimizer", lambda groups, betas, device:
                        torch.optim.AdamW(groups, betas=betas, fused=True))
    state = pack.member_state(1, 5)
    plan = plan_trial(spec, load_trial_data(spec, str(tmp_path / "cache")))
    built = build_from_config(plan.cfg, spec.parameterization_obj(), seed=spec.seed)
    built.model.load_state_dict(state["model"])
    opt = torch.optim.AdamW(optimizer_groups(built.model, built.table),
                            betas=(spec.beta1, spec.beta2), fused=True)
    opt.load_state_dict(state["optimizer"])
    params = [p for g in opt.param_groups for p in g["params"]]
    flat = FlatAdamW(optimizer_groups(built.model, built.table), (spec.beta1, spec.beta2))
    flat.load_state_dict(flat_state["optimizer"])
    assert len(opt.state) == len(params)
    for p, m, v in zip(params, [m for f in flat._flat for m in f.exp_avg_views],
                       [v for f in flat._flat for v in f.exp_avg_sq_views], strict=True):
        assert float(opt.state[p]["step"]) == 5
        assert torch.equal(opt.state[p]["exp_avg"], m)
        assert torch.equal(opt.state[p]["exp_avg_sq"], v)
    assert any(float(opt.state[p]["exp_avg"].abs().max()) > 0 for p in params)
