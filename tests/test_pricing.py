"""Priced before queued: `hpt plan`, POST /sweeps?dry_run=true and Client.plan price a sweep
per stage without storing anything, and a sweep priced above HPT_MAX_SWEEP_DEVICE_HOURS is
queued only with confirm_cost."""

from __future__ import annotations

import copy
import math
import shutil
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

from hptransfer.api.app import create_app
from hptransfer.config import get_settings
from hptransfer.coordinator.admission import stage_costs
from hptransfer.coordinator.calibration import DDP_EFFICIENCY, MICRO_STEPS
from hptransfer.coordinator.packing import measured_packs, pack_gain
from hptransfer.coordinator.plan import ShapeKey, plan_sweep, trial_at
from hptransfer.coordinator.pricing import TASK_GAP_S, cost_message, may_exceed
from hptransfer.models.flops import flops_per_token, param_counts
from hptransfer.spec import load_spec

EXAMPLES = Path(__file__).parent.parent / "examples"


def example(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / name).read_text())


@pytest.fixture(scope="module")
def bpe_cache(tmp_path_factory) -> Path:
    """The stdlib corpus's BPE tokenizer and tokens, made once: a plan checks its data as a
    submit does (~3 s to train the tokenizer in a new home)."""
    from hptransfer.data import load_dataset
    from hptransfer.spec.data import DataSpec

    cache = tmp_path_factory.mktemp("bpe-cache")
    load_dataset(DataSpec(source="stdlib", tokenizer="bpe"), cache_dir=cache)
    return cache


@pytest.fixture
def client(hpt_home, bpe_cache):
    shutil.copytree(bpe_cache, hpt_home / "cache", dirs_exist_ok=True)
    with TestClient(create_app(get_settings(), dispatch=False),
                    raise_server_exceptions=False) as c:
        yield c


def analytic_flops(trial) -> float:
    """One trial's training FLOPs from models.flops: its steps x tokens per step x FLOPs
    per token (the budget's steps for its non-embedding parameters)."""
    cfg = trial.model_config_obj(vocab_size=4096)  # the GPU study's BPE vocabulary
    per_step = trial.batch_size * trial.seq_len
    steps = trial.budget.steps_for(per_step, param_counts(cfg).non_embedding)
    return float(steps) * per_step * flops_per_token(cfg, trial.seq_len).training


def expected_stage_flops(spec) -> dict[str, list[float]]:
    """Every trial the GPU study can train, by hand: the tune grid expanded by plan.py, two
    tune extension rounds of 2 LRs per arm and seed, the ladder once per arm and seed, the
    check bracket at 1024x16 without its 0 (the ladder's own trial) plus one extension LR,
    and the six aspect-ratio shapes."""
    out: dict[str, list[float]] = {"tune": [], "transfer": [], "check": [], "aspect_ratio": []}
    grid = plan_sweep(spec)
    out["tune"] = [analytic_flops(p.trial) for p in grid]
    lr, sigma = 2.0**-8, spec.grid.sigma_bases[0]
    for arm in spec.arms:
        for seed in spec.grid.seeds:
            def trial(w, d, stage, lr=lr, arm=arm, seed=seed):
                return trial_at(spec, ShapeKey(arm.name, w, d, sigma, seed), lr, stage).trial
            out["tune"] += [analytic_flops(trial(256, 2, "tune"))] * (2 * 2)
            ladder = [(s.width, s.depth) for s in spec.stages.transfer.shapes]
            out["transfer"] += [analytic_flops(trial(w, d, "transfer")) for w, d in ladder]
            out["check"] += [analytic_flops(trial(1024, 16, "check", lr * 2.0**o))
                             for o in (-2, -1, 1, 2, 3)]  # 3: the extension round's LR
            out["aspect_ratio"] += [analytic_flops(trial(s.width, s.depth, "aspect_ratio"))
                                    for s in spec.stages.aspect_ratio.shapes]
    return out


