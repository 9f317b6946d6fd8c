"""Data-parallel trials: W ranks (gloo, one CPU each) train the numbers one process trains
(up to the order of the sums), for GPT, nGPT and x0 mixing, with micro-batches; through Ray
Train (TorchTrainer, workers/ray_train.py) as the dispatcher runs them; a Train worker killed
with SIGKILL loses the attempt, and the next attempt resumes from the trial's checkpoint."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from ranks import assert_same_trial, on_ranks, on_ranks_each, polling_quickly

from hptransfer.workers.checkpoints import CheckpointPolicy
from hptransfer.workers.data_parallel import DataParallel
from hptransfer.workers.trainer import run_trial

ARCHS = {
    "gpt": {"arch": "gpt"},
    "ngpt": {"arch": "ngpt", "parameterization": "ngpt"},
    "x0_mixing": {"arch": "gpt", "arch_options": {"x0_mixing": True, "extra_embeddings": 2}},
}
def spec(**kw) -> dict:
    base = dict(width=32, depth=2, head_dim=16, lr=2**-9, seq_len=32, batch_size=10,
                micro_batch_size=2, budget={"steps": 30}, data={"source": "stdlib",
                                                               "tokenizer": "byte"},
                eval_every=10, num_threads=1)
    return {**base, **kw}


# the killed Train worker's trial: long enough that the kill (once `reached`, rewritten at
# most once a second, is past step 50) lands well before its last step
RESUMED = spec(budget={"steps": 240}, eval_every=60)


@pytest.fixture(scope="module")
def on_two_ranks(tmp_path_factory) -> dict[str, dict]:
    """Rank 0's results of each arch's trial and of RESUMED, never stopped: one group of 2
    gloo ranks trains them one after another (the ranks' start-up costs more than these
    trials do)."""
    names = [*sorted(ARCHS), "resumed"]
    specs = [*(spec(**ARCHS[arch]) for arch in sorted(ARCHS)), RESUMED]
    out = tmp_path_factory.mktemp("two_ranks") / "rank0.json"
    return dict(zip(names, on_ranks_each(specs, 2, out), strict=True))


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_two_ranks_train_what_one_process_trains(arch, on_two_ranks):
    """An odd split too: 10 sequences over 2 ranks in micro-batches of 2 (5 = 2 + 2 + 1)."""
    single = run_trial(spec(**ARCHS[arch]))
    parallel = on_two_ranks[arch]
    assert parallel["workers"] == 2
    assert_same_trial(parallel, single)


def test_uneven_ranks_weight_their_rows(tmp_path):
    """3 ranks over a batch of 10 (3, 3, 4 rows): each rank's loss weighted by its rows."""
    s = spec(micro_batch_size=None)
    assert_same_trial(on_ranks(s, 3, tmp_path / "rank0.json"), run_trial(s))


# rows per rank and their loss weights, worked out by hand: rank r takes rows
# [B*r//W, B*(r+1)//W) and weights its mean loss by W * rows_r / B
SPLITS = {(4, 4): ([1, 1, 1, 1], [1.0, 1.0, 1.0, 1.0]), (10, 3): ([3, 3, 4], [0.9, 0.9, 1.2]),
          (10, 4): ([2, 3, 2, 3], [0.8, 1.2, 0.8, 1.2]), (7, 2): ([3, 4], [6 / 7, 8 / 7])}


@pytest.mark.parametrize("batch, world", sorted(SPLITS))
def test_ranks_split_a_batch_into_contiguous_rows_and_weigh_them(batch: int, world: int):
    """The ranks' rows tile the batch in order, as evenly as whole rows allow (a batch of W
    sequences over W ranks: one each); DDP's average of the weighted rank losses is then the
    batch's mean loss (the weights average to 1, each proportional to its rows)."""
    sizes, shares = SPLITS[batch, world]
    ranks = [DataParallel(r, world) for r in range(world)]
    rows = [dp.rows(batch) for dp in ranks]
    assert [i for s in rows for i in range(batch)[s]] == list(range(batch))
    assert [s.stop - s.start for s in rows] == sizes
    assert [dp.share(batch) for dp in ranks] == pytest.approx(shares)
    with pytest.raises(ValueError, match=f"batch of {world - 1} sequences cannot be split"):
        ranks[0].rows(world - 1)


# ---- through Ray Train, as the dispatcher runs a trial with workers > 1

