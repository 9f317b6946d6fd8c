"""The sections of a SweepSpec: the grid (with its learning-rate log range), the fixed trial
settings, the budget, the search, the Ray resources, and the arms.

Each section checks its own fields; checks across sections are `SweepSpec`'s.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from hptransfer.contracts.reliability import ETA_CI_LOG2
from hptransfer.models import ModelConfig, ModelConfigError, Parameterization
from hptransfer.models.config import Arch
from hptransfer.models.parameterization import PRESETS, ParameterizationError, check_pairing
from hptransfer.spec.trial import (
    MAX_LR,
    MAX_PARAMETERIZATION_CHARS,
    STRICT,
    ArchOptions,
    Budget,
    Depth,
    Lr,
    Seed,
    Sigma,
    TrialSpec,
    Width,
    trial_field,
)

from .errors import LRS_LIST, LRS_RANGE, SpecError, error

_LOG_RANGE_MAX_VALUES = 1000  # a tiny step would otherwise expand into millions of LRs
MAX_LIST = 64  # values per grid axis (widths, depths, sigma_bases, seeds); LRs: as above
MAX_ARMS = 64
MAX_N_TRIALS = 10_000
MAX_CPUS = 1024.0
MAX_GPUS = 64.0
# Ray counts resources in units of 1e-4 and refuses a task asking for a positive amount below
# one; caught here, at submit, instead of failing the dispatcher's every tick
RAY_RESOURCE_UNIT = 1e-4
MIN_LOG2_STEP = 1e-3  # a finer log2 step than any LR grid needs; the count stays printable
MAX_PACK = 64  # trials of one shape trained together in one Ray task (workers/packed.py)
MAX_BATCH_EXPONENT = 4.0
_FLOAT_TOL = 1e-9
_TRIAL = TrialSpec()  # a trial's defaults


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


class SpecModel(BaseModel):
    # Every spec model rejects unknown keys (a typo must not silently fall back to a default),
    # coerces nothing (true is not 1, 64.0 is not 64, "1" is not 1) and takes finite numbers.
    model_config = STRICT


class LogRange(SpecModel):
    """Learning rates 2**k for k = log2_min, log2_min + step, ... up to log2_max inclusive."""

    # Bounded so 2**k stays a normal float (and far outside any sane LR anyway).
    log2_min: float = Field(ge=-100, le=math.log2(MAX_LR))
    log2_max: float = Field(ge=-100, le=math.log2(MAX_LR))
    step: float = Field(ge=MIN_LOG2_STEP, le=200)

    @model_validator(mode="after")
    def _ordered(self) -> LogRange:
        if self.log2_min > self.log2_max:
            raise ValueError(  # enough digits that the two never print alike
                f"log2_min ({self.log2_min:.12g}) is greater than log2_max "
                f"({self.log2_max:.12g}); swap them"
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
        # The last may pass log2_max by count()'s tolerance: capped, it is log2_max itself.
        return [2.0 ** min(round(self.log2_min + i * self.step, 12), self.log2_max)
                for i in range(self.count())]


def _lrs_kind(value: Any) -> str | None:
    if isinstance(value, (dict, LogRange)):
        return LRS_RANGE
    if isinstance(value, (list, tuple)):
        return LRS_LIST
    return None


LrGrid = Annotated[
    Annotated[list[Lr], Tag(LRS_LIST), Field(min_length=1, max_length=_LOG_RANGE_MAX_VALUES)]
    | Annotated[LogRange, Tag(LRS_RANGE)],
    Discriminator(
        _lrs_kind,
        custom_error_type="lrs_type",
        custom_error_message=(
            "give a list of learning rates or a log range {log2_min, log2_max, step}"
        ),
    ),
]


class Analysis(SpecModel):
    """How the sweep's fits judge their numbers. `eta_ci_log2`: the widest CI (half-width,
    octaves of LR) an η* or a transfer shift may have and still be reported reliable."""

    eta_ci_log2: float = Field(ETA_CI_LOG2, gt=0.0, le=8.0)


class Grid(SpecModel):
    widths: list[Width] = Field(min_length=1, max_length=MAX_LIST)
    depths: list[Depth] = Field(min_length=1, max_length=MAX_LIST)
    lrs: LrGrid
    # by default the one value a trial takes when it is not given
    sigma_bases: list[Sigma] = Field([_TRIAL.sigma_base], min_length=1, max_length=MAX_LIST)
    seeds: list[Seed] = Field([_TRIAL.seed], min_length=1, max_length=MAX_LIST)

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


# The trial settings a sweep fixes for all its trials, in the order `fixed:` lists them;
# each is TrialSpec's field, with its default and bounds.
FIXED_FIELDS = (
    "head_dim", "base_width", "base_depth", "weight_decay", "eps", "beta1", "beta2",
    "grad_clip", "precision", "device", "divergence_factor", "eval_every", "seq_len",
    "micro_batch_size",  # sequences per forward/backward pass (see TrialSpec)
)
Fixed = create_model(
    "Fixed",
    __base__=SpecModel,
    __module__=__name__,
    __doc__="Trial settings shared by the whole sweep; every name is a `TrialSpec` field.",
    **{name: (TrialSpec.model_fields[name].annotation, trial_field(name))
       for name in FIXED_FIELDS},
)


class SweepBudget(Budget):
    """A trial `Budget` (exactly one of tokens, steps, tokens_per_param) plus batch sizing."""

    batch_size: int = trial_field("batch_size")
    batch_rule: Literal["fixed", "scale_with_params"] = "fixed"
    batch_exponent: float = Field(0.5, ge=-MAX_BATCH_EXPONENT, le=MAX_BATCH_EXPONENT)

    def trial_budget(self) -> Budget:
        # A plain Budget, so batch settings never leak into a trial's content hash.
        return Budget(tokens=self.tokens, steps=self.steps, tokens_per_param=self.tokens_per_param)


# Optuna search defaults (see hptransfer/coordinator/optuna_search.py for how each is used).
DEFAULT_N_STARTUP = 4  # range-covering LRs asked before the sampler takes over
MIN_FULL_BUDGET = 3  # trials per study trained to the full budget before any pruning


class Search(SpecModel):
    """How LRs are chosen per shape: the full grid, or an Optuna study over the grid's range.

    Optuna: `n_startup` log-spaced LRs (shifted per shape) cover the range first; then two
    LRs either side of the best, then (while the best full-budget LR lacks a full-budget
    neighbour on a side) one on that side; then the sampler proposes. Pruning never decides
    before `prune_after` of a trial's budget (and its warmup) is trained, compares trials at
    equal steps only, starts only once MIN_FULL_BUDGET trials of the study completed, and
    never stops the LRs placed around the best, so η* can always be fitted.
    """

    method: Literal["grid", "optuna"] = "grid"
    sampler: Literal["tpe", "random", "qmc"] = "tpe"
    # rank: stop a trial once `keep_top` others had a lower validation loss at the same step
    pruner: Literal["rank", "successive_halving", "median", "none"] = "rank"
    n_trials: int | None = Field(None, gt=0, le=MAX_N_TRIALS, strict=True)  # LRs tried per shape
    n_startup: int | None = Field(None, ge=2, le=1000, strict=True)  # default min(4, n_trials)
    prune_after: float = Field(0.5, ge=0.0, le=1.0, strict=True, allow_inf_nan=False)
    keep_top: int = Field(3, ge=1, le=1000, strict=True)

    def startup_count(self) -> int:
        """LRs of the range-covering first batch of every study."""
        n = self.n_trials or 0
        return min(self.n_startup or DEFAULT_N_STARTUP, n)


def _ray_gpus(value: float) -> float:
    if 0 < value < RAY_RESOURCE_UNIT:
        raise ValueError(f"give 0 or at least {RAY_RESOURCE_UNIT:g} GPU per task (Ray's "
                         f"smallest fraction), got {value:g}")
    return value


def _shard_needs_workers(shard: bool, info: ValidationInfo) -> bool:
    # `workers` comes before `shard` in both models, so it is validated (or failed) by now
    workers = info.data.get("workers")
    if shard and workers is not None and workers < 2:
        raise ValueError(f"sharding (FSDP) splits a trial over its workers: give workers: 2 "
                         f"or more with shard: true, got workers: {workers}")
    return shard


MAX_WORKERS = 512  # data-parallel Ray Train workers of one trial
MAX_SCALE_OUT_RULES = 8
# a study's stages, in the order they run (stages.STAGE_ORDER)
StageName = Literal["tune", "transfer", "check", "aspect_ratio"]


@dataclass(frozen=True)
class TaskResources:
    """What one trial's Ray task asks for: `workers` Ray Train workers (1: a plain task) of
    `cpus` and `gpus` each; `shard`: the workers shard the model (FSDP) instead of each
    holding all of it (DDP)."""

    workers: int
    cpus: float
    gpus: float
    shard: bool = False

    @property
    def threads(self) -> int:
        """Torch threads of one worker: its whole CPUs, at least one (rounding up would put
        more threads on the cores than Ray gave, and on a shared core OpenMP's threads wait
        on each other at every op)."""
        return max(1, int(self.cpus))

    @property
    def spans(self) -> bool:
        return self.workers > 1

    def count_in(self, cpus: float, gpus: float) -> int:
        """How many tasks of these resources (all their workers) fit in these CPUs and GPUs."""
        fits = math.floor(cpus / (self.cpus * self.workers) + 1e-9)
        if self.gpus:
            fits = min(fits, math.floor(gpus / (self.gpus * self.workers) + 1e-9))
        return fits


class ScaleOut(SpecModel):
    """Trials this rule matches train data-parallel over `workers` Ray Train workers of
    `cpus` and `gpus` each (DDP: NCCL on GPUs, gloo on CPUs; `shard`: FSDP, each worker
    holding 1/W of the weights, gradients and AdamW state). A rule matches a trial at or
    above every threshold it gives (non-embedding parameters, training FLOPs) and in one of
    its `stages` when it names some; the first matching rule wins."""

    min_params: float | None = Field(None, ge=0, le=1e15)
    min_flops: float | None = Field(None, ge=0, le=1e30)
    stages: list[StageName] | None = Field(None, min_length=1, max_length=4)
    workers: int = Field(ge=1, le=MAX_WORKERS)
    cpus: float = Field(1.0, ge=RAY_RESOURCE_UNIT, le=MAX_CPUS)
    gpus: float = Field(0.0, ge=0, le=MAX_GPUS)
    shard: bool = False

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, value: float) -> float:
        return _ray_gpus(value)

    @field_validator("shard")
    @classmethod
    def _shard(cls, value: bool, info: ValidationInfo) -> bool:
        return _shard_needs_workers(value, info)

    @model_validator(mode="after")
    def _some_condition(self) -> ScaleOut:
        if self.min_params is None and self.min_flops is None and self.stages is None:
            raise ValueError("give min_params, min_flops or stages: which trials this rule "
                             "is for (resources.workers applies to every trial)")
        return self

    def matches(self, params: float, flops: float, stage: str | None) -> bool:
        return ((self.min_params is None or params >= self.min_params)
                and (self.min_flops is None or flops >= self.min_flops)
                and (self.stages is None or (stage or "tune") in self.stages))


class Resources(SpecModel):
    """Ray resources of one task; fractions let several tasks share a GPU.

    `pack`: pending trials of one shape (they may differ in LR, sigma, seed and schedule) are
    trained together as one batched model in one task with these resources; `auto` picks
    the size from the shape and the device (`coordinator/packing.py`), 1 never packs. Each
    member stays its own trial. `max_concurrent` counts tasks, so a pack is one of them.

    `workers` > 1: every trial trains data-parallel over that many Ray Train workers of
    `cpus` and `gpus` each; `scale_out`: rules that give only the trials they match (large
    shapes, a stage) their own workers and resources. A trial on more than one worker is
    never packed. `shard` (with workers > 1): the workers shard the model with FSDP
    (`fully_shard`) instead of DDP, for a shape whose weights, gradients and AdamW state do
    not fit one device.
    """

    cpus: float = Field(1.0, ge=RAY_RESOURCE_UNIT, le=MAX_CPUS)
    gpus: float = Field(0.0, ge=0, le=MAX_GPUS)
    pack: Literal["auto"] | int = "auto"
    workers: int = Field(1, ge=1, le=MAX_WORKERS)
    shard: bool = False
    scale_out: list[ScaleOut] = Field([], max_length=MAX_SCALE_OUT_RULES)

    @field_validator("gpus")
    @classmethod
    def _gpus(cls, value: float) -> float:
        return _ray_gpus(value)

    @field_validator("shard")
    @classmethod
    def _shard(cls, value: bool, info: ValidationInfo) -> bool:
        return _shard_needs_workers(value, info)

    def task_for(self, params: float, flops: float, stage: str | None) -> TaskResources:
        """The resources of a trial of `params` non-embedding parameters and `flops`
        training FLOPs in `stage` (None: a sweep without stages)."""
        for rule in self.scale_out:
            if rule.matches(params, flops, stage):
                return TaskResources(rule.workers, rule.cpus, rule.gpus, rule.shard)
        return self.base

    @property
    def base(self) -> TaskResources:
        """What a trial no rule matches gets."""
        return TaskResources(self.workers, self.cpus, self.gpus, self.shard)

    @field_validator("pack", mode="before")
    @classmethod
    def _pack(cls, value: Any) -> Any:
        # one message for every bad value instead of pydantic's two union branches
        if value == "auto" or (type(value) is int and 1 <= value <= MAX_PACK):
            return value
        raise ValueError(f"give 'auto' or a whole number of trials per task from 1 to "
                         f"{MAX_PACK}, got {value!r:.60}")

    @property
    def threads(self) -> int:
        """Torch threads of a task with the base resources (TaskResources.threads)."""
        return self.base.threads


class Checkpointing(SpecModel):
    """When a trial checkpoints (model, optimizer, schedule position, RNG, data position,
    curve) to HPT_CHECKPOINT_URL, so a retry resumes there instead of at step 0. Every
    `every_steps` optimizer steps and/or `every_minutes` of training; the default, every
    10 minutes, never slows a trial of seconds. A finished trial's checkpoints are deleted
    unless `keep_final`; no checkpoint is written past `max_sweep_gb` for the sweep."""

    every_steps: int | None = Field(None, ge=1, le=10**7)
    every_minutes: float | None = Field(10.0, gt=0, le=7 * 24 * 60)
    keep_final: bool = False
    max_sweep_gb: float = Field(100.0, gt=0, le=1e6)


class Arm(SpecModel):
    """One contender: an architecture with its options, under one parameterization."""

    label: str | None = Field(None, min_length=1, max_length=100)
    arch: Arch = trial_field("arch")
    arch_options: ArchOptions = trial_field("arch_options")
    parameterization: str = Field(max_length=MAX_PARAMETERIZATION_CHARS)  # no default: required
    alpha: float | None = trial_field("alpha")

    @field_validator("label")
    @classmethod
    def _label_chars(cls, value: str | None) -> str | None:
        # shown in terminals (`hpt fits`), pages and MLflow: no control characters (an
        # escape sequence clears a terminal) and no Unicode direction overrides
        if value is None:
            return value
        bad = sorted({c for c in value if not " " <= c <= "~"})
        if bad:
            raise ValueError(f"{value!r:.120} may contain only printable ASCII characters "
                             f"(found {''.join(bad)!r:.60})")
        if not value.strip():
            raise ValueError("the label is blank; give it a letter or digit, or leave it out "
                             "for the default (arch/parameterization)")
        if value != value.strip():  # "x" and "x " would be two arms no one can tell apart
            raise ValueError(f"{value!r:.120} starts or ends with a space; remove it")
        return value

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
            return [error("parameterization", f"unknown parameterization {name!r}; {hint}"
                          f"use one of {', '.join(PRESETS)}")]
        if name == "depth_alpha" and self.alpha is None:
            return [error("alpha", "parameterization 'depth_alpha' needs alpha in [0.5, 1] "
                          "(0.5 = depth-muP, 1 = CompleteP)")]
        if self.alpha is not None and not 0.5 <= self.alpha <= 1.0:
            return [error("alpha", f"alpha must be in [0.5, 1] (0.5 = depth-muP, "
                          f"1 = CompleteP), got {_fmt(self.alpha)}")]
        try:
            p = Parameterization(name=name, alpha=self.alpha)
        except ParameterizationError as exc:  # e.g. alpha given with a non-alpha preset
            return [error("alpha", str(exc))]
        problems = []
        try:
            check_pairing(ModelConfig(arch=self.arch), p)
        except ParameterizationError as exc:
            problems.append(error("parameterization", str(exc)))
        try:
            # Deep enough that only arch/option conflicts show; depth limits are per shape.
            ModelConfig(arch=self.arch, depth=max(2, 2 * self.arch_options.value_embeddings - 1),
                        **self.arch_options.model_dump())
        except ModelConfigError as exc:
            problems.append(error("arch_options", str(exc)))
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