def test_gpu_study_plan_prices_every_trial_it_can_train(client):
    # every trial on half a GPU (the example's scale_out rule aside: the arithmetic below)
    half_gpu = {**example("gpu_study.yaml"), "resources": {"cpus": 4, "gpus": 0.5}}
    r = client.post("/sweeps", params={"dry_run": "true"}, json=half_gpu)
    assert r.status_code == 200, r.text
    plan = r.json()
    spec = load_spec(example("gpu_study.yaml"))
    expected = expected_stage_flops(spec)
    rows = {row["stage"]: row for row in plan["stages"]}
    assert list(rows) == ["tune", "transfer", "check", "aspect_ratio"]
    for stage, flops in expected.items():
        assert rows[stage]["trials"] == len(flops), stage
        assert rows[stage]["flops"] == math.fsum(flops), stage  # exactly
    assert (rows["tune"]["planned"], rows["check"]["planned"]) == (54, 24)
    assert plan["total"]["flops"] == math.fsum(f for v in expected.values() for f in v)
    assert plan["total"]["trials"] == sum(len(v) for v in expected.values()) == 186
    # nothing measured on a fresh server: a GPU's peak x a stated MFU, said so
    assert plan["throughput"]["source"] == "peak x MFU"
    assert "MFU 0.35" in plan["text"] and "GPU-hours" in plan["text"]
    # device-hours: each trial's FLOPs at half that rate (it shares its GPU) x the half GPU
    # it holds (no per-trial overhead without a measurement); less where small shapes pack
    rate = plan["throughput"]["flops_per_s"]
    alone = plan["total"]["flops"] / rate / 3600
    assert plan["total"]["device_hours"] < alone
    unpacked = client.post("/sweeps", params={"dry_run": "true"}, json={
        **half_gpu, "resources": {"cpus": 4, "gpus": 0.5, "pack": 1}})
    assert unpacked.json()["total"]["device_hours"] == pytest.approx(alone, rel=1e-9)
    assert plan["total"]["device_hours"] > plan["ceiling"]["device_hours"]
    assert plan["ceiling"]["exceeded"]
    # this server has no GPU: no wall time, and why
    assert plan["total"]["wall_s"] is None and "0 GPUs" in plan["warnings"][0]
    assert client.get("/sweeps").json() == []  # nothing queued or stored


def test_wall_time_follows_the_cluster_and_max_concurrent(client):
    # every trial on half a GPU: the example's 8-worker top would not fit on one GPU
    spec = {**example("gpu_study.yaml"), "resources": {"cpus": 4, "gpus": 0.5}}

    def wall(gpus: int, concurrent: int) -> tuple[float, float]:
        r = client.post("/sweeps", json={**spec, "max_concurrent": concurrent},
                        params={"dry_run": "true", "gpus": gpus, "cpus": 16 * gpus})
        assert r.status_code == 200, r.text
        t = r.json()["total"]
        return t["wall_s"], t["device_hours"]

    one, hours = wall(1, 8)  # half a GPU each: two at a time
    eight, same = wall(8, 8)  # 16 halves: max_concurrent 8 bounds it
    sixteen, _ = wall(16, 32)
    # device-hours barely depend on the cluster (only through how small shapes pack)
    assert same == pytest.approx(hours, rel=1e-3)
    # on one GPU two halves at a time: the wall time is at least half the trials' time
    assert hours * 3600 / 0.5 / 2 <= one * 1.0001
    assert sixteen < eight < one
    assert sixteen >= max_trial_seconds(client, spec)
    assert client.get("/sweeps").json() == []


def max_trial_seconds(client, spec) -> float:
    r = client.post("/sweeps", json=spec, params={"dry_run": "true"})
    rate = r.json()["throughput"]["flops_per_s"]
    return max(c.flops for c in stage_costs(load_spec(spec))) / rate / 0.5  # half a GPU


