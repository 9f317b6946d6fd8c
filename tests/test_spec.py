"""SweepSpec validation, loading, and planning into TrialSpecs."""

from __future__ import annotations

import copy
import json
import math
import random
from pathlib import Path

import pytest
import yaml

from hptransfer.coordinator.plan import (
    PlannedTrial,
    ShapeKey,
    plan_shapes,
    plan_sweep,
    spec_hash,
    trial_for,
)
from hptransfer.models import ModelConfig
from hptransfer.models.flops import param_counts
from hptransfer.spec import Fixed, SpecError, SweepSpec, load_spec
from hptransfer.spec.trial import TrialSpec

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def base() -> dict:
    return {
        "name": "unit test",
        "arms": [
            {"arch": "gpt", "parameterization": "sp"},
            {"arch": "gpt", "parameterization": "completep"},
        ],
        "grid": {"widths": [64, 128], "depths": [2, 4], "lrs": [0.01, 0.001]},
        "fixed": {"head_dim": 32, "base_width": 64},
        "budget": {"steps": 10, "batch_size": 4},
    }


def with_(path: str, value, spec: dict | None = None) -> dict:
    """A copy of `spec` (default: base()) with the dotted `path` set to `value`."""
    d = copy.deepcopy(spec or base())
    node = d
    keys = path.split(".")
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    node[int(keys[-1]) if isinstance(node, list) else keys[-1]] = value
    return d


def errors_of(source, **kwargs) -> list[dict]:
    with pytest.raises(SpecError) as info:
        load_spec(source, **kwargs)
    return info.value.errors


def one_error(source, field: str, *words: str, **kwargs) -> dict:
    """Exactly one error, on `field`, whose message contains every word."""
    errs = errors_of(source, **kwargs)
    assert [e["field"] for e in errs] == [field], errs
    for word in words:
        assert word in errs[0]["message"], errs[0]
    return errs[0]


# ---- field validation ---------------------------------------------------------------


def test_base_spec_is_valid_and_fills_defaults():
    spec = load_spec(base())
    assert [a.label for a in spec.arms] == ["gpt/sp", "gpt/completep"]
    assert spec.grid.seeds == [0] and spec.grid.sigma_bases == [0.02]
    assert spec.search.method == "grid" and spec.max_concurrent == 2 and spec.retries == 2
    assert spec.reuse is True and spec.tags == {}
    assert spec.fixed.seq_len == 128 and spec.fixed.eps == 1e-12


@pytest.mark.parametrize(
    "path, field, word",
    [
        ("colour", "colour", "unknown field 'colour'"),
        ("grid.lr", "grid.lr", "did you mean 'lrs'"),
        ("arms.0.arch_options.x0_mixin", "arms[0].arch_options.x0_mixin", "'x0_mixing'"),
        ("fixed.headdim", "fixed.headdim", "did you mean 'head_dim'"),
        ("budget.token", "budget.token", "unknown field"),
        ("data.sorce", "data.sorce", "did you mean 'source'"),
        ("search.trials", "search.trials", "unknown field"),
    ],
)
def test_unknown_fields_are_named(path, field, word):
    one_error(with_(path, 1), field, word)


@pytest.mark.parametrize(
    "path, field",
    [
        ("grid.widths", "grid.widths"),
        ("grid.depths", "grid.depths"),
        ("grid.lrs", "grid.lrs"),
        ("grid.seeds", "grid.seeds"),
        ("grid.sigma_bases", "grid.sigma_bases"),
        ("arms", "arms"),
    ],
)
def test_empty_lists(path, field):
    one_error(with_(path, []), field, "must not be empty")


@pytest.mark.parametrize(
    "path, value, field",
    [
        ("grid.widths", [64, -64], "grid.widths[1]"),
        ("grid.depths", [2, 0], "grid.depths[1]"),
        ("grid.lrs", [0.01, 0.0], "grid.lrs[1]"),
        ("grid.lrs", [-1e-3], "grid.lrs[0]"),
        ("grid.sigma_bases", [0.0], "grid.sigma_bases[0]"),
        ("budget.batch_size", 0, "budget.batch_size"),
        ("fixed.head_dim", -32, "fixed.head_dim"),
        ("fixed.seq_len", 0, "fixed.seq_len"),
        ("resources.cpus", 0, "resources.cpus"),
        ("max_concurrent", 0, "max_concurrent"),
    ],
)
def test_non_positive_sizes_and_lrs(path, value, field):
    err = one_error(with_(path, value), field, "greater than")
    assert "got" in err["message"]


def test_negative_seed_and_gpus():
    one_error(with_("grid.seeds", [0, -1]), "grid.seeds[1]", "greater than or equal to 0")
    one_error(with_("resources.gpus", -0.5), "resources.gpus", "greater than or equal to 0")


