"""Sharded data-parallel trials (FSDP2, `fully_shard`, workers/sharding.py): W ranks (gloo,
one CPU each) that each hold 1/W of the model train the numbers one process trains (up to
the order of the sums), for GPT, nGPT (whose unit-norm projection spans the shards) and x0
mixing, with micro-batches, an uneven split and gradient clipping; through Ray Train as the
dispatcher runs them; a preempted sharded trial resumes from its gathered checkpoint to the
uninterrupted run's numbers, to the bit. The spec's `shard` switch is checked with its field
named, and admission prices a sharded worker's memory at 1/W of the state."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from ranks import assert_same_trial, on_ranks_each, polling_quickly, run_ranks

from hptransfer.workers.checkpoints import CheckpointPolicy, TrialCheckpoints
from hptransfer.workers.trainer import run_trial

ARCHS = {
    "gpt": {"arch": "gpt"},
    "ngpt": {"arch": "ngpt", "parameterization": "ngpt"},
    "x0_mixing": {"arch": "gpt", "arch_options": {"x0_mixing": True, "extra_embeddings": 2}},
    # 3 sequences in passes of 1: rank 0's 1 row and rank 1's 2 take 2 passes each, the
    # second of rank 0's without rows of its own (it must still run: a pass is collective)
    "gpt_empty_pass": {"arch": "gpt", "batch_size": 3, "micro_batch_size": 1,
                       "eval_every": 12},
}
SHARDED_NOTE = "the model is sharded over the 2 workers (FSDP)"


def spec(**kw) -> dict:
    # 9 sequences over 2 ranks in micro-batches of 2: 4 rows (2 + 2) and 5 (2 + 2 + 1), so
    # each rank's loss weighs 8/9 and 10/9; clipping at 0.5 is active for these steps, so
    # its norm must be the whole model's
    # 125 validation windows in passes of 2 x 2: the last one's 1 window is rank 1's alone
    base = dict(width=32, depth=2, head_dim=16, lr=2**-8, seq_len=32, batch_size=9,
                micro_batch_size=2, budget={"steps": 12}, grad_clip=0.5,
                data={"source": "stdlib", "tokenizer": "byte", "val_tokens": 4001},
                eval_every=6, num_threads=1)
    return {**base, **kw}


def assert_same_sharded_trial(sharded: dict, single) -> None:
    assert SHARDED_NOTE in sharded["notes"]
    assert_same_trial(sharded, single)


def sharded_ranks(s: dict, world: int, out: Path, policy: dict | None = None,
                  stop_after: str = "") -> list[int]:
    """Run the trial on `world` sharded gloo ranks; their exit codes."""
    return run_ranks(s, world, out, shard=True, policy=policy, stop_after=stop_after)


# the preempted trial (no micro-batches: every rank's pass is its whole share)
PREEMPTED = spec(micro_batch_size=None, budget={"steps": 20}, eval_every=10)


@pytest.fixture(scope="module")
def on_sharded_ranks(tmp_path_factory) -> dict[str, dict]:
    """Rank 0's results of each arch's trial and of PREEMPTED, never stopped: one group of 2
    sharded gloo ranks trains them one after another (the ranks' start-up costs more than
    these trials do)."""
    names = [*sorted(ARCHS), "preempted"]
    specs = [*(spec(**ARCHS[arch]) for arch in sorted(ARCHS)), PREEMPTED]
    out = tmp_path_factory.mktemp("sharded_ranks") / "rank0.json"
    return dict(zip(names, on_ranks_each(specs, 2, out, shard=True), strict=True))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_sharded_ranks_train_what_one_process_trains(arch, on_sharded_ranks):
    single = run_trial(spec(**ARCHS[arch]))
    sharded = on_sharded_ranks[arch]
    assert sharded["workers"] == 2
    assert_same_sharded_trial(sharded, single)


@pytest.mark.slow  # two runs of 2 ranks (and the module's uninterrupted one)
def test_a_preempted_sharded_trial_resumes_to_the_uninterrupted_numbers(tmp_path,
                                                                       on_sharded_ranks):
    """SIGTERM reaches rank 1 after the first checkpoint: every rank stops at the same step,
    the shards are gathered into one checkpoint (the one-process layout of the model's
    state), every rank exits; the next run scatters it back and ends with the uninterrupted
    sharded run's curve and validation loss, to the bit."""
    s = PREEMPTED
    whole = on_sharded_ranks["preempted"]  # the same trial on 2 sharded ranks, never stopped
    policy = CheckpointPolicy(url=str(tmp_path / "ckpt"), key="sweep/trial", every_steps=5,
                              keep_final=True).to_dict()
    folder = tmp_path / "ckpt" / "sweep" / "trial"
    codes = sharded_ranks(s, 2, tmp_path / "first.json", policy,
                          stop_after=str(folder / "step-000000005.sha256"))
    assert codes == [-15, -15]  # both stopped by the preemption (SIGTERM, re-raised)
    assert not (tmp_path / "first.json").exists()
    assert sharded_ranks(s, 2, tmp_path / "again.json", policy) == [0, 0]
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["status"] == "completed"
    assert again["resumed_from_step"] >= 5
    assert again["final_val_loss"] == whole["final_val_loss"]
    assert again["curve"] == whole["curve"]
    # the kept checkpoint holds the whole model, keyed and shaped as one process's
    from hptransfer.models.build import build_from_config
    from hptransfer.spec.trial import TrialSpec

    trial = TrialSpec.model_validate(s)
    one = build_from_config(trial.model_config_obj(vocab_size=256),
                            trial.parameterization_obj()).model.state_dict()
    found = TrialCheckpoints(CheckpointPolicy(**policy), []).latest()
    assert found is not None
    saved = found[1]["model"]
    assert {k: tuple(v.shape) for k, v in saved.items()} == {
        k: tuple(v.shape) for k, v in one.items()}


