"""Packed dispatch (`resources.pack`, issue 10): trials of one shape run as one Ray task, and
the service cannot tell: the same rows, statuses, losses (fp32 tolerance), fits and MLflow
runs as one task per trial. Real Ray, real SQLite, real MLflow, real training (tiny shapes).
"""

from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace
from typing import Any

import optuna
import psutil
import pytest
import ray
from fastapi.testclient import TestClient
from waiting import run_sweep, wait_for

from hptransfer.api import create_app
from hptransfer.config import get_settings
from hptransfer.coordinator.packing import (
    CPU_ONE_THREAD_PACKS,
    CPU_PACKS,
    CUDA_PACKS,
    auto_pack,
    measured_packs,
    pack_cost,
    pack_key,
    pack_size,
    plan_packs,
)
from hptransfer.coordinator.plan import plan_sweep
from hptransfer.coordinator.service import Coordinator
from hptransfer.spec import SpecError, load_spec

PACKED = "trained packed: "


def packed_spec(spec: dict[str, Any], name: str, pack: Any, steps: int = 10) -> dict[str, Any]:
    spec = dict(spec, name=name, reuse=False, max_concurrent=2)
    spec["grid"] = dict(spec["grid"], lrs=[2**-9, 2**-6, 2**-3, 2**0], seeds=[0, 1])
    spec["budget"] = {"steps": steps, "batch_size": 4}
    spec["resources"] = {"cpus": 1, "pack": pack}
    return spec


# For the tests that catch every member of a pack while it trains: LRs that all train to the
# end. At 2^0 the tiny model diverges by step ~50 and leaves its pack early, so "all members
# training" held only for a tick or two (a loaded host's run missed it, waiting out 120 s).
STEADY_LRS = [2**-9, 2**-6, 2**-4, 2**-3]


# ---- planning (no Ray) -------------------------------------------------------------------

def _trial(i: int, width: int, lr: float) -> SimpleNamespace:
    return SimpleNamespace(id=f"t{i}", width=width, spec={"width": width, "depth": 2, "lr": lr,
                                                          "seed": i % 2, "batch_size": 4,
                                                          "seq_len": 64})


def _shape(width: int, batch: int = 32, seq: int = 512, micro: int | None = None) -> dict:
    return {"width": width, "batch_size": batch, "seq_len": seq, "micro_batch_size": micro}


def test_auto_pack_follows_the_measured_rule():
    # the CPU's measurements, 8 x 64 tokens per pass: on two threads packs paid up to width
    # 128; on one only up to 48 (1.01x at 64, 0.87x at 128)
    cpu = [auto_pack(_shape(w, 8, 64), CPU_PACKS) for w in (16, 32, 64, 128, 256)]
    assert cpu == [8, 8, 8, 8, 1]
    one = [auto_pack(_shape(w, 8, 64), CPU_ONE_THREAD_PACKS) for w in (16, 32, 48, 64, 128)]
    assert one == [8, 8, 8, 1, 1]
    # CUDA (gpu_check.py's scan on an H200, 32 x 512 tokens per pass): K=16 up to 256 wide,
    # 8 up to 512; from 1024 a trial alone already fills the GPU (a pack of 4 gained 1.02x)
    gpu = [auto_pack(_shape(w), CUDA_PACKS) for w in (64, 256, 512, 1024, 4096)]
    assert gpu == [16, 16, 8, 1, 1]


def test_auto_pack_weighs_the_tokens_of_a_pass_against_the_width():
    # 4x the tokens per pass weigh as twice the width: 256 wide on 128 x 512 tokens is
    # packed as 512 wide on the measured 32 x 512
    assert auto_pack(_shape(256, batch=128), CUDA_PACKS) == 8
    assert auto_pack(_shape(256, batch=32, seq=2048), CUDA_PACKS) == 8
    assert auto_pack(_shape(512, batch=128), CUDA_PACKS) == 1
    # a micro-batch bounds a pass: a batch of 128 in passes of 32 is the measured shape
    assert auto_pack(_shape(256, batch=128, micro=32), CUDA_PACKS) == 16
    assert auto_pack(_shape(128, 8, 256), CPU_PACKS) == 1  # 4x the CPU's measured tokens
    assert auto_pack(_shape(64, 8, 256), CPU_PACKS) == 8
    assert auto_pack(_shape(64, 16, 256), CPU_PACKS) == 1