# Each bound of a submitted field: the value at it is accepted, one just past it is refused
# with one error that names the field. (path, accepted value, refused value, field)
_RULE = {"stages": ["tune"], "workers": 2}
FIELD_BOUNDS = [
    ("analysis.eta_ci_log2", 8.0, 8.01, "analysis.eta_ci_log2"),
    ("grid.lrs", {"log2_min": -7.0, "log2_max": -7.0, "step": 1.0},
     {"log2_min": -6.0, "log2_max": -7.0, "step": 1.0}, "grid.lrs"),
    ("grid.lrs", {"log2_min": -10.0, "log2_max": -0.01, "step": 0.01},  # 1000 LRs
     {"log2_min": -10.0, "log2_max": 0.0, "step": 0.01}, "grid.lrs"),  # 1001
    ("grid.seeds", list(range(64)), list(range(65)), "grid.seeds"),
    ("grid.seeds", [2**31 - 1], [2**31], "grid.seeds[0]"),
    ("budget.batch_exponent", 4.0, 4.01, "budget.batch_exponent"),
    ("budget.batch_exponent", -4.0, -4.01, "budget.batch_exponent"),
    ("search.n_trials", 10_000, 10_001, "search.n_trials"),
    ("search.n_startup", 2, 1, "search.n_startup"),
    ("search.prune_after", 1.0, 1.01, "search.prune_after"),
    ("search.keep_top", 1, 0, "search.keep_top"),
    ("resources.gpus", 1e-4, 9e-5, "resources.gpus"),
    ("resources", {"workers": 2, "shard": True}, {"workers": 1, "shard": True},
     "resources.shard"),
    ("resources.workers", 512, 513, "resources.workers"),
    ("resources.pack", 1, 0, "resources.pack"),
    ("resources.pack", 64, 65, "resources.pack"),
    ("resources.pack", 1, True, "resources.pack"),
    ("resources.scale_out", [_RULE] * 8, [_RULE] * 9, "resources.scale_out"),
    ("resources.scale_out", [{"min_params": 1e15, "workers": 2}],
     [{"min_params": 1.01e15, "workers": 2}], "resources.scale_out[0].min_params"),
    ("resources.scale_out", [_RULE], [{"workers": 2}], "resources.scale_out[0]"),
    ("checkpoint.every_steps", 1, 0, "checkpoint.every_steps"),
    ("checkpoint.every_minutes", 0.001, 0.0, "checkpoint.every_minutes"),
    ("checkpoint.max_sweep_gb", 1e6, 1.01e6, "checkpoint.max_sweep_gb"),
    ("arms.0.label", "a" * 100, "a" * 101, "arms[0].label"),
    ("arms.0.label", "a~", "a\x7f", "arms[0].label"),
    ("arms.0.label", "a-b", "a>b", "arms[0].label"),
    ("tags", {"k": "v" * 1024}, {"k": "v" * 1025}, "tags.k"),
    ("fixed.seq_len", 2, 1, "fixed.seq_len"),
    ("fixed.beta1", 0.999, 1.0, "fixed.beta1"),
    ("fixed.divergence_factor", 1.001, 1.0, "fixed.divergence_factor"),
    ("schedule.warmup_fraction", 0.99, 1.0, "schedule.warmup_fraction"),
    ("schedule.wsd_decay_fraction", 0.001, 0.0, "schedule.wsd_decay_fraction"),
    ("fixed.eval_every", 1, 0, "fixed.eval_every"),
    ("retries", 100, 101, "retries"),
    ("tags", {f"k{i}": "v" for i in range(64)}, {f"k{i}": "v" for i in range(65)}, "tags"),
    ("tags", {"xmlflow.run": "v"}, {"MLflow.runName": "v"}, "tags.MLflow.runName"),
    ("search", {"method": "optuna", "n_trials": 4, "n_startup": 4},
     {"method": "optuna", "n_trials": 4, "n_startup": 5}, "search.n_startup"),
    ("budget", {"steps": 10, "batch_size": 2**20, "batch_rule": "scale_with_params",
                "batch_exponent": 0.0},
     {"steps": 10, "batch_size": 2**20, "batch_rule": "scale_with_params",
      "batch_exponent": 0.5}, "budget.batch_exponent"),
    ("arms.0.arch_options", {"mlp_ratio": 1}, {"mlp_ratio": 0}, "arms[0].arch_options.mlp_ratio"),
    ("budget", {"tokens": 10**15, "batch_size": 4}, {"tokens": 10**15 + 1, "batch_size": 4},
     "budget.tokens"),
]


@pytest.mark.parametrize("path, ok, bad, field", FIELD_BOUNDS,
                         ids=[f"{p}={b!r:.20}" for p, _, b, _ in FIELD_BOUNDS])
def test_each_bound_accepts_its_value_and_refuses_one_past_it_naming_the_field(
        path: str, ok, bad, field: str) -> None:
    """A value at a field's bound is accepted as given; one just past it is refused with one
    error naming that field."""
    assert load_spec(with_(path, ok), max_trials=10**6).model_dump()  # no SpecError
    one_error(with_(path, bad), field, max_trials=10**6)