def test_a_sweep_over_the_device_hours_ceiling_needs_confirmation(hpt_home, monkeypatch,
                                                                   tiny_spec):
    monkeypatch.setenv("HPT_MAX_SWEEP_DEVICE_HOURS", "1e-9")
    with TestClient(create_app(get_settings(), dispatch=False)) as c:
        r = c.post("/sweeps", json=tiny_spec)
        assert r.status_code == 422, r.text
        (error,) = r.json()["errors"]
        assert error["field"] == "confirm_cost"
        assert "CPU-hours" in error["message"] and "--confirm-cost" in error["message"]
        assert "HPT_MAX_SWEEP_DEVICE_HOURS=1e-09" in error["message"]
        assert c.get("/sweeps").json() == []
        r = c.post("/sweeps", json=tiny_spec, params={"confirm_cost": "true"})
        assert r.status_code == 201, r.text
        assert len(c.get("/sweeps").json()) == 1
    # the micro-run that priced it is cached under HPT_HOME
    assert list((hpt_home / "calibration").glob("cpu-*.json"))


def test_the_cpu_plan_says_its_micro_run_and_packs_small_shapes(client, tiny_spec):
    tiny_spec["max_concurrent"] = 1  # one slot: packing.plan_packs packs all three
    r = client.post("/sweeps", json=tiny_spec, params={"dry_run": "true", "cpus": 2})
    plan = r.json()
    assert plan["throughput"]["source"] == "micro-run", plan["throughput"]
    assert "micro-run" in plan["text"] and plan["unit"] == "CPU-hours"
    (row,) = plan["stages"]
    assert (row["stage"], row["trials"], row["workers_per_trial"]) == ("grid", 3, [1])
    # three LRs of one tiny shape: one task (pack: auto), as the dispatcher packs them
    assert [(x["trials"], x["tasks"]) for x in plan["rounds"]] == [(3, 1)]
    tiny_spec["resources"] = {"pack": 1}
    plan = client.post("/sweeps", json=tiny_spec, params={"dry_run": "true"}).json()
    assert [(x["trials"], x["tasks"]) for x in plan["rounds"]] == [(3, 3)]
    assert client.get("/sweeps").json() == []


def test_a_grid_of_diverging_lrs_is_still_priced(client, tiny_spec):
    # the micro-run times its steps at a small LR: a step costs the same at any LR, and at
    # the sweep's own (SP at lr 64 diverges at once) the timing trials stopped early: a 500
    tiny_spec["arms"] = [{"arch": "gpt", "parameterization": "sp"}]
    tiny_spec["grid"]["lrs"] = [64.0]
    r = client.post("/sweeps", json=tiny_spec, params={"dry_run": "true"})
    assert r.status_code == 200, r.text
    assert r.json()["throughput"]["source"] == "micro-run" and r.json()["total"]["wall_s"] > 0


def test_a_micro_run_that_cannot_train_is_a_422_naming_the_arm(client, tiny_spec, monkeypatch):
    # a shape whose trials fail (here: every trial's forward raises) cannot be priced, and
    # would not train: the plan says so instead of a 500
    from hptransfer.models import gpt

    def broken(*args, **kwargs):
        raise FloatingPointError("a forward that cannot run")

    monkeypatch.setattr(gpt.GPT, "forward", broken)
    r = client.post("/sweeps", json=tiny_spec, params={"dry_run": "true", "calibrate": "true"})
    assert r.status_code == 422, r.text
    (err,) = r.json()["errors"]
    assert err["field"] == "arms", err
    assert ("the micro-run that prices this sweep could not train its first arm at 32x1 "
            f"for {MICRO_STEPS} steps") in err["message"], err
    assert "a forward that cannot run" in err["message"], err