def test_pack_cost_is_n_over_the_measured_gain_of_the_shape():
    assert pack_cost(1, _shape(256), CUDA_PACKS) == 1.0
    assert pack_cost(8, _shape(256), CUDA_PACKS) == pytest.approx(8 / 3.5)
    assert pack_cost(2, _shape(256), CUDA_PACKS) == 1.0  # a pack of 2 gains at most 2x
    assert pack_cost(8, _shape(512), CUDA_PACKS) == pytest.approx(8 / 1.5)
    assert pack_cost(4, _shape(1024), CUDA_PACKS) == 4.0  # no gain known: one by one
    assert pack_cost(8, _shape(64, 8, 64), CPU_PACKS) == pytest.approx(8 / 1.3)
    assert pack_cost(8, _shape(256, 8, 64), CPU_PACKS) == 8.0
    assert pack_cost(8, _shape(32, 8, 64), CPU_ONE_THREAD_PACKS) == pytest.approx(8 / 1.4)
    assert pack_cost(8, _shape(48, 8, 64), CPU_ONE_THREAD_PACKS) == pytest.approx(8 / 1.05)


@pytest.mark.parametrize(("cpus", "gpus", "device", "threads", "packs"), [
    (1, 0, "cpu", 1, CPU_ONE_THREAD_PACKS), (0.5, 0, "cpu", 1, CPU_ONE_THREAD_PACKS),
    (1.9, 0, "cpu", 1, CPU_ONE_THREAD_PACKS), (2, 0, "cpu", 2, CPU_PACKS),
    (6, 0, "cpu", 6, CPU_PACKS), (1, 1, "auto", 1, CUDA_PACKS),
    (1, 1, "cpu", 1, CPU_ONE_THREAD_PACKS),
])
def test_a_sweep_packs_by_what_was_measured_on_its_device_and_threads(
        tiny_spec, cpus, gpus, device, threads, packs):
    spec = load_spec(dict(tiny_spec, resources={"cpus": cpus, "gpus": gpus},
                          fixed=dict(tiny_spec["fixed"], device=device)))
    # the threads a task's torch gets: the whole CPUs Ray gives it (never more), at least one
    assert spec.resources.threads == threads
    assert {p.trial.num_threads for p in plan_sweep(spec)} == {threads}
    assert measured_packs(spec) == packs
    # width 64 on 8 x 64 tokens: packed on two threads, one by one on one
    shape = _shape(64, 8, 64)
    assert pack_size(spec, shape) == auto_pack(shape, packs)
    fixed = load_spec(dict(tiny_spec, resources={"cpus": cpus, "gpus": gpus, "pack": 3}))
    assert pack_size(fixed, shape) == 3


def test_gpu_plan_packs_small_shapes_and_keeps_both_slots_busy():
    small = [_trial(i, 256, 2.0**-i) for i in range(8)]
    large = [_trial(8 + i, 1024, 2.0**-i) for i in range(4)]
    packs = plan_packs(small + large, 2, lambda t: auto_pack(_shape(t.width), CUDA_PACKS),
                       lambda t, n: pack_cost(n, _shape(t.width), CUDA_PACKS))
    # one pack of 8 (8/3.5 = 2.3 trial-times) would leave a slot to the four 1024-wide
    # trials alone (makespan 3.3); two packs of 4 (1.14 each) balance at 3.14
    assert sorted(len(p) for p in packs) == [1, 1, 1, 1, 4, 4]
    assert all(len(p) == 1 for p in packs if p[0].width == 1024)