def test_more_arms_than_the_cap_are_refused_as_one_error_on_arms() -> None:
    """65 arms: one error on `arms` naming the cap of 64 (not 65 per-arm complaints)."""
    one_error(with_("arms", [{"arch": "gpt", "parameterization": "sp"}] * 65), "arms", "64")


def test_val_tokens_must_hold_one_window_of_seq_len():
    """Refused at submit: accepted, every trial trained to its budget and then failed at its
    first evaluation. The trial spec refuses it the same way (`hpt train`)."""
    d = with_("data", {"source": "stdlib", "val_tokens": 128}, with_("fixed.seq_len", 128))
    one_error(d, "data.val_tokens", "val_tokens=128 is too small for one window of "
              "seq_len+1=129; raise val_tokens or lower seq_len")
    ok = with_("data", {"source": "stdlib", "val_tokens": 129}, with_("fixed.seq_len", 128))
    assert load_spec(ok).data.val_tokens == 129
    with pytest.raises(ValueError, match="too small for one window of seq_len"):
        TrialSpec(seq_len=128, data={"val_tokens": 128})
    assert TrialSpec(seq_len=128, data={"val_tokens": 129}).seq_len == 128


def test_resources_below_ray_s_smallest_fraction():
    """Ray refuses a positive CPU or GPU amount under 1e-4: refused at submit, where it
    names the field (accepted, it had failed the dispatcher's every tick for every sweep)."""
    for cpus in (1e-5, 5e-324):
        one_error(with_("resources.cpus", cpus), "resources.cpus",
                  "greater than or equal to 0.0001")
    one_error(with_("resources.gpus", 1e-5), "resources.gpus",
              "give 0 or at least 0.0001 GPU per task")
    assert load_spec(with_("resources.cpus", 1e-4)).resources.cpus == 1e-4
    assert load_spec(with_("resources.gpus", 1e-4)).resources.gpus == 1e-4


def test_nan_lr_is_rejected():
    one_error(with_("grid.lrs", [float("nan")]), "grid.lrs[0]", "finite")


@pytest.mark.parametrize("key", ["seeds", "widths", "lrs", "sigma_bases"])
def test_repeated_grid_values(key):
    values = {"seeds": [0, 1, 0], "widths": [64, 64], "lrs": [0.01, 0.01],
              "sigma_bases": [0.02, 0.02]}[key]
    one_error(with_(f"grid.{key}", values), f"grid.{key}", "more than once")


def test_width_not_divisible_by_head_dim():
    d = with_("fixed.head_dim", 64, with_("grid.widths", [64, 100, 128]))
    err = one_error(d, "grid.widths[1]")
    assert err["message"] == "100 is not divisible by fixed.head_dim=64; use multiples of 64"


def test_invalid_pairing_names_the_arm():
    d = with_("arms.1", {"arch": "ngpt", "parameterization": "completep"})
    one_error(d, "arms[1].parameterization", "arch 'ngpt' cannot use",
              "use parameterization 'ngpt'")
    d = with_("arms.0", {"arch": "gpt", "parameterization": "ngpt"})
    one_error(d, "arms[0].parameterization", "only for arch 'ngpt'")


def test_unknown_parameterization_suggests():
    one_error(with_("arms.0.parameterization", "complete_p"), "arms[0].parameterization",
              "did you mean 'completep'")


@pytest.mark.parametrize("alpha", [0.3, 1.2])
def test_alpha_outside_range(alpha):
    d = with_("arms.0", {"parameterization": "depth_alpha", "alpha": alpha})
    one_error(d, "arms[0].alpha", "[0.5, 1]", f"got {alpha:g}")


def test_alpha_missing_or_misplaced():
    one_error(with_("arms.0", {"parameterization": "depth_alpha"}), "arms[0].alpha", "needs")
    one_error(with_("arms.0", {"parameterization": "mup", "alpha": 0.75}), "arms[0].alpha",
              "only set with parameterization 'depth_alpha'")


def test_arch_option_conflicts():
    d = with_("arms.0", {"arch": "ngpt", "parameterization": "ngpt",
                         "arch_options": {"x0_mixing": True}})
    one_error(d, "arms[0].arch_options", "gpt options")
    d = with_("arms.0.arch_options", {"extra_embeddings": 2})
    one_error(d, "arms[0].arch_options", "needs x0_mixing")


def test_per_shape_failure_is_reported_once_per_cause():
    d = with_("arms.0.arch_options", {"value_embeddings": 2})
    err = one_error(d, "arms[0]", "cannot be built", "width 64, depth 2", "width 128, depth 2",
                    "value_embeddings (2) cannot exceed half the depth, rounded up (1 at "
                    "depth 2)")
    assert "depth 4" not in err["message"]


