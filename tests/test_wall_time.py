"""The server's wall-time ceilings: an attempt training past HPT_MAX_TRIAL_HOURS stops there,
failed, saying so (its curve kept); a sweep running past HPT_MAX_SWEEP_HOURS fails, saying
so, and its running trials are cancelled."""

from __future__ import annotations

import copy

from conftest import TINY_SPEC
from waiting import wait_for

from hptransfer.api.server import serve_in_thread
from hptransfer.client import Client
from hptransfer.config import get_settings
from hptransfer.workers.trainer import run_trial


def test_an_attempt_past_the_trial_ceiling_stops_failed_with_its_curve(tmp_path):
    spec = dict(width=32, depth=1, head_dim=32, lr=2**-8, seq_len=32, batch_size=4,
                budget={"steps": 100_000}, data={"source": "stdlib", "tokenizer": "byte"},
                num_threads=1)
    result = run_trial(spec, cache_dir=str(tmp_path), max_hours=2.0 / 3600)  # 2 seconds
    assert result.status == "failed"
    assert "HPT_MAX_TRIAL_HOURS=0.000555556" in result.error
    assert 0 < result.steps < 100_000
    assert result.curve[-1]["step"] == result.steps  # the curve says where it stopped
    assert result.final_val_loss is None
    untimed = run_trial({**spec, "budget": {"steps": 20}}, cache_dir=str(tmp_path),
                        max_hours=1.0)
    assert untimed.status == "completed" and untimed.error is None


def test_a_sweep_past_the_sweep_ceiling_fails_and_cancels_its_trials(hpt_home, ray_cluster,
                                                                      monkeypatch):
    monkeypatch.setenv("HPT_MAX_SWEEP_HOURS", str(8.0 / 3600))  # 8 seconds
    spec = copy.deepcopy(TINY_SPEC)
    spec.update(name="too-long", max_concurrent=1)
    spec["budget"] = {"steps": 200_000, "batch_size": 4}
    spec["resources"] = {"cpus": 1, "pack": 1}
    with serve_in_thread(get_settings()) as url, Client(url) as c:
        sweep = c.submit(spec)
        done = c.wait(sweep["id"], poll=0.3, timeout=120, progress=False)
        wait_for(lambda: (c.trials(sweep["id"])["status"] == "cancelled").all(), 60,
                 "every trial cancelled")
        trials = c.trials(sweep["id"])
    assert done["status"] == "failed"
    assert "HPT_MAX_SWEEP_HOURS=0.00222222" in done["error"]
    assert set(trials["status"]) == {"cancelled"}


def test_a_pack_past_the_trial_ceiling_stops_every_member_failed_with_its_curve(tmp_path):
    """Packed trials have the same ceiling: each member stops failed where the pack got."""
    from hptransfer.workers.packed import run_trials

    spec = dict(width=32, depth=1, head_dim=32, seq_len=32, batch_size=4,
                budget={"steps": 5_000}, data={"source": "stdlib", "tokenizer": "byte"},
                num_threads=1)
    results = run_trials([{**spec, "lr": lr} for lr in (2**-9, 2**-7)],
                         cache_dir=str(tmp_path), max_hours=1.0 / 3600)  # 1 second
    for result in results:
        assert result.status == "failed"
        assert "HPT_MAX_TRIAL_HOURS=0.000277778" in result.error
        assert 0 < result.steps < 5_000
        steps = [p["step"] for p in result.curve]
        assert steps[-1] == result.steps and len(steps) == len(set(steps))
    assert results[0].steps == results[1].steps  # trained in lockstep