# ---- through Ray Train, as the dispatcher runs a trial with resources.shard

@pytest.mark.slow
def test_ray_train_sharded_workers_train_what_one_process_trains(module_ray_cluster,
                                                                tmp_path):
    ray = module_ray_cluster
    s = spec()
    single = run_trial(s, cache_dir=str(tmp_path / "cache"))
    task = ray.remote(polling_quickly()).options(num_cpus=0, max_retries=0)
    two = ray.get(task.remote(s, "trial", None, str(tmp_path / "cache"), None, None,
                              workers=2, cpus=0.5, gpus=0.0, checkpoint=None,
                              storage_path=str(tmp_path / "ray_train"), run_name="t-0",
                              shard=True), timeout=600)
    assert two["workers"] == 2
    assert_same_sharded_trial(two, single)


# ---- the spec's switch, and what admission prices

def test_shard_needs_workers_and_the_error_names_its_field():
    from conftest import TINY_SPEC

    from hptransfer.spec import SpecError, load_spec
    from hptransfer.spec.trial import TrialSpec

    for resources, field in [
            ({"shard": True}, "resources.shard"),
            ({"workers": 1, "shard": True}, "resources.shard"),
            ({"scale_out": [{"min_params": 1, "workers": 1, "shard": True}]},
             "resources.scale_out.0.shard")]:
        with pytest.raises(SpecError) as exc:
            load_spec({**copy.deepcopy(TINY_SPEC), "resources": resources})
        assert [e["field"].replace("[", ".").replace("]", "") for e in exc.value.errors] == [
            field], exc.value.errors
        assert "workers" in exc.value.errors[0]["message"]
    rules = [{"min_params": 90_000, "workers": 8, "gpus": 1, "shard": True}]
    sweep = load_spec({**copy.deepcopy(TINY_SPEC), "resources": {"cpus": 1,
                                                                 "scale_out": rules}})
    def task(width: int, depth: int):
        trial = TrialSpec.model_validate(sweep.trial_spec(sweep.arms[0], width, depth, 2**-8,
                                                          0.02, 0))
        return sweep.task_resources(trial)
    assert (task(32, 1).workers, task(32, 1).shard) == (1, False)  # the default: no FSDP
    assert (task(64, 2).workers, task(64, 2).shard) == (8, True)
    assert load_spec(copy.deepcopy(TINY_SPEC)).resources.base.shard is False


def test_a_sharded_worker_holds_a_wth_of_the_state_plus_its_gathered_units():
    """Per-worker memory of the same trial on 4 DDP workers and on 4 sharded ones, against
    16 bytes a parameter (fp32 weights, gradient, AdamW's two moments) counted from a built
    model: sharded, each holds 16 P / 4 plus 16 bytes for each parameter of the largest
    FSDP unit (a block or the root's vocab tables), and the same activations."""
    from conftest import TINY_SPEC

    from hptransfer.coordinator.admission import stage_costs
    from hptransfer.models.build import build_from_config
    from hptransfer.spec import load_spec
    from hptransfer.spec.trial import TrialSpec

    base = {**copy.deepcopy(TINY_SPEC)}
    base["grid"] = {**base["grid"], "widths": [128], "depths": [4]}
    dense = load_spec({**base, "resources": {"workers": 4}})
    sharded = load_spec({**base, "resources": {"workers": 4, "shard": True}})
    d = next(c for c in stage_costs(dense) if (c.width, c.depth) == (128, 4))
    s = next(c for c in stage_costs(sharded) if (c.width, c.depth) == (128, 4))

    trial = TrialSpec.model_validate(dense.trial_spec(dense.arms[0], 128, 4, 2**-8, 0.02, 0))
    model = build_from_config(trial.model_config_obj(vocab_size=dense.model_vocab_size()),
                              trial.parameterization_obj()).model
    total = sum(p.numel() for p in model.parameters())
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    root = total - sum(blocks)
    unit = max(max(blocks), root)
    activations = d.worker_memory_bytes - 16 * total
    assert activations > 0 and s.worker_activation_bytes == d.worker_activation_bytes
    assert d.worker_memory_bytes == pytest.approx(16 * total + activations, rel=1e-9)
    expected = 16 * total / 4 + 16 * unit + activations
    assert s.worker_memory_bytes == pytest.approx(expected, rel=1e-3)
    assert s.worker_memory_bytes < d.worker_memory_bytes


# ---- a rank's passes, without ranks

def test_every_rank_takes_the_passes_its_largest_share_needs():
    """A pass is collective: every rank runs as many as the rank with the most rows needs,
    none of them over the micro-batch size."""
    from hptransfer.workers.sharding import passes_per_step

    # (batch, micro-batch size, ranks): the largest share's rows -> its passes
    assert passes_per_step(5, 2, 2) == 2  # 3 rows and 2: the 3 take two passes
    assert passes_per_step(9, 2, 2) == 3  # 5 rows and 4
    assert passes_per_step(3, 1, 2) == 2  # 2 rows and 1: the 1 runs an empty pass too
    assert passes_per_step(9, 2, 4) == 2  # 3, 2, 2, 2
    assert passes_per_step(8, 2, 4) == 1  # 2 each
    assert passes_per_step(7, 4, 3) == 1  # 3, 2, 2