def test_labels_unique_and_arms_distinct():
    d = with_("arms.1", {"label": "gpt/sp", "parameterization": "mup"})
    one_error(d, "arms[1].label", "already used by arms[0]")
    d = with_("arms.1", {"label": "again", "parameterization": "sp"})
    one_error(d, "arms[1]", "same arch, options and parameterization as arms[0]")


def test_log_range_min_above_max():
    d = with_("grid.lrs", {"log2_min": -4, "log2_max": -12, "step": 1})
    one_error(d, "grid.lrs", "log2_min (-4) is greater than log2_max (-12)")
    d = with_("grid.lrs", {"log2_min": -10, "log2_max": -10.0000001, "step": 1})
    one_error(d, "grid.lrs", "log2_min (-10) is greater than log2_max (-10.0000001)")
    one_error(with_("grid.lrs", {"log2_min": -4, "log2_max": -2, "step": 0}), "grid.lrs.step")
    # a step too small to count with (it once overflowed into a 500): a bound, named
    err = one_error(with_("grid.lrs", {"log2_min": -10, "log2_max": 10, "step": 5e-324}),
                    "grid.lrs.step", "greater than or equal to 0.001")
    assert len(err["message"]) < 200
    one_error(with_("grid.lrs", {"log2_min": -4, "log2_max": -2, "step": 1, "x": 1}),
              "grid.lrs.x", "unknown field")
    one_error(with_("grid.lrs", 0.01), "grid.lrs", "list of learning rates or a log range")


def test_budget_needs_exactly_one():
    one_error(with_("budget", {"batch_size": 8}), "budget", "exactly one", "none")
    one_error(with_("budget", {"steps": 5, "tokens": 1000}), "budget", "exactly one")
    one_error(with_("budget.batch_rule", "sqrt"), "budget.batch_rule", "'fixed'")


def test_missing_required_fields():
    d = base()
    del d["grid"]
    one_error(d, "grid", "required")
    one_error(with_("arms.0", {"arch": "gpt"}), "arms[0].parameterization", "required")


def test_name_rules():
    one_error(with_("name", "bad/name!"), "name", "letters, digits")
    one_error(with_("name", ""), "name")
    one_error(with_("name", "x" * 101), "name")
    assert load_spec(with_("name", "ok name-1.2_b")).name == "ok name-1.2_b"
    one_error(with_("name", "  "), "name", "the name is blank")
    one_error(with_("name", "мир"), "name", "only ASCII letters", "found")


@pytest.mark.parametrize("label", ["a\x1b[2Jb\r\n", "\u202eevil", "tab\there", " ", "x "])
def test_arm_labels_are_printable_and_not_blank(label):
    """Labels reach terminals (`hpt fits`), pages and MLflow: an escape sequence in one
    cleared the screen of whoever listed the fits."""
    arms = [{"label": label, "arch": "gpt", "parameterization": "sp"}]
    err = one_error(with_("arms", arms), "arms[0].label")
    expected = ("blank" if not label.strip() else "starts or ends with a space"
                if label.isprintable() else "only printable ASCII")
    assert expected in err["message"], err
    assert "\x1b" not in err["message"] and "\u202e" not in err["message"]  # echoed escaped


def test_arm_labels_keep_punctuation_and_the_defaults():
    arms = [{"label": "SP [baseline] +x0=1/2", "arch": "gpt", "parameterization": "sp"},
            {"arch": "gpt", "parameterization": "completep", "arch_options": {"x0_mixing": True}}]
    spec = load_spec(with_("arms", arms))
    assert [a.name for a in spec.arms][0] == "SP [baseline] +x0=1/2"
    assert spec.arms[1].name.startswith("gpt/completep+")


def test_optuna_needs_n_trials_and_a_range():
    d = with_("search", {"method": "optuna"})
    one_error(d, "search.n_trials", ">= 2")
    one_error(with_("search.n_trials", 1, d), "search.n_trials", ">= 2")
    d = with_("grid.lrs", [0.01], with_("search.n_trials", 4, d))
    one_error(d, "grid.lrs", "two different values")


def test_cuda_device_needs_gpus():
    one_error(with_("fixed.device", "cuda"), "fixed.device", "resources.gpus")
    spec = load_spec(with_("resources", {"gpus": 0.25}, with_("fixed.device", "cuda")))
    assert spec.resources.gpus == 0.25