def test_packs_hold_one_shape_and_are_sized_to_keep_every_slot_busy():
    trials = [_trial(i, w, 2.0**-i) for w in (64, 128) for i in range(6)]
    assert pack_key(trials[0].spec) == pack_key(trials[5].spec)  # lr, seed may differ
    assert pack_key(trials[0].spec) != pack_key(trials[6].spec)  # width may not
    cpu = lambda t, n: 1.0 if n == 1 else n / 1.15  # noqa: E731  (packing gains 15 %)
    packs = plan_packs(trials, slots=2, size_of=lambda t: 8, cost=cpu)
    # two packs of 6 on 2 slots: 6/1.15 = 5.2 trial-times, against 6 one by one
    assert [[t.id for t in p] for p in packs] == [[f"t{i}" for i in range(6)]] * 2
    assert [p[0].width for p in packs] == [64, 128]
    # three shapes on two slots: three packs of 6 would take 10.4; packs of 3 take 7.8
    three = trials + [_trial(i, 96, 2.0**-i) for i in range(6)]
    assert sorted(len(p) for p in plan_packs(three, 2, lambda t: 8, cpu)) == [3] * 6
    # pack 1 (or a shape that may not pack) runs every trial alone, in plan order
    alone = plan_packs(trials, 2, lambda t: 1, cpu)
    assert [p for p in alone] == [[t] for t in trials]


# ---- the spec field ----------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, 65, -1, 2.0, "4", "Auto", True, None, [2]])
def test_bad_pack_is_a_spec_error_naming_the_field(tiny_spec, bad):
    with pytest.raises(SpecError) as err:
        load_spec(dict(tiny_spec, resources={"cpus": 1, "pack": bad}))
    assert [e["field"] for e in err.value.errors] == ["resources.pack"]
    assert "'auto'" in err.value.errors[0]["message"]


def test_pack_values_and_default(tiny_spec):
    assert load_spec(tiny_spec).resources.pack == "auto"
    for good in ("auto", 1, 8, 64):
        assert load_spec(dict(tiny_spec, resources={"pack": good})).resources.pack == good


def test_bad_pack_is_422_naming_the_field_and_nothing_is_stored(hpt_home, tiny_spec):
    with TestClient(create_app(get_settings(), dispatch=False),
                    raise_server_exceptions=False) as client:
        for bad in (0, 1000, "many"):
            r = client.post("/sweeps", json=dict(tiny_spec, resources={"pack": bad}))
            assert r.status_code == 422, r.text
            assert [e["field"] for e in r.json()["errors"]] == ["resources.pack"]
        assert client.get("/sweeps").json() == []


# ---- sweeps ------------------------------------------------------------------------------

def _rows(coordinator: Coordinator, sweep_id: str) -> dict[tuple, dict[str, Any]]:
    return {(r.lr, r.seed): r for r in coordinator.store.trials(sweep_id, limit=None)}