def test_scaled_out_trials_are_priced_per_worker(client):
    """A rule giving the ladder's top 4 workers: each holds the whole AdamW state and a
    quarter of the batch's activations; admission names the rule when a batch is smaller
    than its workers."""
    spec = example("gpu_study.yaml")
    spec["resources"] = {"cpus": 4, "gpus": 1,
                         "scale_out": [{"min_params": 1e9, "workers": 4, "gpus": 1}]}
    whole = copy.deepcopy(spec)
    del whole["fixed"]["micro_batch_size"]  # each worker's whole share of the batch at once
    costs = stage_costs(load_spec(whole))
    top = next(c for c in costs if (c.width, c.depth) == (2048, 32))
    small = next(c for c in costs if (c.width, c.depth) == (256, 4))
    assert top.task.workers == 4 and small.task.workers == 1
    assert top.worker_memory_bytes == pytest.approx(
        top.state_bytes + top.activation_bytes / 4, rel=0.01)
    assert small.worker_memory_bytes == small.memory_bytes
    plan = client.post("/sweeps", json=spec, params={"dry_run": "true", "gpus": 8}).json()
    rows = {row["stage"]: row for row in plan["stages"]}
    assert rows["transfer"]["workers_per_trial"] == [1, 4]
    assert rows["tune"]["workers_per_trial"] == [1]
    # every trial on 64 workers: the base shape's batch of 32 cannot be split that far
    spec["resources"]["scale_out"] = [{"min_params": 0, "workers": 64, "gpus": 1}]
    r = client.post("/sweeps", json=spec, params={"dry_run": "true"})
    assert r.status_code == 422, r.text
    assert {e["field"] for e in r.json()["errors"]} == {"resources.scale_out[0].workers"}


def test_cli_and_client_plan_through_a_server(hpt_home, capsys):
    from hptransfer.api.server import serve_in_thread
    from hptransfer.cli import main
    from hptransfer.client import Client

    spec = str(EXAMPLES / "gpu_study.yaml")
    with serve_in_thread(get_settings(), dispatch=False) as url:
        assert main(["plan", spec, "--url", url, "--gpus", "8", "--cpus", "128"]) == 0
        out = capsys.readouterr().out
        with Client(url) as c:
            plan = c.plan(spec, gpus=8, cpus=128)
            assert c.list() == []
            with pytest.raises(Exception, match="confirm_cost|confirm-cost"):
                c.submit(copy.deepcopy(example("gpu_study.yaml")))
            assert c.list() == []
    assert plan["text"] in out
    assert "`hpt submit` needs --confirm-cost" in out
    for stage in ("tune", "transfer", "check", "aspect_ratio", "total"):
        assert any(line.startswith(stage) for line in out.splitlines()), stage
    assert "wall time:" in out and "8 GPUs" in out


# ---- the wall-time replay, device-hours and the submit bound, by hand


def gpu_lrs(**resources) -> dict:
    """Four LRs of one GPU shape (one arm, one seed): four trials of equal FLOPs, each
    alone on its task unless `resources` says otherwise."""
    return {"name": "gpu-lrs", "arms": [{"arch": "gpt", "parameterization": "mup"}],
            "grid": {"widths": [512], "depths": [4], "lrs": [2**-10, 2**-9, 2**-8, 2**-7],
                     "seeds": [0]},
            "fixed": {"head_dim": 64, "seq_len": 512, "base_width": 512, "base_depth": 4,
                      "device": "auto"},
            "budget": {"steps": 1000, "batch_size": 32},
            "data": {"source": "stdlib", "tokenizer": "bpe"},
            "resources": {"cpus": 4, "gpus": 1, "pack": 1, **resources},
            "max_concurrent": 8}


def dry_run(client, spec: dict, **params) -> dict:
    r = client.post("/sweeps", json=spec, params={"dry_run": "true", **params})
    assert r.status_code == 200, r.text
    return r.json()


def one_trial_seconds(spec: dict, plan: dict, workers: int = 1) -> float:
    """A trial's FLOPs at the plan's stated rate (a GPU's peak x MFU: nothing per step or
    per trial on top), its workers each at DDP_EFFICIENCY of one process."""
    (flops,) = {analytic_flops(p.trial) for p in plan_sweep(load_spec(spec))}
    rate = plan["throughput"]["flops_per_s"]
    assert plan["throughput"]["overhead_s"] == plan["throughput"]["layer_pass_s"] == 0.0
    return flops / (rate * (workers * DDP_EFFICIENCY if workers > 1 else 1.0))