def test_trial_cap(monkeypatch):
    d = with_("grid.seeds", list(range(10)))  # 2 arms x 2 x 2 x 2 lrs x 10 seeds = 160
    err = one_error(d, "grid", max_trials=100)
    assert err["message"] == (
        "grid has 160 trials, more than the cap of 100; shrink the grid or raise HPT_MAX_TRIALS"
    )
    assert load_spec(d, max_trials=160).trial_count() == 160
    monkeypatch.setenv("HPT_MAX_TRIALS", "150")
    one_error(d, "grid", "cap of 150")
    monkeypatch.setenv("HPT_MAX_TRIALS", "many")
    one_error(d, "", "HPT_MAX_TRIALS must be an integer")
    monkeypatch.delenv("HPT_MAX_TRIALS")
    load_spec(d)  # default cap 5000
    # re-reading a stored spec (no context) does not re-apply the submission cap
    monkeypatch.setenv("HPT_MAX_TRIALS", "10")
    stored = load_spec(d, max_trials=1000).model_dump(mode="json")
    assert SweepSpec.model_validate(stored).trial_count() == 160


def test_optuna_cap_counts_n_trials():
    d = with_("search", {"method": "optuna", "n_trials": 30})  # 2 x 2 x 2 x 1 x 1 x 30
    one_error(d, "grid", "grid has 240 trials", max_trials=200)


def test_spec_error_lists_every_problem():
    d = with_("grid.widths", [64, 100], with_("grid.depths", [0]))
    d["oops"] = True
    with pytest.raises(SpecError) as info:
        load_spec(d)
    lines = str(info.value).splitlines()
    assert len(lines) == len(info.value.errors) == 2
    assert lines[0].startswith("grid.depths[0]: ") and lines[1].startswith("oops: ")
    assert isinstance(info.value, ValueError)


def test_fixed_fields_are_trial_fields():
    # plan passes Fixed straight into TrialSpec; a new Fixed field must exist there too
    assert set(Fixed.model_fields) <= set(TrialSpec.model_fields)
    for name, field in Fixed.model_fields.items():
        assert field.default == TrialSpec.model_fields[name].default, name


def test_tags_are_text():
    spec = load_spec(with_("tags", {"version": 2, "owner": "me"}))
    assert spec.tags == {"version": "2", "owner": "me"}


# ---- LR ranges ----------------------------------------------------------------------


def test_log_range_is_exact_powers_of_two():
    spec = load_spec(with_("grid.lrs", {"log2_min": -12, "log2_max": -4, "step": 1}))
    assert spec.grid.lr_values() == [2.0**k for k in range(-12, -3)]
    spec = load_spec(with_("grid.lrs", {"log2_min": -10, "log2_max": -4, "step": 2}))
    assert spec.grid.lr_values() == [2.0**-10, 2.0**-8, 2.0**-6, 2.0**-4]


def test_log_range_keeps_max_within_tolerance():
    spec = load_spec(with_("grid.lrs", {"log2_min": -1, "log2_max": 0, "step": 0.1}))
    values = spec.grid.lr_values()
    assert len(values) == 11 and values[-1] == 1.0 and values[0] == 0.5
    # a max that the step does not reach is not overshot
    spec = load_spec(with_("grid.lrs", {"log2_min": -10, "log2_max": -5, "step": 2}))
    assert spec.grid.lr_values() == [2.0**-10, 2.0**-8, 2.0**-6]


def test_log_range_too_many_values():
    one_error(with_("grid.lrs", {"log2_min": -20, "log2_max": 0, "step": 1e-3}), "grid.lrs",
              "larger step")


# ---- planning -----------------------------------------------------------------------


def test_plan_size_and_order():
    d = with_("grid.seeds", [0, 1], with_("grid.sigma_bases", [0.02, 0.04]))
    spec = load_spec(d)
    plan = plan_sweep(spec)
    assert len(plan) == spec.trial_count() == 2 * 2 * 2 * 2 * 2 * 2
    keys = [(p.arm, p.depth, p.width, p.sigma_base, p.lr, p.seed) for p in plan]
    expected = [
        (arm, depth, width, sigma, lr, seed)
        for arm in ("gpt/sp", "gpt/completep")
        for depth in (2, 4)
        for width in (64, 128)
        for sigma in (0.02, 0.04)
        for lr in (0.01, 0.001)
        for seed in (0, 1)
    ]
    assert keys == expected
    assert len({p.content_hash for p in plan}) == len(plan)


def test_planned_trial_fields_come_from_the_spec():
    d = base()
    d["fixed"].update(weight_decay=0.1, beta2=0.99, seq_len=64, eval_every=5, device="cpu")
    d["schedule"] = {"decay": "cosine", "warmup_fraction": 0.2}
    d["data"] = {"val_tokens": 4096}
    d["arms"][1] = {"parameterization": "depth_alpha", "alpha": 0.75,
                    "arch_options": {"x0_mixing": True, "extra_embeddings": 1}}
    spec = load_spec(d)
    p = plan_sweep(spec)[-1]
    assert isinstance(p, PlannedTrial) and p.content_hash == p.trial.content_hash()
    t = p.trial
    assert p.arm == "gpt/depth_alpha(0.75)+x0_mixing+extra_embeddings=1"
    assert (t.parameterization, t.alpha) == ("depth_alpha", 0.75)
    assert t.arch_options.extra_embeddings == 1
    assert (t.width, t.depth, t.lr, t.seed, t.sigma_base) == (128, 4, 0.001, 0, 0.02)
    assert (t.head_dim, t.base_width, t.base_depth) == (32, 64, 2)
    assert (t.weight_decay, t.beta2, t.seq_len, t.eval_every, t.device) == (0.1, 0.99, 64, 5, "cpu")
    assert t.schedule.decay == "cosine" and t.data.val_tokens == 4096
    assert t.budget.model_dump() == {"tokens": None, "steps": 10, "tokens_per_param": None}
    assert t.batch_size == 4 and t.num_threads == 1


