"""SweepSpec: what a user submits, validated up front with errors that say what to fix.

A sweep is a set of arms (architecture x parameterization) crossed with a grid of widths,
depths, learning rates, init scales and seeds, trained to one token budget. Everything a
trial needs is here; `hptransfer.sweeper.plan` expands a spec into `TrialSpec`s.

Validation happens in two passes. Pydantic checks types and ranges of every field; then
`SweepSpec`'s own check looks across fields (pairings, divisibility, the trial cap) and builds
one `TrialSpec` per (arm, width, depth), so that expanding a spec that passed can never fail.
`load_spec` turns both kinds of failure into one `SpecError` whose entries name a field path
such as ``grid.widths[2]``, and also applies the trial cap (a submission policy, so
re-reading a stored spec with `SweepSpec.model_validate` does not re-apply it).
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from hptransfer.models import ModelConfig, ModelConfigError, Parameterization
from hptransfer.models.flops import param_counts
from hptransfer.models.parameterization import PRESETS, ParameterizationError, check_pairing
from hptransfer.workers.trial import ArchOptions, Budget, DataSource, Schedule, TrialSpec

DEFAULT_MAX_TRIALS = 5000
MAX_TRIALS_ENV = "HPT_MAX_TRIALS"
_LOG_RANGE_MAX_VALUES = 1000  # a tiny step would otherwise expand into millions of LRs
_FLOAT_TOL = 1e-9
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.- ")
# Tags of the grid.lrs union; they appear in pydantic's error locations and are dropped there.
_LRS_LIST, _LRS_RANGE = "lr_list", "lr_log_range"


class SpecError(ValueError):
    """An invalid sweep spec; `.errors` is a list of {"field": path, "message": text}."""

    def __init__(self, errors: list[dict[str, str]]) -> None:
        self.errors = [{"field": e["field"], "message": e["message"]} for e in errors]
        super().__init__(str(self))

    def __str__(self) -> str:
        return "\n".join(
            f"{e['field']}: {e['message']}" if e["field"] else e["message"] for e in self.errors
        )


def _error(field: str, message: str) -> dict[str, str]:
    return {"field": field, "message": message}


def _unique(values: list[Any], what: str) -> list[Any]:
    seen: set[Any] = set()
    for v in values:
        if v in seen:
            raise ValueError(f"{what} {v!r} appears more than once; list each value once")
        seen.add(v)
    return values


def _fmt(x: float) -> str:
    return f"{x:g}"


PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class _Model(BaseModel):
    # Every spec model rejects unknown keys (a typo must not silently fall back to a default).
    model_config = ConfigDict(extra="forbid", frozen=True)


class LogRange(_Model):
    """Learning rates 2**k for k = log2_min, log2_min + step, ... up to log2_max inclusive."""

    # Bounded so 2**k stays a normal float (and far outside any sane LR anyway).
    log2_min: float = Field(ge=-100, le=100, allow_inf_nan=False)
    log2_max: float = Field(ge=-100, le=100, allow_inf_nan=False)
    step: float = Field(gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _ordered(self) -> LogRange:
        if self.log2_min > self.log2_max:
            raise ValueError(
                f"log2_min ({_fmt(self.log2_min)}) is greater than log2_max "
                f"({_fmt(self.log2_max)}); swap them"
            )
        if self.count() > _LOG_RANGE_MAX_VALUES:
            raise ValueError(
                f"step {_fmt(self.step)} gives {self.count()} learning rates, more than "
                f"{_LOG_RANGE_MAX_VALUES}; use a larger step"
            )
        return self

    def count(self) -> int:
        # The tolerance keeps log2_max itself when (max - min) / step lands just under an integer.
        return math.floor((self.log2_max - self.log2_min) / self.step + _FLOAT_TOL) + 1

    def values(self) -> list[float]:
        # Rounding the exponent makes 0.1-style steps give the same floats on every machine,
        # and integer exponents give exact powers of two.
        return [2.0 ** round(self.log2_min + i * self.step, 12) for i in range(self.count())]


def _lrs_kind(value: Any) -> str | None:
    if isinstance(value, (dict, LogRange)):
        return _LRS_RANGE
    if isinstance(value, (list, tuple)):
        return _LRS_LIST
    return None


LrGrid = Annotated[
    Annotated[list[PositiveFloat], Tag(_LRS_LIST), Field(min_length=1)]
    | Annotated[LogRange, Tag(_LRS_RANGE)],
    Discriminator(
        _lrs_kind,
        custom_error_type="lrs_type",
        custom_error_message=(
            "give a list of learning rates or a log range {log2_min, log2_max, step}"
        ),
    ),
]


class Grid(_Model):
    widths: list[PositiveInt] = Field(min_length=1)
    depths: list[PositiveInt] = Field(min_length=1)
    lrs: LrGrid
    sigma_bases: list[PositiveFloat] = Field([0.02], min_length=1)
    seeds: list[Annotated[int, Field(ge=0)]] = Field([0], min_length=1)

    @field_validator("widths", "depths", "sigma_bases", "seeds")
    @classmethod
    def _no_repeats(cls, values: list[Any], info: ValidationInfo) -> list[Any]:
        # A repeated value would plan the same trial twice.
        return _unique(values, str(info.field_name).removesuffix("s").removesuffix("_base"))

    @field_validator("lrs")
    @classmethod
    def _no_repeated_lrs(cls, value: list[float] | LogRange) -> list[float] | LogRange:
        if isinstance(value, list):
            _unique(value, "lr")
        return value

    def lr_values(self) -> list[float]:
        return self.lrs.values() if isinstance(self.lrs, LogRange) else list(self.lrs)

    def lr_bounds(self) -> tuple[float, float]:
        """(min, max) of the learning rates: the range an Optuna search samples from."""
        values = self.lr_values()
        return min(values), max(values)


class Fixed(_Model):
    """Trial settings shared by the whole sweep; every name is a `TrialSpec` field."""

    head_dim: int = Field(64, gt=0)
    base_width: int = Field(256, gt=0)
    base_depth: int = Field(2, gt=0)
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False)
    eps: float = Field(1e-12, gt=0, allow_inf_nan=False)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    grad_clip: float | None = Field(1.0, gt=0)
    precision: Literal["fp32", "bf16"] = "fp32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    divergence_factor: float = Field(2.0, gt=1)
    eval_every: int | None = Field(None, gt=0)
    seq_len: int = Field(128, gt=1)


class SweepBudget(Budget):
    """A trial `Budget` (exactly one of tokens, steps, tokens_per_param) plus batch sizing."""

    batch_size: int = Field(16, gt=0)
    batch_rule: Literal["fixed", "scale_with_params"] = "fixed"
    batch_exponent: float = Field(0.5, allow_inf_nan=False)

    def trial_budget(self) -> Budget:
        # A plain Budget, so batch settings never leak into a trial's content hash.
        return Budget(tokens=self.tokens, steps=self.steps, tokens_per_param=self.tokens_per_param)


class Search(_Model):
    method: Literal["grid", "optuna"] = "grid"
    sampler: Literal["tpe", "random", "qmc"] = "tpe"
    pruner: Literal["successive_halving", "median", "none"] = "successive_halving"
    n_trials: int | None = Field(None, gt=0)  # LRs tried per shape (optuna only)


class Resources(_Model):
    """Ray resources of one trial; fractions let several trials share a GPU."""

    cpus: float = Field(1.0, gt=0, allow_inf_nan=False)
    gpus: float = Field(0.0, ge=0, allow_inf_nan=False)


class Arm(_Model):
    """One contender: an architecture with its options, under one parameterization."""

    label: str | None = Field(None, min_length=1, max_length=100)
    arch: Literal["gpt", "ngpt"] = "gpt"
    arch_options: ArchOptions = ArchOptions()
    parameterization: str
    alpha: float | None = Field(None, allow_inf_nan=False)

    @model_validator(mode="after")
    def _check(self) -> Arm:
        problems = self._problems()
        if problems:
            raise SpecError(problems)  # fields are relative; load_spec prefixes "arms[i]."
        if self.label is None:
            # Frozen model: set the derived default once, before anyone can read it.
            object.__setattr__(self, "label", self.default_label())
        return self

    def _problems(self) -> list[dict[str, str]]:
        name = self.parameterization
        if name not in PRESETS:
            close = difflib.get_close_matches(name, PRESETS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            return [_error("parameterization", f"unknown parameterization {name!r}; {hint}"
                           f"use one of {', '.join(PRESETS)}")]
        if name == "depth_alpha" and self.alpha is None:
            return [_error("alpha", "parameterization 'depth_alpha' needs alpha in [0.5, 1] "
                           "(0.5 = depth-muP, 1 = CompleteP)")]
        if self.alpha is not None and not 0.5 <= self.alpha <= 1.0:
            return [_error("alpha", f"alpha must be in [0.5, 1] (0.5 = depth-muP, "
                           f"1 = CompleteP), got {_fmt(self.alpha)}")]
        try:
            p = Parameterization(name=name, alpha=self.alpha)
        except ParameterizationError as exc:  # e.g. alpha given with a non-alpha preset
            return [_error("alpha", str(exc))]
        problems = []
        try:
            check_pairing(ModelConfig(arch=self.arch), p)
        except ParameterizationError as exc:
            problems.append(_error("parameterization", str(exc)))
        try:
            # Deep enough that only arch/option conflicts show; depth limits are per shape.
            ModelConfig(arch=self.arch, depth=max(2, self.arch_options.value_embeddings),
                        **self.arch_options.model_dump())
        except ModelConfigError as exc:
            problems.append(_error("arch_options", str(exc)))
        return problems

    def param_label(self) -> str:
        if self.parameterization == "depth_alpha" and self.alpha is not None:
            return f"depth_alpha({self.alpha:g})"
        return self.parameterization

    def default_label(self) -> str:
        """`arch/parameterization`, plus `+option[=value]` for each non-default arch option."""
        label = f"{self.arch}/{self.param_label()}"
        defaults = ArchOptions().model_dump()
        for key, value in self.arch_options.model_dump().items():
            if value == defaults[key]:
                continue
            if isinstance(value, bool):
                label += f"+{key}" if value else f"+no_{key}"
            else:
                label += f"+{key}={value}"
        return label

    @property
    def name(self) -> str:
        """The label, always set after validation."""
        return self.label or self.default_label()


class SweepSpec(_Model):
    name: str = Field(min_length=1, max_length=100)
    description: str = ""
    arms: list[Arm] = Field(min_length=1)
    grid: Grid
    fixed: Fixed = Fixed()
    budget: SweepBudget
    data: DataSource = DataSource()
    schedule: Schedule = Schedule()
    search: Search = Search()
    resources: Resources = Resources()
    max_concurrent: int = Field(2, ge=1)
    retries: int = Field(2, ge=0)
    reuse: bool = True
    tags: dict[str, str] = {}

    @field_validator("name")
    @classmethod
    def _name_chars(cls, value: str) -> str:
        bad = sorted(set(value) - _NAME_CHARS)
        if bad or not value.strip():
            raise ValueError(
                f"{value!r} may contain only letters, digits, '_', '.', '-' and spaces"
                + (f" (found {''.join(bad)!r})" if bad else "")
            )
        return value

    @field_validator("tags", mode="before")
    @classmethod
    def _tags_as_text(cls, value: Any) -> Any:
        # YAML reads `version: 2` as an int; tags are labels, so keep them as text.
        if isinstance(value, dict):
            return {
                str(k): str(v) if isinstance(v, (int, float, bool)) else v
                for k, v in value.items()
            }
        return value

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> SweepSpec:
        # The trial cap is a submission policy, applied by load_spec (via the context); a
        # stored spec re-read with SweepSpec.model_validate must not fail if the cap changed.
        context = info.context if isinstance(info.context, dict) else {}
        cap = context.get("max_trials")
        problems = self._cross_field_problems()
        if not problems and cap is not None:
            problems = self._size_problems(cap)
        if not problems:
            problems = self._build_problems()
        if problems:
            raise SpecError(problems)
        return self

    # ---- validation across fields ------------------------------------------------------

    def _cross_field_problems(self) -> list[dict[str, str]]:
        problems = []
        head_dim = self.fixed.head_dim
        for i, width in enumerate(self.grid.widths):
            if width % head_dim:
                problems.append(_error(
                    f"grid.widths[{i}]",
                    f"{width} is not divisible by fixed.head_dim={head_dim}; "
                    f"use multiples of {head_dim}",
                ))
        labels: dict[str, int] = {}
        arms_seen: dict[str, int] = {}
        for i, arm in enumerate(self.arms):
            if arm.name in labels:
                problems.append(_error(
                    f"arms[{i}].label",
                    f"label {arm.name!r} is already used by arms[{labels[arm.name]}]; "
                    "give each arm a distinct label",
                ))
            labels.setdefault(arm.name, i)
            # Two arms that differ only by label would train identical trials.
            key = arm.model_dump_json(exclude={"label"})
            if key in arms_seen:
                problems.append(_error(
                    f"arms[{i}]",
                    f"same arch, options and parameterization as arms[{arms_seen[key]}]; "
                    "remove one",
                ))
            arms_seen.setdefault(key, i)
        if self.search.method == "optuna":
            n = self.search.n_trials
            if n is None or n < 2:
                problems.append(_error(
                    "search.n_trials",
                    f"optuna search needs n_trials >= 2 (learning rates tried per shape), "
                    f"got {n}",
                ))
            low, high = self.grid.lr_bounds()
            if not high > low:
                problems.append(_error(
                    "grid.lrs",
                    "optuna searches between the smallest and largest learning rate; "
                    "give at least two different values",
                ))
        if self.fixed.device == "cuda" and self.resources.gpus == 0:
            problems.append(_error(
                "fixed.device",
                "device 'cuda' but resources.gpus is 0, so Ray gives a trial no GPU; "
                "set resources.gpus (a fraction shares a GPU) or use device 'auto'",
            ))
        if self.budget.batch_rule == "scale_with_params":
            problems.extend(self._base_shape_problems())
        return problems

    def _base_shape_problems(self) -> list[dict[str, str]]:
        problems = []
        for i, arm in enumerate(self.arms):
            try:
                self._base_params(arm)
            except ModelConfigError as exc:
                problems.append(_error(
                    "budget.batch_rule",
                    f"scale_with_params counts parameters at the base shape "
                    f"(fixed.base_width={self.fixed.base_width}, "
                    f"fixed.base_depth={self.fixed.base_depth}), which arms[{i}] cannot "
                    f"build: {exc}",
                ))
        return problems

    def _size_problems(self, cap: int) -> list[dict[str, str]]:
        total = self.trial_count()
        if total <= cap:
            return []
        return [_error(
            "grid",
            f"grid has {total} trials, more than the cap of {cap}; "
            f"shrink the grid or raise {MAX_TRIALS_ENV}",
        )]

    def _build_problems(self) -> list[dict[str, str]]:
        # LR, sigma and seed only need to be positive (checked per field), so one TrialSpec
        # per (arm, width, depth) covers every way a planned trial could fail to build.
        problems = []
        lr = self.grid.lr_values()[0]
        sigma, seed = self.grid.sigma_bases[0], self.grid.seeds[0]
        for i, arm in enumerate(self.arms):
            failures: dict[str, list[str]] = {}  # cause -> shapes, so each cause is said once
            for depth in self.grid.depths:
                for width in self.grid.widths:
                    try:
                        self.trial_spec(arm, width, depth, lr, sigma, seed)
                    except ValueError as exc:
                        shape = f"width {width}, depth {depth}"
                        failures.setdefault(_plain_message(exc), []).append(shape)
            problems.extend(
                _error(f"arms[{i}]", f"arm {arm.name!r} cannot be built at "
                       f"{'; '.join(shapes)}: {cause}")
                for cause, shapes in failures.items()
            )
        return problems

    # ---- expansion helpers (used by plan.py) -------------------------------------------

    def trial_count(self) -> int:
        g = self.grid
        if self.search.method == "optuna":
            per_shape = self.search.n_trials or 0
        else:
            per_shape = len(g.lr_values())
        return (len(self.arms) * len(g.widths) * len(g.depths) * len(g.sigma_bases)
                * len(g.seeds) * per_shape)

    def arm(self, label: str) -> Arm:
        for arm in self.arms:
            if arm.name == label:
                return arm
        raise KeyError(f"no arm labelled {label!r}; arms: {[a.name for a in self.arms]}")

    def _vocab_size(self) -> int:
        # Only nGPT's logit scale has vocab-many non-embedding entries; this is close enough.
        if self.data.vocab_size:
            return self.data.vocab_size
        return self.data.bpe_vocab_size if self.data.tokenizer == "bpe" else 256

    def _non_embedding_params(self, arm: Arm, width: int, depth: int, head_dim: int) -> int:
        cfg = ModelConfig(
            arch=arm.arch, width=width, depth=depth, head_dim=head_dim,
            vocab_size=self._vocab_size(), max_seq_len=self.fixed.seq_len,
            **arm.arch_options.model_dump(),
        )
        return param_counts(cfg).non_embedding

    def _base_params(self, arm: Arm) -> int:
        # Parameter counts do not depend on head_dim, and the base width need not be a
        # multiple of it, so count the base shape with single-dimension heads.
        return self._non_embedding_params(arm, self.fixed.base_width, self.fixed.base_depth, 1)

    def batch_size_for(self, arm: Arm, width: int, depth: int) -> int:
        """budget.batch_size, or with scale_with_params: round(bs * (P / P_base) ** exponent)."""
        b = self.budget
        if b.batch_rule == "fixed":
            return b.batch_size
        ratio = (self._non_embedding_params(arm, width, depth, self.fixed.head_dim)
                 / self._base_params(arm))
        return max(1, round(b.batch_size * ratio**b.batch_exponent))

    def trial_spec(
        self, arm: Arm, width: int, depth: int, lr: float, sigma_base: float, seed: int
    ) -> TrialSpec:
        """The TrialSpec of one grid point (validated by TrialSpec itself)."""
        return TrialSpec(
            arch=arm.arch,
            arch_options=arm.arch_options,
            parameterization=arm.parameterization,
            alpha=arm.alpha,
            width=width,
            depth=depth,
            lr=lr,
            sigma_base=sigma_base,
            seed=seed,
            batch_size=self.batch_size_for(arm, width, depth),
            budget=self.budget.trial_budget(),
            schedule=self.schedule,
            data=self.data,
            # Only a thread count (not in the content hash): keep torch to the CPUs Ray gave.
            num_threads=max(1, int(self.resources.cpus)),
            **self.fixed.model_dump(),
        )


# ---- loading ---------------------------------------------------------------------------


def default_max_trials() -> int:
    """$HPT_MAX_TRIALS, else 5000."""
    raw = os.environ.get(MAX_TRIALS_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_MAX_TRIALS
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise SpecError([_error("", f"{MAX_TRIALS_ENV} must be a positive integer, got {raw!r}")])
    return value


def load_spec(
    source: SweepSpec | dict | str | os.PathLike, max_trials: int | None = None
) -> SweepSpec:
    """Validate a sweep from a SweepSpec, a dict, a .yaml/.yml/.json path, or YAML/JSON text.

    Raises SpecError listing every problem with its field path. `max_trials` caps the number
    of trials (default: $HPT_MAX_TRIALS, else 5000).
    """
    if max_trials is not None and max_trials < 1:
        raise SpecError([_error("", f"max_trials must be >= 1, got {max_trials}")])
    cap = max_trials or default_max_trials()
    if isinstance(source, SweepSpec):
        data: Any = source.model_dump()  # re-validated: the cap may differ from the first time
    elif isinstance(source, dict):
        data = source
    elif isinstance(source, os.PathLike) or (isinstance(source, str) and _looks_like_path(source)):
        data = _read_file(Path(source))
    elif isinstance(source, str):
        data = _parse_text(source, where="")
    else:
        raise SpecError([_error("", f"cannot load a sweep spec from {type(source).__name__}; "
                                "pass a dict, a file path, or YAML/JSON text")])
    if not isinstance(data, dict):
        raise SpecError([_error("", f"a sweep spec must be a mapping of fields, "
                                f"got {type(data).__name__}")])
    try:
        return SweepSpec.model_validate(data, context={"max_trials": cap})
    except ValidationError as exc:
        raise SpecError(_convert_errors(exc)) from None


def _looks_like_path(text: str) -> bool:
    if "\n" in text or not text.strip():
        return False
    if text.strip().lower().endswith((".yaml", ".yml", ".json")):
        return True
    try:
        return Path(text).is_file()
    except OSError:  # e.g. a name too long to be a path: it is text
        return False


def _read_file(path: Path) -> Any:
    try:
        text = path.expanduser().read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError([_error("", f"file not found: {path}")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError([_error("", f"cannot read {path}: {exc}")]) from None
    if path.suffix.lower() == ".json":
        return _parse_json(text, where=f" in {path}")
    return _parse_yaml(text, where=f" in {path}")


def _parse_text(text: str, where: str) -> Any:
    if text.lstrip().startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as json_exc:
            try:
                return _parse_yaml(text, where)  # flow-style YAML also starts with "{"
            except SpecError:
                raise _json_error(json_exc, where) from None
    return _parse_yaml(text, where)


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise _json_error(exc, where) from None


def _json_error(exc: json.JSONDecodeError, where: str) -> SpecError:
    return SpecError([_error(
        "", f"invalid JSON{where} at line {exc.lineno}, column {exc.colno}: {exc.msg}"
    )])


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (PyYAML silently keeps the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None,
                    f"duplicate key {key!r} (first given on line {seen[key] + 1})",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


# YAML 1.1 (PyYAML) reads `1e-3` and `2e9` as strings; read them as numbers, as YAML 1.2 does.
_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _parse_yaml(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        context = getattr(exc, "context", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        detail = f"{problem} ({context})" if context else problem
        raise SpecError([_error("", f"invalid YAML{where}{at}: {detail}")]) from None


# ---- pydantic errors -> SpecError ------------------------------------------------------


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if part in (_LRS_LIST, _LRS_RANGE):
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _join(prefix: str, field: str) -> str:
    if not prefix:
        return field
    if not field:
        return prefix
    return prefix + field if field.startswith("[") else f"{prefix}.{field}"


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The spec model that holds the field at `loc` (for listing its allowed fields)."""
    model: type[BaseModel] | None = SweepSpec
    for part in loc:
        if isinstance(part, int) or part in (_LRS_LIST, _LRS_RANGE):
            continue
        if model is None or part not in model.model_fields:
            return None
        model = _find_model(model.model_fields[part].annotation)
    return model