@pytest.mark.parametrize(("gpus", "cpus", "concurrent", "waves"), [
    (8, 64, 8, 1),  # room for all four
    (8, 64, 3, 2),  # max_concurrent 3: three, then one
    (8, 64, 1, 4),  # max_concurrent 1
    (2, 64, 8, 2),  # two GPUs
    (8, 8, 8, 2),  # 8 CPUs, 4 a task
    (1, 64, 8, 4),  # one at a time
])
def test_wall_time_runs_tasks_in_waves_of_free_gpus_cpus_and_max_concurrent(
        client, gpus, cpus, concurrent, waves):
    spec = {**gpu_lrs(), "max_concurrent": concurrent}
    plan = dry_run(client, spec, gpus=gpus, cpus=cpus)
    seconds = one_trial_seconds(spec, plan)
    assert [(r["trials"], r["tasks"]) for r in plan["rounds"]] == [(4, 4)]
    # each task holds its slot for its trial's time and the dispatcher's gap after it (the
    # tick, the lease, Ray's task start: a tenth of a second at the least)
    assert plan["total"]["wall_s"] == pytest.approx(waves * (seconds + TASK_GAP_S),
                                                    rel=1e-9)
    assert plan["total"]["wall_s"] >= waves * (seconds + 0.1)
    (row,) = plan["stages"]
    assert row["device_hours"] == pytest.approx(4 * seconds / 3600, rel=1e-9)
    assert row["tokens"] == 4 * 1000 * 32 * 512  # trials x steps x batch x seq_len
    assert row["peak_memory_per_worker_gb"] > 0


def test_data_parallel_trials_hold_all_their_workers_gpus(client):
    """Two workers a trial: each trial holds two GPUs for its time (at DDP_EFFICIENCY
    per worker), so four GPUs run two trials at a time, and one GPU none."""
    spec = gpu_lrs(workers=2)
    plan = dry_run(client, spec, gpus=4, cpus=64)
    seconds = one_trial_seconds(spec, plan, workers=2)
    assert plan["total"]["wall_s"] == pytest.approx(2 * (seconds + TASK_GAP_S), rel=1e-9)
    assert plan["total"]["device_hours"] == pytest.approx(4 * seconds * 2 / 3600, rel=1e-9)
    assert plan["stages"][0]["workers_per_trial"] == [2]
    alone = dry_run(client, spec, gpus=1, cpus=64)
    assert alone["total"]["wall_s"] is None
    (warning,) = alone["warnings"]
    assert "a task needs 8 CPUs and 2 GPUs, the cluster has 64 CPUs and 1 GPUs" in warning


def test_a_trial_needing_more_gpus_than_the_cluster_has_gets_no_wall_time(client):
    plan = dry_run(client, gpu_lrs(gpus=2), gpus=1, cpus=64)
    assert plan["total"]["wall_s"] is None and plan["rounds"][0]["wall_s"] is None
    assert "1 GPUs" in plan["warnings"][0] and "none: the trials cannot run" in plan["text"]


def test_a_pack_is_priced_at_its_members_time_over_the_measured_gain(client):
    """On one GPU the four LRs (a shape packing gains at) form one pack, whose time is
    theirs alone over the gain measured for the shape; with four GPUs each runs alone."""
    spec = gpu_lrs(pack="auto")
    plan = dry_run(client, spec, gpus=1, cpus=64)
    seconds = one_trial_seconds(spec, plan)
    gain = pack_gain({"batch_size": 32, "seq_len": 512, "width": 512},
                     measured_packs(load_spec(spec)))
    assert 1 < gain < 4
    assert [(r["trials"], r["tasks"]) for r in plan["rounds"]] == [(4, 1)]
    assert plan["total"]["device_hours"] == pytest.approx(4 * seconds / gain / 3600,
                                                          rel=1e-9)
    assert plan["total"]["wall_s"] == pytest.approx(4 * seconds / gain + TASK_GAP_S,
                                                    rel=1e-9)
    spread = dry_run(client, spec, gpus=4, cpus=64)
    assert [(r["trials"], r["tasks"]) for r in spread["rounds"]] == [(4, 4)]
    assert spread["total"]["wall_s"] == pytest.approx(seconds + TASK_GAP_S, rel=1e-9)