def test_hashes_are_deterministic_over_key_order():
    def shuffled(obj, rng):
        if isinstance(obj, dict):
            items = list(obj.items())
            rng.shuffle(items)
            return {k: shuffled(v, rng) for k, v in items}
        if isinstance(obj, list):
            return [shuffled(v, rng) for v in obj]
        return obj

    a = load_spec(base())
    b = load_spec(shuffled(base(), random.Random(7)))
    assert list(shuffled(base(), random.Random(7))) != list(base())  # really reordered
    assert spec_hash(a) == spec_hash(b) == spec_hash(load_spec(base()))
    assert [p.content_hash for p in plan_sweep(a)] == [p.content_hash for p in plan_sweep(b)]

    c = load_spec(with_("grid.lrs", [0.01, 0.002]))
    assert spec_hash(c) != spec_hash(a)
    ha, hc = [p.content_hash for p in plan_sweep(a)], [p.content_hash for p in plan_sweep(c)]
    changed = [x != y for x, y in zip(ha, hc, strict=True)]
    # only the trials at the changed LR differ (lr is the second-fastest axis, 1 seed)
    assert changed == [False, True] * (len(ha) // 2)


def test_hash_ignores_thread_count_but_not_batch():
    a = load_spec(base())
    more_cpus = load_spec(with_("resources.cpus", 2))
    assert plan_sweep(more_cpus)[0].trial.num_threads == 2
    assert plan_sweep(a)[0].content_hash == plan_sweep(more_cpus)[0].content_hash
    bigger = load_spec(with_("budget.batch_size", 8))
    assert plan_sweep(a)[0].content_hash != plan_sweep(bigger)[0].content_hash


def test_batch_scaling_rule():
    d = with_("budget", {"steps": 10, "batch_size": 16, "batch_rule": "scale_with_params",
                         "batch_exponent": 0.5})
    spec = load_spec(d)

    def non_emb(width, depth, head_dim):
        cfg = ModelConfig(width=width, depth=depth, head_dim=head_dim, max_seq_len=128)
        return param_counts(cfg).non_embedding

    p_base = non_emb(64, 2, 32)
    for p in plan_sweep(spec):
        ratio = non_emb(p.width, p.depth, 32) / p_base
        assert p.trial.batch_size == max(1, round(16 * ratio**0.5))
    sizes = {(p.width, p.depth): p.trial.batch_size for p in plan_sweep(spec)}
    assert sizes[(64, 2)] == 16  # the base shape keeps the base batch
    assert sizes[(128, 4)] > sizes[(128, 2)] > sizes[(64, 2)]
    # roughly sqrt(4 * 2) = 2.8x the base at twice the width and depth
    assert math.isclose(sizes[(128, 4)] / 16, 8**0.5, rel_tol=0.1)
    fixed = load_spec(base())
    assert {p.trial.batch_size for p in plan_sweep(fixed)} == {4}


@pytest.mark.parametrize("arch", ["gpt", "ngpt"])
@pytest.mark.parametrize("base_width", [64, 65])
def test_batch_scaling_counts_a_base_shape_of_any_width(base_width, arch):
    # the base shape is only counted, never built: its width need not be a multiple of
    # head_dim, nor even (a model with RoPE needs even heads, a count does not)
    d = with_("fixed.base_width", base_width,
              with_("budget", {"steps": 10, "batch_size": 16, "batch_rule": "scale_with_params",
                               "batch_exponent": 1.0}))
    d["arms"] = [{"arch": arch, "parameterization": "ngpt" if arch == "ngpt" else "sp"}]
    spec = load_spec(d)

    def count(width, depth, head_dim):
        return param_counts(ModelConfig(arch=arch, width=width, depth=depth, head_dim=head_dim,
                                        max_seq_len=128)).non_embedding

    base = count(base_width, 2, 1)
    for p in plan_sweep(spec):
        ratio = count(p.width, p.depth, 32) / base
        assert p.trial.batch_size == max(1, round(16 * ratio)), (p.width, p.depth)


def test_batch_scaling_exponent_zero_and_small_batches():
    d = with_("budget", {"steps": 10, "batch_size": 1, "batch_rule": "scale_with_params",
                         "batch_exponent": -1.0})
    assert {p.trial.batch_size for p in plan_sweep(load_spec(d))} == {1}  # never below 1


def test_a_batch_scaled_out_of_bounds_names_the_exponent():
    # 128x4 has ~8x the base's (64x2) parameters: 1024 x 8^4 ~ 4.2M sequences, over 2^20
    d = with_("budget", {"steps": 10, "batch_size": 1024, "batch_rule": "scale_with_params",
                         "batch_exponent": 4.0})
    one_error(d, "budget.batch_exponent", "width 128, depth 4", "lower batch_exponent")
    load_spec(with_("budget.batch_exponent", 3.0, d))  # 1024 x 8^3 ~ 0.5M: within


def test_optuna_shapes_and_trial_for():
    d = with_("search", {"method": "optuna", "n_trials": 3},
              with_("grid.lrs", {"log2_min": -12, "log2_max": -4, "step": 1}))
    spec = load_spec(d)
    assert spec.grid.lr_bounds() == (2.0**-12, 2.0**-4)
    shapes = plan_shapes(spec)
    assert len(shapes) == 2 * 2 * 2
    assert shapes[:3] == [ShapeKey("gpt/sp", 64, 2, 0.02, 0), ShapeKey("gpt/sp", 128, 2, 0.02, 0),
                          ShapeKey("gpt/sp", 64, 4, 0.02, 0)]
    p = trial_for(spec, shapes[1], 3e-3)
    assert (p.arm, p.width, p.depth, p.lr, p.trial.lr) == ("gpt/sp", 128, 2, 3e-3, 3e-3)
    assert p.content_hash == trial_for(spec, ShapeKey(*shapes[1]), 3e-3).content_hash
    with pytest.raises(ValueError, match="plan_shapes"):
        plan_sweep(spec)
    with pytest.raises(ValueError, match="not a shape"):
        trial_for(spec, ShapeKey("gpt/sp", 256, 2, 0.02, 0), 1e-3)
    with pytest.raises(ValueError, match="not a shape"):
        trial_for(spec, ShapeKey("nope", 64, 2, 0.02, 0), 1e-3)
    with pytest.raises(ValueError, match="positive"):
        trial_for(spec, shapes[0], -1.0)


def test_trial_for_refuses_each_axis_outside_the_grid_and_names_it():
    d = with_("search", {"method": "optuna", "n_trials": 3},
              with_("grid.lrs", {"log2_min": -12, "log2_max": -4, "step": 1}))
    spec = load_spec(d)
    inside = ShapeKey("gpt/sp", 64, 2, 0.02, 0)
    assert trial_for(spec, inside, 1e-3).sigma_base == 0.02
    for axis, value in (("width", 96), ("depth", 3), ("sigma_base", 0.5), ("seed", 7)):
        with pytest.raises(ValueError, match=f"not a shape.*unknown {axis}"):
            trial_for(spec, inside._replace(**{axis: value}), 1e-3)


def test_the_spec_hash_ignores_the_order_of_free_form_keys():
    """Tags are a free-form mapping (their order is kept when the spec is read): a spec
    written with its tags in another order is the same sweep."""
    a = load_spec({**base(), "tags": {"team": "x", "paper": "completep"}})
    b = load_spec({**base(), "tags": {"paper": "completep", "team": "x"}})
    assert list(a.tags) != list(b.tags)  # really read in another order
    assert spec_hash(a) == spec_hash(b)
    assert spec_hash(a) != spec_hash(load_spec({**base(), "tags": {"team": "y",
                                                                  "paper": "completep"}}))


# ---- loading ------------------------------------------------------------------------


def test_load_from_yaml_json_dict_path_and_spec(tmp_path):
    expected = spec_hash(load_spec(base()))
    yaml_text = yaml.safe_dump(base())
    json_text = json.dumps(base(), indent=2)
    (tmp_path / "s.yaml").write_text(yaml_text)
    (tmp_path / "s.yml").write_text(yaml_text)
    (tmp_path / "s.json").write_text(json_text)
    sources = [
        yaml_text,
        json_text,
        tmp_path / "s.yaml",
        str(tmp_path / "s.yml"),
        str(tmp_path / "s.json"),
        load_spec(base()),
    ]
    for source in sources:
        spec = load_spec(source)
        assert isinstance(spec, SweepSpec) and spec_hash(spec) == expected, source


def test_yaml_scientific_notation_and_flow_style():
    text = """
name: flow
arms: [{arch: gpt, parameterization: sp}]
grid: {widths: [64], depths: [2], lrs: [1e-3, 3e-3]}
fixed: {head_dim: 32}
budget: {tokens_per_param: 2e1}
"""
    spec = load_spec(text)  # YAML 1.1 would read 1e-3 and 2e1 as strings
    assert spec.grid.lrs == [1e-3, 3e-3] and spec.budget.tokens_per_param == 20.0
    # 1e6 is a float: an integer field takes integers only (strict), and says how to write it
    one_error(text.replace("tokens_per_param: 2e1", "tokens: 1e6"), "budget.tokens",
              "must be an integer", "1000000")


def test_load_errors():
    err = one_error("name: x\narms: [\n  - a\n", "", "invalid YAML", "line 3")
    assert "column" in err["message"]
    one_error("name: x\nname: y\n", "", "duplicate key 'name'", "line 2")
    one_error('{"name": "x",, }', "", "invalid JSON", "line 1")
    one_error("does/not/exist.yaml", "", "file not found: does/not/exist.yaml")
    one_error(Path("/nonexistent/spec.json"), "", "file not found")
    one_error("- a\n- b\n", "", "must be a mapping")
    one_error(base(), "", "max_trials must be >= 1", max_trials=0)


def test_bad_yaml_file_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: x\ngrid:\n  widths: [64\n")
    one_error(path, "", str(path), "line")


def test_revalidating_a_spec_applies_a_new_cap():
    spec = load_spec(base())
    one_error(spec, "grid", "cap of 10", max_trials=10)


# ---- examples -----------------------------------------------------------------------


def test_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert {"cpu_small.yaml", "depth_transfer.yaml", "optuna_lr.yaml", "ngpt_vs_gpt.yaml",
            "x0_mixing.yaml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_load_and_plan(path):
    spec = load_spec(path)
    if spec.search.method == "grid":
        plan = plan_sweep(spec)
    else:
        low, high = spec.grid.lr_bounds()
        plan = [trial_for(spec, shape, math.sqrt(low * high)) for shape in plan_shapes(spec)]
        assert len(plan) * spec.search.n_trials == spec.trial_count()
    assert plan and all(isinstance(p.trial, TrialSpec) for p in plan)
    if spec.stages is not None:  # a study: its grid is the tune stage; later stages follow
        assert {p.stage for p in plan} == {"tune"} and len(plan) < spec.trial_count()
    elif spec.search.method == "grid":
        assert len(plan) == spec.trial_count()
        assert len({p.content_hash for p in plan}) == len(plan)
    # every shape it trains (a study's later stages too) fits one 80 GB accelerator or host
    from hptransfer.coordinator.admission import trial_costs

    largest = max(trial_costs(spec), key=lambda c: c.memory_bytes)
    assert largest.memory_bytes < 80e9, largest.describe()


def test_cpu_small_is_small():
    spec = load_spec(EXAMPLES[0].parent / "cpu_small.yaml")
    plan = plan_sweep(spec)
    assert [a.label for a in spec.arms] == ["gpt/sp", "gpt/completep"]
    assert len(plan) == 48 and spec.max_concurrent == 2
    assert spec.grid.lr_values() == [2.0**k for k in range(-10, -4)]
    t = plan[0].trial
    assert (t.head_dim, t.batch_size, t.seq_len, t.budget.steps) == (32, 8, 64, 150)
    assert t.data.source == "stdlib" and t.data.val_tokens <= 8192
    assert max(p.width for p in plan) <= 128 and max(p.depth for p in plan) <= 4


def test_x0_example_arms():
    spec = load_spec(EXAMPLES[0].parent / "x0_mixing.yaml")
    opts = [(a.arch_options.x0_mixing, a.arch_options.extra_embeddings) for a in spec.arms]
    assert opts == [(False, 0), (True, 1), (True, 2)]
    assert {a.parameterization for a in spec.arms} == {"completep"}


def test_spec_cache_validates_once_keeps_the_newest_and_caches_no_invalid_spec():
    from pydantic import ValidationError

    from hptransfer.spec.cache import SpecCache

    cache = SpecCache(size=2)
    first = cache.get("a", base())
    assert isinstance(first, SweepSpec)
    assert cache.get("a", {"not": "read again"}) is first  # cached: raw not re-validated
    cache.get("b", base())
    cache.get("a", base())  # a is now the most recent
    cache.get("c", base())  # evicts b, the least recently used
    assert len(cache) == 2
    with pytest.raises(ValidationError):
        cache.get("b", {"name": "x"})  # b was evicted, so this raw spec is validated
    assert len(cache) == 2  # and, invalid, not stored
    assert cache.get("a", {"not": "read again"}) is first


def test_arch_options_are_model_config_fields_with_its_defaults_and_choices():
    """ArchOptions (what an arm may set) is a validated view of ModelConfig: a field added or
    re-defaulted in one and not the other would silently build a different model."""
    import dataclasses
    import typing

    from hptransfer.models.config import ACTIVATIONS, POSITIONS
    from hptransfer.spec.trial import ArchOptions

    model_fields = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    for name, field in ArchOptions.model_fields.items():
        assert name in model_fields, f"ArchOptions.{name} is not a ModelConfig field"
        assert field.default == model_fields[name], name
    hints = typing.get_type_hints(ArchOptions)
    assert typing.get_args(hints["activation"]) == ACTIVATIONS
    assert typing.get_args(hints["position"]) == POSITIONS
