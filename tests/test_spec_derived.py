"""The sweep spec declares each trial setting once: its sections take TrialSpec's fields and
bounds, TrialSpec takes the model's defaults, the spec never imports the coordinator, and
planning a grid without re-validating every trial gives the trials validation would."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from hptransfer.coordinator.plan import plan_sweep
from hptransfer.models import ModelConfig
from hptransfer.models.parameterization import Parameterization
from hptransfer.spec import Fixed, SweepBudget, load_spec
from hptransfer.spec.cache import SpecCache
from hptransfer.spec.sections import FIXED_FIELDS, Arm, Grid
from hptransfer.spec.stages import AspectRatioStage, LadderShape, Shape
from hptransfer.spec.trial import Budget, TrialSpec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
TRIAL = TrialSpec.model_fields


def _same_field(model: type, name: str, trial_name: str | None = None) -> None:
    field, trial = model.model_fields[name], TRIAL[trial_name or name]
    assert field.annotation == trial.annotation, name
    assert field.default == trial.default, name
    assert field.metadata == trial.metadata, name


def test_fixed_is_trial_spec_fields_in_its_order():
    assert list(Fixed.model_fields) == list(FIXED_FIELDS)
    for name in FIXED_FIELDS:
        _same_field(Fixed, name)
    assert Fixed.model_config == TrialSpec.model_config  # strict, frozen, no extra keys
    # every other field of a trial is set per arm, per grid point or by another section
    assert set(TRIAL) - set(FIXED_FIELDS) == {
        "arch", "arch_options", "parameterization", "alpha", "width", "depth", "lr",
        "sigma_base", "batch_size", "budget", "schedule", "seed", "data", "num_threads"}


def test_sweep_sections_take_trial_spec_fields_and_bounds():
    _same_field(SweepBudget, "batch_size")
    for name in ("arch", "arch_options", "alpha"):
        _same_field(Arm, name)
    assert Arm.model_fields["parameterization"].metadata == TRIAL["parameterization"].metadata
    for name, trial_name in (("widths", "width"), ("depths", "depth"),
                             ("sigma_bases", "sigma_base"), ("seeds", "seed")):
        (item,) = typing.get_args(Grid.model_fields[name].annotation)
        _, bounds = typing.get_args(item)
        assert bounds.metadata == TRIAL[trial_name].metadata, name
    for name, trial_name in (("sigma_bases", "sigma_base"), ("seeds", "seed")):
        assert Grid.model_fields[name].default == [TRIAL[trial_name].default]
    for name in ("width", "depth"):  # required in a shape
        assert Shape.model_fields[name].metadata == TRIAL[name].metadata, name
    tokens = Budget.model_fields["tokens_per_param"]
    for model in (LadderShape, AspectRatioStage):
        assert model.model_fields["tokens_per_param"].annotation == tokens.annotation


def test_trial_spec_defaults_are_the_models():
    model = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    for name in ("arch", "width", "depth", "head_dim"):
        assert TRIAL[name].default == model[name], name
    base = {f.name: f.default for f in dataclasses.fields(Parameterization)}
    for name, trial_name in (("name", "parameterization"), ("alpha", "alpha"),
                             ("base_width", "base_width"), ("base_depth", "base_depth"),
                             ("lr", "lr"), ("sigma", "sigma_base"),
                             ("weight_decay", "weight_decay"), ("eps", "eps")):
        assert TRIAL[trial_name].default == base[name], trial_name


def test_a_bound_checks_the_same_in_the_grid_and_in_a_trial():
    for name, value in (("width", 1 << 17), ("depth", 1025), ("seed", -1)):
        with pytest.raises(ValidationError) as trial_error:
            TrialSpec.model_validate({name: value})
        with pytest.raises(ValidationError) as grid_error:
            Grid.model_validate({"widths": [64], "depths": [2], "lrs": [0.01],
                                 f"{name}s": [value]})
        assert trial_error.value.errors()[0]["msg"] == grid_error.value.errors()[0]["msg"]


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    package = "hptransfer.spec"
    for node in ast.walk(ast.parse(path.read_text())):  # function-local imports too
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            names.add(f"{base}.{node.module}" if base and node.module else
                      node.module or base)
    return names


def test_the_spec_never_imports_the_coordinator_or_anything_above_it():
    above = ("hptransfer.coordinator", "hptransfer.api", "hptransfer.store",
             "hptransfer.workers", "hptransfer.tracking", "hptransfer.cli", "hptransfer.client")
    for path in sorted((ROOT / "hptransfer" / "spec").glob("*.py")):
        bad = sorted(n for n in _imports(path) if n.startswith(above))
        assert not bad, f"{path.name} imports {bad}"
    code = ("import sys, hptransfer.spec, hptransfer.spec.cache; "
            "print(sorted(m for m in sys.modules if m.startswith('hptransfer.coordinator')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("path", [p for p in EXAMPLES
                                  if (yaml.safe_load(p.read_text()).get("search") or {})
                                  .get("method", "grid") == "grid"], ids=lambda p: p.name)
def test_planned_trials_equal_fully_validated_ones(path: Path):
    spec = load_spec(path)
    raw = yaml.safe_load(path.read_text())
    raw["grid"]["seeds"] = [0, 7]  # every trial but a shape's first is copied, not validated
    raw["grid"]["sigma_bases"] = [0.02, 0.05]
    raw.pop("stages", None)  # a study's grid is one shape; widen it
    raw["grid"]["widths"] = sorted({*spec.grid.widths, 2 * spec.fixed.head_dim})
    spec = load_spec(raw)
    planned = plan_sweep(spec)
    assert len(planned) == spec.trial_count() > len(spec.arms) * 2
    for p in planned:
        full = TrialSpec.model_validate(p.trial.model_dump())
        assert p.trial == full and p.trial.model_dump_json() == full.model_dump_json()
        assert p.content_hash == full.content_hash()
        assert (p.trial.lr, p.trial.sigma_base, p.trial.seed) == (p.lr, p.sigma_base, p.seed)


def test_a_log_range_ends_at_log2_max_not_past_it():
    """count()'s tolerance keeps log2_max when the steps land just short of it; the value is
    log2_max itself, not a hair past it: 2**(10 + 5e-10) once passed the sweep's check and
    failed planning against the trial's bound (LR <= 1024), a 500 at submit."""
    raw = yaml.safe_load((ROOT / "examples" / "cpu_small.yaml").read_text())
    raw["grid"]["lrs"] = {"log2_min": 7 + 5e-10, "log2_max": 10, "step": 1}
    spec = load_spec(raw)
    assert spec.grid.lr_values()[-1] == 1024.0
    assert max(p.lr for p in plan_sweep(spec)) == 1024.0


def test_planning_validates_every_lr_of_the_grid(monkeypatch):
    # the sweep's own check builds only each shape's first trial; an LR past the trial's bound
    # later in the grid is refused by planning, not stored
    spec = load_spec(yaml.safe_load((ROOT / "examples" / "cpu_small.yaml").read_text()))
    monkeypatch.setattr(type(spec.grid), "lr_values", lambda self: [2.0**-8, 2048.0])
    with pytest.raises(ValidationError, match="less than or equal to 1024"):
        plan_sweep(spec)


def test_spec_cache_put_keeps_a_validated_spec_without_reading_it_again():
    spec = load_spec(EXAMPLES[0])
    cache = SpecCache(size=1)
    cache.put("a", spec)
    assert cache.get("a", {"not": "read again"}) is spec
    cache.put("b", spec)  # the oldest goes
    assert len(cache) == 1
    with pytest.raises(ValidationError):
        cache.get("a", {"name": "x"})
