"""Admission (`coordinator/admission.py`) by hand: the trials each stage can train, where a
target's worst case lands, a data-parallel worker's share of the batch, the memory limits
it is held to (Ray's nodes, GPUs, the configured cap) and the per-worker check. No Ray
cluster: its node table is faked."""

from __future__ import annotations

import copy
import dataclasses
import math
from types import SimpleNamespace

import pytest
import ray
import torch
from conftest import TINY_SPEC
from test_study import study_dict
from test_study_targets import trial_flops

from hptransfer.config import get_settings
from hptransfer.coordinator import admission
from hptransfer.coordinator.admission import (
    admit,
    gpu_memory,
    largest_worker_memory,
    stage_costs,
    stage_shapes,
    trial_costs,
    trials_per_shape,
)
from hptransfer.models import build_model
from hptransfer.spec import SpecError, load_spec


def tiny(**changes) -> dict:
    spec = copy.deepcopy(TINY_SPEC)
    for section, values in changes.items():
        spec[section] = {**spec.get(section, {}), **values}
    return spec


# ---- the trials each stage can train


def test_each_stage_s_trials_by_hand():
    """3 LRs x 2 sigmas x 2 seeds at the base shape, plus 2 tune extension rounds of 3 LRs
    (each x sigmas x seeds); the ladder once per seed; the check bracket (-1, 0, 1) at the
    ladder's top without its 0, plus one extension round of 2 LRs, per seed."""
    spec = study_dict(
        tune={"extend": 2, "extend_lrs": 3},
        transfer={"shapes": [{"width": 32, "depth": 2}, {"width": 64, "depth": 2}]},
        check={"extend": 1, "extend_lrs": 2})
    spec["grid"].update(lrs=[2**-9, 2**-8, 2**-7], sigma_bases=[0.01, 0.02], seeds=[0, 1])
    shapes = {(s.stage, s.width, s.depth): (s.trials, s.planned)
              for s in stage_shapes(load_spec(spec))}
    assert shapes == {
        ("tune", 32, 1): ((3 + 2 * 3) * 2 * 2, 3 * 2 * 2),
        ("transfer", 32, 2): (2, 2), ("transfer", 64, 2): (2, 2),
        ("check", 64, 2): ((2 + 2) * 2, 2 * 2),
    }
    # (64, 2) is trained by two stages: each stage's trials count
    assert trials_per_shape(load_spec(spec))[(64, 2, None)] == 2 + 8


def _added(spec_dict) -> dict:
    """The trials a target adds to each (stage, width, depth), worst case."""
    base = copy.deepcopy(spec_dict)
    for section in base["stages"].values():
        for key in ("target", "max_extra_trials", "max_extra_flops"):
            section.pop(key, None)
    before = {(s.stage, s.width, s.depth): s.trials for s in stage_shapes(load_spec(base))}
    after = {(s.stage, s.width, s.depth): s.trials
             for s in stage_shapes(load_spec(spec_dict))}
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def test_a_target_s_worst_case_lands_on_the_stage_s_costliest_shape_by_n_squared_l():
    # 64x1 has 12 x 64^2 x 1 = 49152 (x 12) block parameters, 32x3 12 x 32^2 x 3 = 36864:
    # 64x1 is the larger model though 32x3 has more width x depth
    ladder = [{"width": 32, "depth": 3}, {"width": 64, "depth": 1}]
    spec = study_dict(transfer={"shapes": ladder, "target": {"savings_excludes_zero": True},
                                "max_extra_trials": 10})
    assert _added(spec) == {("transfer", 64, 1): 10}


def test_a_check_target_s_flop_cap_buys_trials_at_the_cheaper_base_shape():
    """A check target may add its trials at the tune stage's base shape (32x1) too: its FLOP
    cap buys as many trials as it pays for there, all priced at the check shape (64x2), the
    most the cap may spend there first (ceil 2.5 = 3), the rest at the stage's cheapest,
    which is the check shape itself."""
    spec = study_dict()
    base = load_spec(spec)
    f = {(w, d): trial_flops(base.trial_spec(base.arms[0], w, d, 0.01, 1.0, 0))
         for w, d in ((32, 1), (64, 2))}
    cap = 2.5 * f[(64, 2)]
    spec["stages"]["check"] = {"target": {"shift_ci_log2": 0.5}, "max_extra_trials": 100,
                               "max_extra_flops": cap}
    n = math.floor(cap / f[(32, 1)])
    assert 3 < n < 100
    assert _added(spec) == {("check", 64, 2): n}


def test_a_shape_another_stage_trains_on_other_resources_is_checked_again(hpt_home):
    """64x2 is the ladder's top and the check shape; a scale_out rule gives only the check
    stage 8 workers, more than its batch of 4 sequences: refused under that rule, though
    the same shape's transfer trials (one worker) pass."""
    spec = study_dict()
    spec["resources"] = {"scale_out": [{"stages": ["check"], "workers": 8}]}
    with pytest.raises(SpecError) as err:
        admit(load_spec(spec), get_settings())
    fields = [e["field"] for e in err.value.errors]
    assert fields == ["resources.scale_out[0].workers"] * 2  # one per arm