def _close(a: Any, b: Any, rel: float, path: str = "") -> None:
    """Nested JSON equal up to `rel` relative (abs 1e-6) in every float."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _close(a[k], b[k], rel, f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, rel, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=rel, abs_tol=1e-6), (path, a, b)
    else:
        assert a == b, (path, a, b)


def test_packed_sweep_gives_the_rows_results_fits_and_runs_of_an_unpacked_one(
        hpt_home, ray_cluster, tiny_spec):
    coordinator = Coordinator(get_settings())
    coordinator.start()
    try:
        ids = {}
        for pack in (1, 4):  # one after the other: the packed sweep has both slots
            ids[pack] = sweep_id = coordinator.submit(
                packed_spec(tiny_spec, f"pack-{pack}", pack))["id"]
            wait_for(lambda s=sweep_id: coordinator.store.get_sweep(s).status == "completed",
                     180, f"the pack: {pack} sweep to complete")
        fits = {p: coordinator.fits(s, bootstrap=20) for p, s in ids.items()}
        store = coordinator.store
        wait_for(lambda: all(store.mirror_backlog(s) <= 1 for s in ids.values()), 60,
                 "the MLflow mirror")
    finally:
        coordinator.stop()
    alone, packed = (_rows(coordinator, ids[p]) for p in (1, 4))
    assert alone.keys() == packed.keys() and len(packed) == 8
    # LR 1 diverges: that member stops, its pack's others train on
    statuses = sorted(r.status for r in packed.values())
    assert statuses == ["completed"] * 6 + ["diverged"] * 2, statuses
    sizes = []
    for key, a in alone.items():
        p = packed[key]
        assert (p.status, p.attempts, p.arm, p.width) == \
            (a.status, a.attempts, a.arm, a.width), key
        assert p.content_hash == a.content_hash
        if a.final_val_loss is not None:
            assert math.isclose(p.final_val_loss, a.final_val_loss, rel_tol=1e-3), key
        assert not any(n.startswith(PACKED) for n in a.result["notes"])
        sizes += [int(n.removeprefix(PACKED).split()[0]) for n in p.result["notes"]
                  if n.startswith(PACKED)]
        # its own attempt and MLflow run, as an unpacked trial has
        attempts = store.attempts(p.id)
        assert [x.status for x in attempts] == [p.status] and attempts[0].mlflow_run_id
    # 8 trials of one shape on 2 slots: 2 tasks of 4
    assert sizes == [4] * 8
    runs = {store.attempts(r.id)[0].mlflow_run_id for r in packed.values()}
    assert len(runs) == 8
    assert fits[1]["analyses"]["optimal_lr"]["shapes"], fits[1]["analyses"]
    # the fits name trials by id: name the packed sweep's by the unpacked twin's ids
    text = json.dumps(fits[4]["analyses"])
    for key, p in packed.items():
        text = text.replace(p.id, alone[key].id)
    _close(fits[1]["analyses"], json.loads(text), rel=1e-2)


def test_cancelling_a_packed_sweep_cancels_every_member(hpt_home, ray_cluster, tiny_spec):
    coordinator = Coordinator(get_settings())
    dispatcher = coordinator.dispatcher
    coordinator.start()
    try:
        spec = packed_spec(tiny_spec, "pack-cancel", 4, steps=5000)
        spec["grid"]["lrs"] = STEADY_LRS
        sweep_id = coordinator.submit(spec)["id"]
        wait_for(lambda: len(dispatcher.in_flight) == 8 and all(
            f.last_step > 0 for f in dispatcher.in_flight.values()), 120,
            "both packs to be training")
        assert len({f.ref for f in dispatcher.in_flight.values()}) == 2
        coordinator.cancel(sweep_id)
        wait_for(lambda: not dispatcher.in_flight, 60, "the packs to be cancelled")
    finally:
        coordinator.stop()
    rows = coordinator.store.trials(sweep_id, limit=None)
    assert coordinator.store.get_sweep(sweep_id).status == "cancelled"
    assert [r.status for r in rows] == ["cancelled"] * 8
    for r in rows:
        assert [a.status for a in coordinator.store.attempts(r.id)] == ["cancelled"]


def _ray_workers(title: str) -> list[psutil.Process]:
    """Ray workers below this process whose title says they run `title` now."""
    found = []
    for proc in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if " ".join(proc.cmdline()).startswith(title):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


@pytest.mark.slow
def test_a_killed_pack_retries_every_member_as_its_own_attempt(hpt_home, ray_cluster,
                                                                 tiny_spec):
    # 400 steps: the pack is killed once its task executes and a member has trained (waiting
    # for all four members' points, which reach the dispatcher a tick or more after the
    # fact, missed the pack's end on a loaded host at 80 and 200 steps)
    spec = packed_spec(tiny_spec, "pack-killed", 4, steps=400)
    spec.update(max_concurrent=1, retries=1)
    spec["grid"].update(seeds=[0], lrs=STEADY_LRS)
    coordinator = Coordinator(get_settings())
    dispatcher = coordinator.dispatcher
    busy = {p.pid for p in _ray_workers("ray::execute_trials")}
    coordinator.start()
    try:
        sweep_id = coordinator.submit(spec)["id"]

        def training() -> list[psutil.Process]:
            workers = [p for p in _ray_workers("ray::execute_trials") if p.pid not in busy]
            return workers if len(dispatcher.in_flight) == 4 and any(
                f.last_step > 0 for f in dispatcher.in_flight.values()) else []

        workers = wait_for(training, 120, "the pack to train")
        assert len(workers) == 1
        workers[0].kill()
        wait_for(lambda: coordinator.store.get_sweep(sweep_id).status == "completed", 180,
                 "the sweep to complete after the retry")
    finally:
        coordinator.stop()
    rows = coordinator.store.trials(sweep_id, limit=None)
    assert len(rows) == 4
    for r in rows:
        assert r.attempts == 2 and r.status == "completed", r.status
        attempts = coordinator.store.attempts(r.id)
        assert [a.status for a in attempts] == ["failed", r.status]
        assert attempts[0].error.startswith("WorkerCrashedError"), attempts[0].error
        assert any(n.startswith(PACKED + "4 ") for n in r.result["notes"])


@pytest.mark.parametrize("drain_s", [0.0, 3.0])
def test_a_split_pack_keeps_the_results_of_a_group_trained_before_its_worker_died(
        hpt_home, ray_cluster, tiny_spec, tmp_path, drain_s):
    """A pack that does not fit in memory trains in groups, one after another, in one task.
    Its worker dying in the second group used to take the first group's results with it:
    every member was charged an attempt and trained again. The first group's results now
    reach the coordinator as that group finishes and are stored; only the second group's
    members are retried. Also when the progress board answers slower than a tick (drain_s):
    the dead task's members were recorded lost before the delivered results were read."""
    from hptransfer.coordinator.progress import ProgressBoard
    from hptransfer.workers.remote import execute_trials

    class SlowBoard(ProgressBoard):
        def drain(self):  # a busy board
            import time

            time.sleep(drain_s)
            return super().drain()

    # 10 steps: a point is reported each step, and with drain_s each report waits behind a
    # slow drain; at step 1 the second group's first member reports (and dies) before the
    # last, which diverges there, could hand its result over
    spec = packed_spec(tiny_spec, "split-then-lost", 4, steps=10)
    spec.update(max_concurrent=1, retries=1)
    spec["grid"]["seeds"] = [0]
    first_try = tmp_path / "first-try"

    def split_then_die(specs, trial_ids, progress, cache_dir, *guard, max_hours=None):
        """The real worker function on its first call, with the pack's memory estimate made
        to fit two members of four, and the worker process dying at the second group's first
        step; on later calls the real worker function as it is."""
        import os
        from types import SimpleNamespace

        from hptransfer.workers import packed, remote

        if first_try.exists():
            return execute_trials(specs, trial_ids, progress, cache_dir, *guard,
                                  max_hours=max_hours)
        first_try.touch()
        packed.free_memory = lambda *args: 1.0  # 0.8 to use at 0.3 a member: groups of 2
        packed.trial_memory = lambda *a, **kw: SimpleNamespace(pack_peak=lambda k: 0.3 * k)
        channel = remote.progress_channel

        def dying_channel(board):
            report = channel(board)

            def report_or_die(trial_id, metrics):
                if trial_id in trial_ids[2:]:
                    os._exit(1)  # the node's worker dies (OOM killer, node lost, ...)
                return report(trial_id, metrics)
            return report_or_die

        remote.progress_channel = dying_channel
        return execute_trials(specs, trial_ids, progress, cache_dir, *guard,
                              max_hours=max_hours)

    coordinator = Coordinator(get_settings())
    coordinator.start()
    try:
        coordinator.dispatcher.ray_runner.run_pack = ray.remote(split_then_die)
        if drain_s:
            coordinator.dispatcher.ray_runner.progress_board = ray.remote(num_cpus=0)(
                SlowBoard).remote()
        sweep_id = coordinator.submit(spec)["id"]
        wait_for(lambda: coordinator.store.get_sweep(sweep_id).status == "completed", 240,
                 "the sweep to complete after the retry")
    finally:
        coordinator.stop()
    rows = coordinator.store.trials(sweep_id, limit=None)
    assert len(rows) == 4 and first_try.exists()
    for r in rows[:2]:  # the first group: stored from the delivery, never trained again
        assert r.attempts == 1 and r.status in ("completed", "diverged"), (r.status, r.error)
        assert [a.status for a in coordinator.store.attempts(r.id)] == [r.status]
        assert any("this member trained in a pack of 2" in n for n in r.result["notes"])
    for r in rows[2:]:  # the second group: lost with the worker, retried as a pack of 2
        attempts = coordinator.store.attempts(r.id)
        assert r.attempts == 2 and [a.status for a in attempts] == ["failed", r.status]
        assert attempts[0].error.startswith("WorkerCrashedError"), attempts[0].error
        assert any(n.startswith(PACKED + "2 ") for n in r.result["notes"])