def _find_model(tp: Any) -> type[BaseModel] | None:
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    for arg in get_args(tp):
        found = _find_model(arg)
        if found is not None:
            return found
    return None


def _plain_message(exc: BaseException) -> str:
    """A ValidationError as 'field: message; ...' without pydantic's boilerplate."""
    if isinstance(exc, ValidationError):
        return "; ".join(
            f"{e['field']}: {e['message']}" if e["field"] else e["message"]
            for e in _convert_errors(exc)
        )
    return str(exc)


def _convert_errors(exc: ValidationError) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    for err in exc.errors():
        loc, kind = tuple(err["loc"]), err["type"]
        field = _path(loc)
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, SpecError):
            # Our own checks already carry field paths, relative to where they were raised.
            out.extend(_error(_join(field, e["field"]), e["message"]) for e in cause.errors)
            continue
        if kind == "extra_forbidden":
            out.append(_error(field, _unknown_field_message(loc)))
        elif kind == "missing":
            out.append(_error(field, "required field is missing"))
        elif kind in ("value_error", "assertion_error") and cause is not None:
            out.append(_error(field, str(cause)))
        elif kind == "too_short" and err.get("input") in ([], {}, ""):
            out.append(_error(field, "must not be empty"))
        else:
            out.append(_error(field, _with_input(err["msg"], err.get("input"))))
    return out


def _unknown_field_message(loc: tuple[Any, ...]) -> str:
    name = str(loc[-1])
    model = _model_at(loc[:-1])
    if model is None:
        return f"unknown field {name!r}"
    allowed = list(model.model_fields)
    close = difflib.get_close_matches(name, allowed, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown field {name!r}{hint} (allowed: {', '.join(allowed)})"


def _with_input(msg: str, value: Any) -> str:
    # Show the offending value when it is short enough to read in one line.
    if isinstance(value, (dict, list, tuple)) or value is None:
        return msg
    shown = repr(value)
    return msg if len(shown) > 60 else f"{msg}, got {shown}"