@pytest.fixture
def ray_cluster(module_ray_cluster):
    return module_ray_cluster  # conftest's local cluster (2 CPUs), shared by the run


def on_train_workers(ray, s: dict, workers: int, tmp_path: Path, *, checkpoint=None,
                     run_name: str = "trial-0"):
    task = ray.remote(polling_quickly()).options(num_cpus=0, max_retries=0)
    return task.remote(s, "trial", None, str(tmp_path / "cache"), None, None,
                       # half a CPU each: a task an earlier test left on this process's
                       # 2-CPU cluster must not keep the group from starting
                       workers=workers, cpus=0.5, gpus=0.0, checkpoint=checkpoint,
                       storage_path=str(tmp_path / "ray_train"), run_name=run_name)


def test_ray_train_workers_train_what_one_process_trains(ray_cluster, tmp_path):
    s = spec()
    single = run_trial(s, cache_dir=str(tmp_path / "cache"))
    two = ray_cluster.get(on_train_workers(ray_cluster, s, 2, tmp_path), timeout=600)
    assert two["workers"] == 2
    assert_same_trial(two, single)
    assert not (tmp_path / "ray_train" / "trial-0").exists()  # its run folder is gone


def train_worker_pids() -> list[int]:
    """This process's Ray cluster's Train workers (children of its raylet titled
    ray::RayTrainWorker...; another pytest-xdist worker's cluster runs Train workers of its
    own), read from /proc: `ps` costs ~10 ms of CPU a call, and the cancel test polls this."""
    import ray
    from ray._private import ray_constants

    raylet = ray._private.worker._global_node.all_processes[  # the cluster ray.init started
        ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            parent = int((proc / "stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
        if parent == raylet and "RayTrainWorker" in args and "ray::" in args:
            pids.append(int(proc.name))
    return sorted(pids)


@pytest.mark.slow
def test_a_killed_train_worker_loses_the_attempt_and_the_next_resumes(ray_cluster, tmp_path,
                                                                     on_two_ranks):
    """SIGKILL of one Train worker after the first checkpoint: the attempt comes back lost;
    the retry resumes from the latest checkpoint, trains fewer than checkpoint_every steps
    again, and ends with the uninterrupted 2-worker run's numbers, to the bit."""
    from hptransfer.contracts.status import LOST

    s = RESUMED
    policy = CheckpointPolicy(url=str(tmp_path / "ckpt"), key="sweep/trial",
                              every_steps=40, every_minutes=None).to_dict()
    whole = on_two_ranks["resumed"]  # the same trial on 2 gloo ranks, never stopped
    reached = tmp_path / "ckpt" / "sweep" / "trial" / "reached"
    first = on_train_workers(ray_cluster, s, 2, tmp_path, checkpoint=policy, run_name="a0")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # past the first checkpoint (step 40)
        if reached.exists() and int(reached.read_text() or 0) > 50:
            break
        time.sleep(0.05)
    pids = train_worker_pids()
    assert pids
    os.kill(pids[-1], signal.SIGKILL)
    lost = ray_cluster.get(first, timeout=600)
    assert lost["status"] == LOST
    killed_at = int(reached.read_text())
    again = ray_cluster.get(on_train_workers(ray_cluster, s, 2, tmp_path, checkpoint=policy,
                                             run_name="a1"), timeout=600)
    assert again["status"] == "completed"
    assert again["resumed_from_step"] % 40 == 0 and again["resumed_from_step"] >= 40
    # at most one interval: a kill while the checkpoint at 80 is written (its `reached` mark
    # comes first) resumes from 40
    assert again["retrained_tokens"] <= 40 * 10 * 32
    assert killed_at - again["resumed_from_step"] < 40 + 5  # `reached` lags at most ~1 s
    assert again["final_val_loss"] == whole["final_val_loss"]
    assert again["curve"] == whole["curve"]


# ---- resources per shape: the spec's rules and why a trial waits

def test_scale_out_rules_pick_a_trials_workers_and_are_checked_with_their_field():
    import copy

    from conftest import TINY_SPEC

    from hptransfer.spec import SpecError, load_spec
    from hptransfer.spec.trial import TrialSpec

    rules = [{"min_params": 90_000, "workers": 4, "cpus": 2},
             {"stages": ["check"], "workers": 2}]
    spec = load_spec({**copy.deepcopy(TINY_SPEC), "resources": {"cpus": 1,
                                                                "scale_out": rules}})
    def task(width: int, depth: int, stage: str | None = None):
        trial = TrialSpec.model_validate(spec.trial_spec(spec.arms[0], width, depth, 2**-8,
                                                         0.02, 0))
        return spec.task_resources(trial, stage)
    assert (task(32, 1).workers, task(32, 1).cpus) == (1, 1.0)
    assert (task(64, 2).workers, task(64, 2).cpus) == (4, 2.0)  # 98,304 params
    assert task(32, 1, "check").workers == 2  # the first matching rule wins
    assert task(64, 2, "check").workers == 4
    for bad, field in [({"workers": 2}, "resources.scale_out.0"),
                       ({"min_params": 1, "workers": 0}, "resources.scale_out.0.workers"),
                       ({"min_params": 1, "workers": 2, "gpus": 1e-6},
                        "resources.scale_out.0.gpus")]:
        with pytest.raises(SpecError) as exc:
            load_spec({**copy.deepcopy(TINY_SPEC), "resources": {"scale_out": [bad]}})
        assert any(e["field"].replace("[", ".").replace("]", "") == field
                   for e in exc.value.errors), exc.value.errors


def test_a_trial_whose_workers_no_cluster_holds_says_what_it_needs():
    from hptransfer.coordinator.ray_runner import ClusterCapacity, never_fits
    from hptransfer.spec.sections import TaskResources

    four = TaskResources(workers=4, cpus=1.0, gpus=0.0)
    two_nodes = ClusterCapacity({"CPU": 4.0}, lambda: [
        {"Alive": True, "Resources": {"CPU": 2.0}}, {"Alive": True, "Resources": {"CPU": 2.0}}])
    assert never_fits(four, two_nodes) is None  # 4 workers over two 2-CPU nodes
    assert four.count_in(4.0, 0.0) == 1 and four.count_in(3.0, 0.0) == 0
    why = never_fits(TaskResources(workers=8, cpus=1.0, gpus=0.0), two_nodes)
    assert "8 workers x 1 CPUs" in why and "4 CPUs" in why
    why = never_fits(TaskResources(workers=2, cpus=3.0, gpus=0.0), two_nodes)
    assert "largest Ray node has 2" in why
    why = never_fits(TaskResources(workers=2, cpus=1.0, gpus=1.0), two_nodes)
    assert "GPU" in why and "none" in why


def test_cancelling_a_sweep_stops_its_train_workers(hpt_home, ray_cluster):
    """Cancel reaches a trial on several workers as it does a one-process trial: its Ray
    Train workers end (they are owned by the cancelled task), the trial is cancelled, and
    the run's placement group goes with them: its dead controller's group used to keep the
    cluster's CPUs (no state API for Ray Train's cleaner without a dashboard), and every
    later trial in this Ray session waited for them."""
    import copy

    from conftest import TINY_SPEC
    from mlflow.tracking import MlflowClient
    from waiting import wait_for

    from hptransfer.api.server import serve_in_thread
    from hptransfer.client import Client
    from hptransfer.config import get_settings

    spec = copy.deepcopy(TINY_SPEC)
    spec.update(name="cancel-workers", max_concurrent=1)
    spec["grid"]["lrs"] = [2**-8]
    spec["budget"] = {"steps": 100_000, "batch_size": 4}
    spec["resources"] = {"cpus": 1, "workers": 2}
    before = set(train_worker_pids())
    with serve_in_thread(get_settings()) as url, Client(url) as c:
        sweep = c.submit(spec)
        wait_for(lambda: set(train_worker_pids()) - before, 180, "the trial's Train workers",
                 poll=0.25)
        # cancelled while it trains (its live metrics mirrored), not while its group forms:
        # the run's placement group was left behind only then
        mlflow = MlflowClient(get_settings().mlflow_uri)
        wait_for(lambda: any(r.data.metrics for r in mlflow.search_runs(
                     [e.experiment_id for e in mlflow.search_experiments()])),
                 120, "the trial's live metrics in MLflow", poll=0.5)
        c.cancel(sweep["id"])
        wait_for(lambda: (c.trials(sweep["id"])["status"] == "cancelled").all(), 60,
                 "the trial cancelled")
        wait_for(lambda: not set(train_worker_pids()) - before, 60,
                 "its Train workers gone", poll=0.25)
        import ray

        wait_for(lambda: ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"],
                 30, lambda: f"the cluster's CPUs back: {ray.available_resources()}", poll=0.25)
