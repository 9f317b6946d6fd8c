"""Compute ceilings at submit: a trial cannot be stopped once it runs (the trainer has no
time limit), so its steps, its FLOPs and the FLOPs of the whole sweep are bounded by default
(raised with HPT_MAX_TRIAL_STEPS, HPT_MAX_TRIAL_FLOPS, HPT_MAX_SWEEP_FLOPS); each refusal is
a 422 naming the field and the limit."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

from hptransfer.api.app import create_app
from hptransfer.config import get_settings
from hptransfer.coordinator.admission import admit, trial_costs, trials_per_shape
from hptransfer.spec import SpecError, load_spec

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.yaml"))


def example(name: str) -> dict:
    return yaml.safe_load((Path(__file__).parent.parent / "examples" / name).read_text())


def refusals(spec: dict) -> list[dict[str, str]]:
    with pytest.raises(SpecError) as info:
        admit(load_spec(spec), get_settings())
    return info.value.errors


@pytest.mark.parametrize("budget, field", [({"steps": 10**9}, "budget.steps"),
                                          ({"tokens": 10**15}, "budget.tokens")])
def test_a_tiny_model_with_an_endless_budget_is_refused(hpt_home, tiny_spec, budget, field):
    """The probe's specs: accepted before, they would have trained for days."""
    tiny_spec["budget"] = {**budget, "batch_size": 4}
    with TestClient(create_app(get_settings(), dispatch=False)) as client:
        r = client.post("/sweeps", json=tiny_spec)
        assert r.status_code == 422, r.text
        errors = r.json()["errors"]
        assert errors[0]["field"] == field, errors
        assert "more than HPT_MAX_TRIAL_STEPS=1000000" in errors[0]["message"]
        assert client.get("/sweeps").json() == []


def test_the_steps_ceiling_is_raised_by_configuration(hpt_home, tiny_spec, monkeypatch):
    tiny_spec["budget"] = {"steps": 2_000_000, "batch_size": 4}
    assert "HPT_MAX_TRIAL_STEPS" in refusals(tiny_spec)[0]["message"]
    monkeypatch.setenv("HPT_MAX_TRIAL_STEPS", "2000000")
    admit(load_spec(tiny_spec), get_settings())


def test_a_cpu_trial_past_the_default_flops_ceiling_is_refused(hpt_home, monkeypatch):
    spec = example("depth_transfer.yaml")  # 1.4e15 FLOPs at its deepest: admitted
    admit(load_spec(spec), get_settings())
    spec["budget"]["tokens_per_param"] = 150  # 1.05e16, in well under a million steps
    errors = refusals(spec)
    assert {e["field"] for e in errors} == {"grid"}, errors
    assert ("exceeds the server's ceiling of 1e+16 FLOPs per trial on a CPU (raise it "
            "with HPT_MAX_TRIAL_FLOPS on the server)") in errors[0]["message"]
    monkeypatch.setenv("HPT_MAX_TRIAL_FLOPS", "1e17")
    admit(load_spec(spec), get_settings())


def test_the_gpu_example_fits_its_ceilings_and_a_cpu_would_not(hpt_home):
    spec = example("gpu_study.yaml")  # 3.3e20 FLOPs for its largest trial, by design
    admit(load_spec(spec), get_settings())
    spec["resources"] = {"cpus": 4, "gpus": 0}
    messages = [e["message"] for e in refusals(spec)]
    assert any("1e+16 FLOPs per trial on a CPU" in m for m in messages), messages


def test_a_sweep_past_the_default_flops_ceiling_is_refused(hpt_home, monkeypatch):
    spec = example("gpu_study.yaml")
    spec["grid"]["seeds"] = list(range(10))  # each trial as before, 5x the trials
    errors = refusals(spec)
    assert [e["field"] for e in errors] == ["grid"], errors
    # 960 by SweepSpec.trial_count, which counts the check bracket's 0 at its ladder shape
    # (1024x16): that is the ladder's own trial, never trained twice
    assert errors[0]["message"].startswith("sweep too large: its 930 trials (at most) train")
    assert ("exceeds the server's ceiling of 1e+22 FLOPs per sweep on a GPU (raise it with "
            "HPT_MAX_SWEEP_FLOPS on the server)") in errors[0]["message"]
    monkeypatch.setenv("HPT_MAX_SWEEP_FLOPS", "1e23")
    admit(load_spec(spec), get_settings())
    monkeypatch.setenv("HPT_MAX_SWEEP_FLOPS", "1e12")
    assert "exceeds HPT_MAX_SWEEP_FLOPS=1e+12" in refusals(example("cpu_small.yaml"))[0][
        "message"]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_is_admitted_and_counted_shape_by_shape(hpt_home, path):
    spec = load_spec(yaml.safe_load(path.read_text()))
    admit(spec, get_settings())
    # the sweep's FLOPs count every trial it can plan: the spec's own count, shape by shape
    # (the check bracket's 0 at a ladder shape is the ladder's trial: counted once by both)
    assert sum(trials_per_shape(spec).values()) * len(spec.arms) == spec.trial_count()
    assert {c.trials for c in trial_costs(spec)} <= set(trials_per_shape(spec).values())


def test_a_tokens_per_param_budget_past_the_steps_ceiling_names_its_field(hpt_home, tiny_spec):
    spec = copy.deepcopy(tiny_spec)
    spec["budget"] = {"tokens_per_param": 10**6, "batch_size": 4}
    fields = {e["field"] for e in refusals(spec)}
    assert fields == {"budget.tokens_per_param"}, fields
