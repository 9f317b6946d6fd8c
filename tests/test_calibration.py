"""Throughput calibration (`coordinator/calibration.py`) by hand: the time formula, the
passes of a step, the weighted fit, the store's rows it reads, the micro-run's shapes and
cache, and the GPU's peak x MFU. Fast, no Ray, no training (the micro-run's trials are
faked with known coefficients)."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import numpy as np
import pytest
from sqlalchemy import create_engine, insert

from hptransfer.coordinator import calibration
from hptransfer.coordinator.calibration import (
    Throughput,
    fit,
    from_store,
    micro_run,
    micro_shapes,
    passes_per_step,
    peak_throughput,
)
from hptransfer.spec import SpecError, load_spec
from hptransfer.store.schema import Base, Trial

# ---- the time formula and a step's passes


def test_seconds_add_the_overhead_the_layer_passes_and_the_flops_at_the_rate():
    speed = Throughput("cpu", "store", "", flops_per_s=1e9, layer_pass_s=1e-3, overhead_s=2.0)
    # 2 s + 10 steps x 2 passes x depth 3 x 1 ms + 4e9 FLOPs at 1e9/s
    assert speed.seconds(4e9, steps=10, passes=2, depth=3) == pytest.approx(2.0 + 0.06 + 4.0)
    # on 4 workers only the FLOPs divide, by 4 x 0.9 (DDP_EFFICIENCY)
    assert speed.seconds(4e9, 10, 2, 3, workers=4) == pytest.approx(2.0 + 0.06 + 4.0 / 3.6)


@pytest.mark.parametrize(("batch", "micro", "workers", "passes"), [
    (8, None, 1, 1),  # the whole batch at once
    (8, 3, 1, 3),  # 3 + 3 + 2
    (8, 4, 1, 2),
    (5, 2, 2, 2),  # a worker's 3 rows (ceil 5/2) in passes of 2
    (9, 2, 4, 2),  # 3 rows (ceil 9/4) in passes of 2
    (8, 2, 4, 1),  # 2 rows each
])
def test_a_step_takes_the_passes_its_largest_share_of_the_batch_needs(batch, micro, workers,
                                                                      passes):
    assert passes_per_step(batch, micro, workers) == passes


# ---- the fit

TRUE = (2.0, 1e-3, 1e9)  # overhead_s, layer_pass_s, flops_per_s


def _rows(noise=(1.0,)) -> list[tuple[float, float, float]]:
    """(seconds, layer passes, FLOPs) of trials timed at TRUE, each x a factor of `noise`."""
    shapes = [(100, 1e9), (400, 5e9), (1600, 2e9), (3000, 4e10), (800, 3e10), (200, 8e9)]
    overhead, layer, rate = TRUE
    return [((overhead + lp * layer + f / rate) * noise[i % len(noise)], lp, f)
            for i, (lp, f) in enumerate(shapes)]


def test_the_fit_recovers_the_coefficients_of_exact_timings():
    assert fit(_rows()) == pytest.approx(TRUE, rel=1e-6)


def test_the_fit_weighs_each_trial_by_one_over_its_seconds():
    """Noisy timings: the answer is weighted least squares with weights 1/seconds (each
    trial's relative error counts alike), solved here by numpy in closed form."""
    rows = _rows(noise=(1.1, 0.9, 1.05, 0.95, 1.2, 0.8))
    y = np.array([r[0] for r in rows])
    x = np.array([[1.0, r[1], r[2]] for r in rows])
    w = 1.0 / y
    coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
    assert (coef > 0).all()  # inside the non-negative region: NNLS is plain least squares
    unweighted, *_ = np.linalg.lstsq(x, y, rcond=None)
    assert not np.allclose(coef, unweighted, rtol=1e-3)  # the weights matter here
    assert fit(rows) == pytest.approx((coef[0], coef[1], 1.0 / coef[2]), rel=1e-6)


# ---- the store's completed trials


@pytest.fixture
def store(tmp_path):
    engine = create_engine(f"sqlite:///{tmp_path / 'store.db'}")
    Base.metadata.create_all(engine)
    return SimpleNamespace(engine=engine)


def _add(store, spec, rows: list[dict]) -> None:
    """Completed trials of `spec`'s first arm: each row's width, depth, steps, FLOPs and
    seconds, and what its result says (device, workers, notes), newest last."""
    now = datetime.now(UTC)
    values = []
    for i, r in enumerate(rows):
        trial = spec.trial_spec(spec.arms[0], r["width"], r["depth"], 2**-8, 0.02, i)
        if "seq_len" in r:
            trial = trial.model_copy(update={"seq_len": r["seq_len"]})
        values.append(dict(
            id=f"t{i}-{r['width']}", sweep_id="s", idx=i, arm="a", width=r["width"],
            depth=r["depth"], lr=2**-8, sigma_base=0.02, seed=i,
            spec=trial.model_dump(mode="json"), content_hash=str(i), status="completed",
            attempts=1, max_attempts=1, flops=r["flops"], wall_time_s=r["seconds"],
            reused_from=r.get("reused_from"), created_at=now,
            finished_at=now + timedelta(seconds=i),
            result={"steps": r["steps"], "device": r.get("device", "cpu"),
                    "workers": r.get("workers", 1), "notes": r.get("notes", [])}))
    with store.engine.begin() as conn:
        conn.execute(insert(Trial), values)


def _timed(width, depth, steps, flops, workers=1, **extra) -> dict:
    """A trial timed at TRUE: batch 4 in one pass (no micro-batches), so steps x depth layer
    passes; on `workers`, its FLOPs at workers x 0.9 of the rate."""
    overhead, layer, rate = TRUE
    eff = workers * 0.9 if workers > 1 else 1.0
    seconds = overhead + steps * depth * layer + flops / (rate * eff)
    return dict(width=width, depth=depth, steps=steps, flops=flops, seconds=seconds,
                workers=workers, **extra)


def _good_rows() -> list[dict]:
    return [_timed(32, d, s, f) for d, s, f in [
        (1, 100, 1e9), (2, 400, 5e9), (4, 800, 2e9), (1, 3000, 4e10), (2, 1200, 3e10),
        (4, 50, 8e9)]] + [_timed(32, 3, 500, 6e9, workers=2), _timed(32, 1, 900, 2e10, workers=4)]


def test_the_store_fit_recovers_the_coefficients_and_skips_rows_that_are_not_one_trial_s(
        store, tiny_spec):
    spec = load_spec(tiny_spec)
    bogus = dict(seconds=999.0)  # each excluded row says its trial took 999 s
    _add(store, spec, [
        *_good_rows(),
        {**_timed(32, 2, 300, 4e9), **bogus, "notes": ["trained packed: 3 trials in one"]},
        {**_timed(32, 2, 300, 4e9), **bogus, "reused_from": "t0-32"},
        {**_timed(32, 2, 300, 4e9), **bogus, "seq_len": 64},  # other settings
        {**_timed(32, 2, 300, 4e9), **bogus, "device": "cuda:0"},  # another device
    ])
    speed = from_store(store, spec, "cpu")
    assert speed is not None and speed.source == "store"
    assert "fitted to 8 completed trials" in speed.detail
    got = (speed.overhead_s, speed.layer_pass_s, speed.flops_per_s)
    assert got == pytest.approx(TRUE, rel=1e-6)


def test_the_store_needs_eight_matching_trials(store, tiny_spec):
    spec = load_spec(tiny_spec)
    _add(store, spec, _good_rows()[:7])
    assert from_store(store, spec, "cpu") is None


def test_a_bf16_sweep_on_cpus_is_fitted_to_its_cpu_trials(store, tiny_spec):
    """bf16 autocasts on CUDA only: a CPU trial of a bf16 sweep ran fp32 and is keyed so."""
    tiny_spec["fixed"]["precision"] = "bf16"
    spec = load_spec(tiny_spec)
    _add(store, spec, _good_rows())
    speed = from_store(store, spec, "cpu")
    assert speed is not None and speed.flops_per_s == pytest.approx(TRUE[2], rel=1e-6)


def test_a_gpu_sweep_is_fitted_to_the_trials_that_ran_on_cuda(store, tiny_spec):
    tiny_spec["resources"] = {"cpus": 1, "gpus": 1}
    tiny_spec["fixed"].update(device="auto", precision="bf16")
    spec = load_spec(tiny_spec)
    _add(store, spec, [{**r, "device": "cuda:0"} for r in _good_rows()])
    speed = from_store(store, spec, "gpu")
    assert speed is not None and speed.flops_per_s == pytest.approx(TRUE[2], rel=1e-6)
    assert from_store(store, spec, "cpu") is None  # none of them ran on a CPU


# ---- the GPU's peak


def test_a_gpu_is_priced_at_its_peak_times_the_mfu():
    # H100 SXM: 989 TFLOP/s dense bf16 (NVIDIA's datasheet); A100: 312
    assert peak_throughput("H100").flops_per_s == pytest.approx(989e12 * 0.35)
    assert peak_throughput("A100", mfu=0.5).flops_per_s == pytest.approx(312e12 * 0.5)
    unknown = peak_throughput(None)
    assert unknown.flops_per_s == pytest.approx(989e12 * 0.35)
    assert "assumed" in unknown.detail and "assumed" not in peak_throughput("A100").detail


# ---- the micro-run


def test_the_micro_run_times_the_cheapest_costliest_deepest_and_widest_cheap_shapes(
        tiny_spec):
    # a step of 4 x 32 tokens is ~6 x params x 128 FLOPs: up to 64 wide ~1e8, far under
    # the 4e9 bound; 1024 wide (~13 M params a layer) ~1e10, far over
    tiny_spec["grid"].update(widths=[32, 64, 1024], depths=[1, 2])
    assert micro_shapes(load_spec(tiny_spec)) == [(32, 1), (64, 2), (32, 2), (64, 1)]
    # two cheap shapes: head_dim fillers up to three shapes, no more
    tiny_spec["grid"].update(widths=[32, 1024], depths=[1, 2])
    assert micro_shapes(load_spec(tiny_spec)) == [(32, 1), (32, 2), (32, 6)]


def test_fillers_keep_to_the_sweeps_settings_and_the_bound(tiny_spec):
    # value embeddings 2 need depth >= 3: a 1-deep filler is invalid for this arm, so the
    # fillers start at the sweep's shallowest depth (4); every shape is too costly to time
    tiny_spec["arms"] = [{"parameterization": "sp", "arch_options": {"value_embeddings": 2}}]
    tiny_spec["grid"].update(widths=[1024], depths=[4])
    tiny_spec["budget"] = {"steps": 1, "batch_size": 8}  # 256 tokens a step
    assert micro_shapes(load_spec(tiny_spec)) == [(32, 4), (32, 9), (128, 4)]
    # at head size 256 a filler 4 heads wide (1024x4: ~7.7e10 FLOPs a step) is over the
    # fillers' bound (4e10): left out
    tiny_spec["fixed"]["head_dim"] = 256
    assert micro_shapes(load_spec(tiny_spec)) == [(256, 4), (256, 9)]


def test_a_sweep_none_of_whose_shapes_can_be_timed_is_a_spec_error(tiny_spec):
    # a batch rule that gives smaller shapes larger batches: a filler's batch is out of
    # bounds (a ValidationError, once a 500), the sweep's own shape too costly to time
    tiny_spec["grid"].update(widths=[512], depths=[8])
    tiny_spec["fixed"].update(base_width=1024, base_depth=16, micro_batch_size=8,
                              head_dim=32)
    tiny_spec["budget"] = {"steps": 1, "batch_size": 16, "batch_rule": "scale_with_params",
                           "batch_exponent": -2.0}
    with pytest.raises(SpecError) as e:
        micro_shapes(load_spec(tiny_spec))
    (err,) = e.value.errors
    assert err["field"] == "grid" and "no shape of this sweep can be timed" in err["message"]


def test_a_micro_run_trains_on_at_most_this_hosts_cores(tiny_spec, monkeypatch):
    # a task of 1024 CPUs gets 1024 torch threads; timed on a 2-core API host they took
    # minutes and measured their contention: the micro-run takes the host's cores at most
    from hptransfer.workers import trainer

    seen = []

    def record(trial):
        seen.append(trial.num_threads)
        return trainer.TrialResult(status="completed", steps=1, flops=1.0, wall_time_s=1.0)

    monkeypatch.setattr(trainer, "run_trial", record)
    monkeypatch.setattr(calibration.os, "cpu_count", lambda: 2)
    for cpus, threads in ((1024, 2), (2, 2), (1, 1)):
        tiny_spec["resources"] = {"cpus": cpus}
        calibration._time_one(load_spec(tiny_spec), 32, 1)
        assert seen[-1] == threads, (cpus, seen)


def test_a_failed_micro_run_names_the_error_without_its_traceback(tiny_spec, monkeypatch):
    from hptransfer.workers import trainer

    error = ("RuntimeError: a tensor of the wrong size\nTraceback (most recent call last):\n"
             '  File "/srv/hptransfer/workers/trainer.py", line 84, in run_trial\n')
    monkeypatch.setattr(trainer, "run_trial", lambda trial: trainer.TrialResult(
        status="failed", error=error))
    with pytest.raises(SpecError) as e:
        calibration._time_one(load_spec(tiny_spec), 32, 1)
    (err,) = e.value.errors
    assert "(failed: RuntimeError: a tensor of the wrong size)" in err["message"], err
    assert "Traceback" not in err["message"] and "/srv" not in err["message"]


def _fake_trials(monkeypatch, seconds_of) -> list[tuple[int, int]]:
    """Replace the micro-run's trials: (seconds, layer passes, FLOPs) by `seconds_of`, every
    other call 1.5x slower (a noisy host), and each call recorded."""
    calls: list[tuple[int, int]] = []

    def time_one(spec, width, depth):
        lp, flops = 24.0 * depth, 1e6 * width * width * depth
        slow = 1.5 if len(calls) % 2 == 0 else 1.0
        calls.append((width, depth))
        return seconds_of(lp, flops) * slow, lp, flops

    monkeypatch.setattr(calibration, "_time_one", time_one)
    return calls


def test_the_micro_run_fits_the_faster_run_of_each_shape_and_is_cached(
        hpt_home, tiny_spec, monkeypatch):
    overhead, layer, rate = 0.5, 2e-4, 5e9
    calls = _fake_trials(monkeypatch, lambda lp, f: overhead + lp * layer + f / rate)
    spec = load_spec(tiny_spec)  # one 32x1 shape: fillers 32x6 and 128x1
    speed = micro_run(spec, hpt_home)
    # an untimed warm-up, then each shape twice
    assert calls == [(32, 1), (32, 1), (32, 1), (32, 6), (32, 6), (128, 1), (128, 1)]
    assert (speed.source, speed.device) == ("micro-run", "cpu")
    assert (speed.overhead_s, speed.layer_pass_s, speed.flops_per_s) == pytest.approx(
        (overhead, layer, rate), rel=1e-6)
    # cached: the same sweep's settings are not measured again
    assert micro_run(spec, hpt_home) == speed and len(calls) == 7
    # a cache two days old still counts; one older than CACHE_DAYS (7) does not
    (path,) = (hpt_home / "calibration").glob("cpu-*.json")
    cached = json.loads(path.read_text())
    path.write_text(json.dumps({**cached, "measured_at": time.time() - 2 * 86400}))
    assert micro_run(spec, hpt_home) == speed and len(calls) == 7
    path.write_text(json.dumps({**cached, "measured_at": time.time() - 8 * 86400}))
    micro_run(spec, hpt_home)
    assert len(calls) == 14
    # refresh (`hpt plan --calibrate`) measures again
    micro_run(spec, hpt_home, refresh=True)
    assert len(calls) == 21
    # a first arm of another architecture, or another batch rule, trains other steps: its
    # own measurement, not the cached one
    for change in ({"arms": [{"arch": "ngpt", "parameterization": "ngpt"}]},
                   {"arms": [{"parameterization": "completep",
                              "arch_options": {"value_embeddings": 1}}]},
                   {"budget": {**tiny_spec["budget"], "batch_rule": "scale_with_params"}}):
        before = len(calls)
        micro_run(load_spec({**tiny_spec, **change}), hpt_home)
        assert len(calls) == before + 7, change


def test_a_micro_run_whose_flops_get_no_rate_takes_their_rate_over_all_the_time(
        hpt_home, tiny_spec, monkeypatch):
    # seconds that fall as the FLOPs grow: no positive rate fits
    _fake_trials(monkeypatch, lambda lp, f: 30.0 - f / 1e9)
    speed = micro_run(load_spec(tiny_spec), hpt_home)
    flops = [1e6 * 32 * 32 * 1, 1e6 * 32 * 32 * 6, 1e6 * 128 * 128 * 1]
    seconds = [30.0 - f / 1e9 for f in flops]  # the faster run of each
    assert (speed.overhead_s, speed.layer_pass_s) == (0.0, 0.0)
    assert speed.flops_per_s == pytest.approx(sum(flops) / sum(seconds), rel=1e-9)