def test_a_study_s_wall_time_adds_its_rounds_and_planned_leaves_out_extensions(client):
    spec = {**example("gpu_study.yaml"), "resources": {"cpus": 4, "gpus": 0.5}}
    plan = dry_run(client, spec, gpus=8, cpus=128)
    rounds = plan["rounds"]
    assert [r["round"] for r in rounds] == [
        "tune", "tune extension 1", "tune extension 2", "transfer + check + aspect_ratio",
        "check extension 1"]
    walls = [r["wall_s"] for r in rounds]
    assert plan["total"]["wall_s"] == pytest.approx(math.fsum(walls), rel=1e-12)
    planned = math.fsum(r["wall_s"] for r in rounds if "extension" not in r["round"])
    assert plan["total"]["wall_s_planned"] == pytest.approx(planned, rel=1e-12)
    assert plan["total"]["wall_s_planned"] < plan["total"]["wall_s"]


def test_each_stage_s_peak_memory_is_its_largest_trial_s_per_worker(client):
    spec = example("gpu_study.yaml")
    plan = dry_run(client, spec, gpus=8, cpus=128)
    peaks: dict[str, float] = {}
    for c in stage_costs(load_spec(spec)):
        peaks[c.stage] = max(peaks.get(c.stage, 0.0), c.worker_memory_bytes)
    rows = {row["stage"]: row for row in plan["stages"]}
    assert {s: r["peak_memory_per_worker_gb"] * 1e9 for s, r in rows.items()} == \
        pytest.approx(peaks, rel=1e-12)
    assert plan["total"]["peak_memory_per_worker_gb"] * 1e9 == pytest.approx(
        max(peaks.values()), rel=1e-12)


@pytest.mark.parametrize(("seconds", "said"), [
    (90.0, "90 s"), (600.0, "10.0 min"), (3 * 3600.0, "3.0 h"), (4 * 86400.0, "4.0 days")])
def test_the_cost_message_says_the_wall_time_in_its_unit(seconds, said):
    plan = {"unit": "GPU-hours", "throughput": {"detail": "peak"},
            "total": {"device_hours": 2.0, "wall_s": seconds, "trials": 3, "flops": 1e18}}
    assert f"~{said} of wall time" in cost_message(plan, 1.0)


def test_the_submit_bound_takes_every_trial_at_the_fastest_rate_on_a_whole_device():
    """`may_exceed` decides whether a submit is priced: a bound that needs no calibration,
    each trial at FASTEST_FLOPS plus MIN_TRIAL_S, on at least one whole device (a half-GPU
    trial's real price is not halved by sharing: it runs at half the rate)."""
    spec = load_spec(gpu_lrs(gpus=0.5))
    costs = stage_costs(spec)
    flops = [analytic_flops(p.trial) for p in plan_sweep(spec)]
    bound = math.fsum(f / 2.5e15 + 0.01 for f in flops) * 1.0 / 3600
    assert may_exceed(spec, costs, 0.99 * bound)
    assert not may_exceed(spec, costs, 1.01 * bound)
    tiny = load_spec({**gpu_lrs(gpus=0.5), "budget": {"steps": 1, "batch_size": 1}})
    tiny_bound = math.fsum(analytic_flops(p.trial) / 2.5e15 + 0.01
                           for p in plan_sweep(tiny)) / 3600  # MIN_TRIAL_S: nearly all
    assert may_exceed(tiny, stage_costs(tiny), 0.99 * tiny_bound)
    assert not may_exceed(tiny, stage_costs(tiny), 1.01 * tiny_bound)