# ---- a data-parallel worker's share


@pytest.mark.parametrize(("workers", "rows"), [(2, 2), (3, 2), (4, 1)])
def test_a_worker_holds_the_activations_of_its_rows_rounded_up(workers, rows):
    # activations are linear in the batch (4 bytes x batch x seq x ...): ceil(4 / W) rows of 4
    (cost,) = stage_costs(load_spec(tiny(resources={"workers": workers})))
    assert cost.worker_activation_bytes == pytest.approx(cost.activation_bytes * rows / 4)
    assert cost.worker_memory_bytes == pytest.approx(cost.state_bytes + cost.activation_bytes
                                                     * rows / 4)


# ---- the memory a trial must fit


def _ray_nodes(monkeypatch, nodes) -> None:
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "nodes", lambda: nodes)


def test_a_cpu_trial_must_fit_the_largest_alive_ray_node(monkeypatch):
    _ray_nodes(monkeypatch, [
        {"Alive": True, "Resources": {"memory": 8e9, "CPU": 4}},
        {"Alive": True, "Resources": {"memory": 64e9, "CPU": 16}},
        {"Alive": False, "Resources": {"memory": 512e9}},  # gone: not a place to run
        {"Alive": True, "Resources": {"CPU": 1}},
    ])
    assert largest_worker_memory() == (64e9, "the largest Ray worker node")


def _host_gpu(monkeypatch, total_memory: float) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(total_memory=total_memory, name="Fake GPU"))


def test_a_gpu_trial_must_fit_the_cluster_s_smallest_gpu(monkeypatch):
    _host_gpu(monkeypatch, 16e9)  # this host's: not the cluster's where Ray names its GPUs
    _ray_nodes(monkeypatch, [
        {"Alive": True, "Resources": {"GPU": 8, "accelerator_type:A100": 1}},
        {"Alive": True, "Resources": {"GPU": 1, "accelerator_type:L4": 1}},
        {"Alive": False, "Resources": {"GPU": 1, "accelerator_type:A10G": 1}},
    ])
    assert gpu_memory() == (24e9, "an L4")  # the L4's 24 GB, not the A100's 80
    # GPUs of a type the table does not know: nothing known (not this host's GPU)
    _ray_nodes(monkeypatch, [{"Alive": True, "Resources": {"accelerator_type:X9": 1}}])
    assert gpu_memory() is None
    # no Ray: this host's own GPU
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert gpu_memory() == (16e9, "this host's Fake GPU")


def _tiny_memory_bytes(batch: int) -> float:
    """The tiny trial's memory counted independently: 16 bytes per parameter of the real
    model, and 4 bytes x batch x seq 32 x (width 32 x 17 + the final norm's 32 + 3 x 256)
    of activations (tests/test_input_hardening.py works the terms out)."""
    built = build_model("gpt", 32, 1, "completep", head_dim=32, vocab_size=256,
                        max_seq_len=32, base_width=32, base_depth=1)
    params = sum(p.numel() for p in built.model.parameters())
    return 16 * params, 4 * batch * 32 * (32 * 17 + 32 + 3 * 256)


def test_the_configured_memory_cap_is_in_gb(hpt_home):
    state, activations = _tiny_memory_bytes(4)
    need = state + activations
    spec = load_spec(TINY_SPEC)
    admit(spec, dataclasses.replace(get_settings(), max_trial_memory_gb=1.01 * need / 1e9))
    with pytest.raises(SpecError, match="HPT_MAX_TRIAL_MEMORY_GB"):
        admit(spec, dataclasses.replace(get_settings(), max_trial_memory_gb=0.99 * need / 1e9))


def test_a_data_parallel_trial_is_admitted_by_each_worker_s_memory(hpt_home):
    """4 DDP workers, a batch of 64: each holds the whole state and 16 sequences'
    activations. A cap between that and the whole trial's memory admits it."""
    state, activations = _tiny_memory_bytes(64)
    assert activations > 4 * state  # the activations decide
    worker = state + activations / 4
    cap = (worker + state + activations) / 2  # above a worker's, below the whole trial's
    spec = load_spec(tiny(budget={"batch_size": 64}, resources={"workers": 4}))
    settings = dataclasses.replace(get_settings(), max_trial_memory_gb=cap / 1e9)
    admit(spec, settings)
    # the same trial on one worker is refused
    alone = load_spec(tiny(budget={"batch_size": 64}))
    with pytest.raises(SpecError, match="HPT_MAX_TRIAL_MEMORY_GB"):
        admit(alone, settings)
    assert [c.worker_memory_bytes for c in trial_costs(spec)] == [pytest.approx(worker)]
    assert admission.GPU_MEMORY["A100"] == 80e9  # the larger variant: never refuse a fit