def test_optuna_packs_its_first_batch_and_asks_the_rest_one_by_one(hpt_home, ray_cluster,
                                                                     tiny_spec):
    spec = packed_spec(tiny_spec, "pack-optuna", 4)
    spec["grid"]["seeds"] = [0]
    spec.update(max_concurrent=1, search={"method": "optuna", "n_trials": 5, "n_startup": 3,
                                          "pruner": "none"})
    settings = get_settings()
    coordinator = Coordinator(settings)
    sweep_id = run_sweep(coordinator, spec, 120)
    rows = coordinator.store.trials(sweep_id, limit=None)
    assert sorted(r.optuna_trial_number for r in rows) == [0, 1, 2, 3, 4]
    packs = {r.optuna_trial_number: [n for n in r.result["notes"] if n.startswith(PACKED)]
             for r in rows}
    assert all(packs[i] == [PACKED + "3 trials in one batched model"] for i in (0, 1, 2))
    assert packs[3] == packs[4] == []
    # every member was told to its study, with its own loss
    (name,) = [n for n in optuna.get_all_study_names(settings.optuna_url) if sweep_id in n]
    study = optuna.load_study(study_name=name, storage=settings.optuna_url)
    told = {t.number: t.value for t in study.get_trials(deepcopy=False)}
    for r in rows:
        if r.status == "completed":
            assert told[r.optuna_trial_number] == pytest.approx(r.final_val_loss, rel=1e-9)


