"""Priced before queued: `hpt plan`, POST /sweeps?dry_run=true and Client.plan price a sweep
per stage without storing anything, and a sweep priced above HPT_MAX_SWEEP_DEVICE_HOURS is
queued only with confirm_cost."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

from hptransfer.api.app import create_app
from hptransfer.config import get_settings
from hptransfer.coordinator.admission import stage_costs
from hptransfer.coordinator.plan import ShapeKey, plan_sweep, trial_at
from hptransfer.models.flops import flops_per_token, param_counts
from hptransfer.spec import load_spec

EXAMPLES = Path(__file__).parent.parent / "examples"


def example(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / name).read_text())


@pytest.fixture
def client(hpt_home):
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