def test_a_restarted_coordinator_requeues_every_member_of_a_running_pack(
        hpt_home, ray_cluster, tiny_spec):
    # 400 steps, as the killed pack above (seen training before it ends)
    spec = packed_spec(tiny_spec, "pack-restart", 4, steps=400)
    spec.update(max_concurrent=1)
    spec["grid"].update(seeds=[0], lrs=STEADY_LRS)
    first = Coordinator(get_settings())
    first.start()
    sweep_id = first.submit(spec)["id"]
    wait_for(lambda: len(first.dispatcher.in_flight) == 4 and any(
        f.last_step > 0 for f in first.dispatcher.in_flight.values()), 120, "the pack to train")
    first.stop()
    for ref in {f.ref for f in first.dispatcher.in_flight.values()}:
        ray.cancel(ref, force=True)  # its task dies with it (as an in-process cluster would)
    second = Coordinator(get_settings())  # a new owner: the pack's leases are orphans
    second.start()
    try:
        wait_for(lambda: second.store.get_sweep(sweep_id).status == "completed", 180,
                 "the sweep to complete under the new coordinator")
    finally:
        second.stop()
    for r in second.store.trials(sweep_id, limit=None):
        # the interrupted attempt counts as one (its MLflow run), not against the retries
        assert r.attempts == 2 and r.status == "completed", r
        assert [a.status for a in second.store.attempts(r.id)] == ["cancelled", r.status]
        assert any(n.startswith(PACKED + "4 ") for n in r.result["notes"])
