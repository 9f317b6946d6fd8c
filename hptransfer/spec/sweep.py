"""SweepSpec: what a user submits, validated up front with errors that say what to fix.

A sweep is a set of arms (architecture x parameterization) crossed with a grid of widths,
depths, learning rates, init scales and seeds, trained to one token budget. Everything a
trial needs is here; `hptransfer.coordinator.plan` expands a spec into `TrialSpec`s.

Validation happens in two passes. Pydantic checks types and ranges of every field; then
`SweepSpec`'s own check looks across fields (pairings, divisibility, the trial cap) and builds
one `TrialSpec` per (arm, width, depth), so that expanding a spec that passed can never fail.
`load_spec` turns both kinds of failure into one `SpecError` whose entries name a field path
such as ``grid.widths[2]``, and also applies the trial cap (a submission policy, so
re-reading a stored spec with `SweepSpec.model_validate` does not re-apply it).

The sections (grid, fixed, budget, search, resources, arms) are in `sections`, the stages of
a study in `stages`, reading files and YAML/JSON text in `loading`, and SpecError with the
conversion of pydantic's errors in `errors`; every public name is importable from here.
"""

from __future__ import annotations

import json
import math
import os
import unicodedata
from typing import Annotated, Any

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from hptransfer.contracts.mlflow_keys import mlflow_key
from hptransfer.contracts.sizes import MIN_ASPECT_RATIOS, SIZE_TOLERANCE, group_by_size
from hptransfer.models import ModelConfig, ModelConfigError
from hptransfer.models.flops import flops_per_token, param_counts
from hptransfer.spec.data import DataSpec, val_window_problem
from hptransfer.spec.trial import MAX_BATCH_SIZE, Budget, Schedule, TrialSpec

from .errors import SpecError, error, plain_message, spec_error
from .loading import read_spec_data
from .sections import (
    MAX_ARMS,
    Analysis,
    Arm,
    Checkpointing,
    Fixed,
    Grid,
    Resources,
    Search,
    SpecModel,
    SweepBudget,
    TaskResources,
)
from .stages import STAGE_ORDER, Stages

MAX_NAME_CHARS = 100
MAX_DESCRIPTION_CHARS = 10_000
MAX_TAGS = 64
MAX_TAG_KEY_CHARS = 128
MAX_TAG_VALUE_CHARS = 1024
MAX_CONCURRENT = 1024
MAX_RETRIES = 100
TagKey = Annotated[str, Field(min_length=1, max_length=MAX_TAG_KEY_CHARS)]
# tag namespaces a sweep's own tags may not use: MLflow's (mlflow.runName, mlflow.parentRunId
# steer its runs) and the ones the mirror writes (hpt.sweep_id, hpt.role, ...)
RESERVED_TAG_PREFIXES = ("mlflow.", "hpt.")
TagValue = Annotated[str, Field(max_length=MAX_TAG_VALUE_CHARS)]
# Unicode's explicit direction marks, embeddings, overrides and isolates: text shown after
# one reads in another order than it was written
_BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e"
                           "\u2066\u2067\u2068\u2069")
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.- ")


class SweepSpec(SpecModel):
    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    description: str = Field("", max_length=MAX_DESCRIPTION_CHARS)
    arms: list[Arm] = Field(min_length=1, max_length=MAX_ARMS)
    grid: Grid
    fixed: Fixed = Fixed()
    budget: SweepBudget
    data: DataSpec = DataSpec()
    schedule: Schedule = Schedule()
    search: Search = Search()
    resources: Resources = Resources()
    checkpoint: Checkpointing = Checkpointing()
    max_concurrent: int = Field(2, ge=1, le=MAX_CONCURRENT)
    retries: int = Field(2, ge=0, le=MAX_RETRIES)
    reuse: bool = True
    tags: dict[TagKey, TagValue] = Field({}, max_length=MAX_TAGS)
    # A staged study (tune at the base shape, then transfer/check/aspect_ratio); see stages.py
    stages: Stages | None = None
    # how the fits judge reliability (the widest η* / shift CI that counts)
    analysis: Analysis = Analysis()

    @field_validator("name")
    @classmethod
    def _name_chars(cls, value: str) -> str:
        bad = sorted(set(value) - _NAME_CHARS)
        if bad:
            raise ValueError(f"{value!r:.120} may contain only ASCII letters, digits, '_', "
                             f"'.', '-' and spaces (found {''.join(bad)!r:.60})")
        if not value.strip():
            raise ValueError("the name is blank; give it at least one letter or digit")
        return value

    @field_validator("tags", mode="before")
    @classmethod
    def _tags_as_text(cls, value: Any) -> Any:
        # YAML reads `version: 2` as an int; tags are labels, so keep them as text.
        if isinstance(value, dict):
            return {
                str(k): str(v) if isinstance(v, (int, bool)) or _finite_float(v) else v
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
        if "max_trials" in context:  # a submission (load_spec): stored specs stay readable
            problems += self._reserved_tag_problems() + self._shown_text_problems()
        if not problems and cap is not None:
            problems = self._size_problems(cap)
        if not problems:
            problems = self._scaled_batch_problems() or self._build_problems()
        if not problems and "max_trials" in context:  # a submission: stored studies load
            problems = self._aspect_size_problems()
        if problems:
            raise SpecError(problems)
        return self

    def _reserved_tag_problems(self) -> list[dict[str, str]]:
        return [error(f"tags.{key}", f"tag keys starting with {prefix!r} are MLflow's or "
                                     "this service's own; rename the tag")
                for key in self.tags for prefix in RESERVED_TAG_PREFIXES
                if key.lower().startswith(prefix)]

    def _shown_text_problems(self) -> list[dict[str, str]]:
        # Labels reach Plotly (which reads them as markup: `<a href>` is a live link); tags
        # reach MLflow, where a key the mirror rewrites may land on another tag's key and
        # silently replace its value, and a control or direction character every page
        problems = []
        for i, arm in enumerate(self.arms):
            label = arm.label or ""
            if "<" in label or ">" in label:
                problems.append(error(f"arms[{i}].label", f"{label!r:.120} may not contain "
                                                          "'<' or '>'"))
        for key, text in self.tags.items():
            if mlflow_key(key) != key:
                problems.append(error(f"tags.{key}", f"tag key {key!r:.80} has characters "
                                      "the MLflow mirror rewrites (so two keys could meet); "
                                      "use letters, digits, '_', '.', '-', ':' and spaces "
                                      "(and no leading '..')"))
            bad = sorted({c for c in text if c in _BIDI_CONTROLS
                          or (unicodedata.category(c) == "Cc" and c not in "\n\t")})
            if bad:
                problems.append(error(f"tags.{key}", f"the value has control or direction "
                                      f"characters ({''.join(bad)!r:.60}); remove them"))
        return problems

    # ---- validation across fields ------------------------------------------------------

    def _cross_field_problems(self) -> list[dict[str, str]]:
        problems = []
        head_dim = self.fixed.head_dim
        for i, width in enumerate(self.grid.widths):
            if width % head_dim:
                problems.append(error(
                    f"grid.widths[{i}]",
                    f"{width} is not divisible by fixed.head_dim={head_dim}; "
                    f"use multiples of {head_dim}",
                ))
        labels: dict[str, int] = {}
        arms_seen: dict[str, int] = {}
        for i, arm in enumerate(self.arms):
            if arm.name in labels:
                problems.append(error(
                    f"arms[{i}].label",
                    f"label {arm.name!r} is already used by arms[{labels[arm.name]}]; "
                    "give each arm a distinct label",
                ))
            labels.setdefault(arm.name, i)
            # Two arms that differ only by label would train identical trials.
            key = arm.model_dump_json(exclude={"label"})
            if key in arms_seen:
                problems.append(error(
                    f"arms[{i}]",
                    f"same arch, options and parameterization as arms[{arms_seen[key]}]; "
                    "remove one",
                ))
            arms_seen.setdefault(key, i)
        if self.search.method == "optuna":
            n = self.search.n_trials
            if n is None or n < 2:
                problems.append(error(
                    "search.n_trials",
                    f"optuna search needs n_trials >= 2 (learning rates tried per shape), "
                    f"got {n}",
                ))
            if n is not None and self.search.n_startup is not None and self.search.n_startup > n:
                problems.append(error(
                    "search.n_startup",
                    f"n_startup ({self.search.n_startup}) is more than n_trials ({n}); the "
                    "first batch is part of the trials of each shape",
                ))
            low, high = self.grid.lr_bounds()
            if not high > low:
                problems.append(error(
                    "grid.lrs",
                    "optuna searches between the smallest and largest learning rate; "
                    "give at least two different values",
                ))
        problem = val_window_problem(self.data.val_tokens, self.fixed.seq_len)
        if problem:  # every trial would train, then fail at its first evaluation
            problems.append(error("data.val_tokens", problem))
        if self.fixed.device == "cuda" and self.resources.gpus == 0:
            problems.append(error(
                "fixed.device",
                "device 'cuda' but resources.gpus is 0, so Ray gives a trial no GPU; "
                "set resources.gpus (a fraction shares a GPU) or use device 'auto'",
            ))
        if self.budget.batch_rule == "scale_with_params":
            problems.extend(self._base_shape_problems())
        if self.stages is not None:
            problems.extend(self._stage_problems())
        return problems

    def _stage_problems(self) -> list[dict[str, str]]:
        # A study tunes at the base shape: its grid is the tune stage's grid.
        problems = []
        f = self.fixed
        for name, values, base in (("widths", self.grid.widths, f.base_width),
                                   ("depths", self.grid.depths, f.base_depth)):
            if list(values) != [base]:
                problems.append(error(
                    f"grid.{name}",
                    f"a study (stages:) tunes at the base shape, so grid.{name} must be "
                    f"[{base}] (fixed.base_{name[:-1]}); put larger shapes in "
                    "stages.transfer.shapes",
                ))
        if self.search.method == "grid" and len(self.grid.lr_values()) < 3:
            problems.append(error(
                "grid.lrs",
                "a study's tune stage fits a parabola in log2(lr): give at least 3 LRs",
            ))
        if self.search.method == "optuna" and (self.search.n_trials or 0) < 3:
            problems.append(error(
                "search.n_trials",
                "a study's tune stage fits a parabola in log2(lr): let Optuna try at least 3 "
                "LRs per shape",
            ))
        assert self.stages is not None
        for stage in self.stages.enabled()[1:]:
            section = getattr(self.stages, stage)
            for i, shape in enumerate(section.shapes or []):
                if shape.width % f.head_dim:
                    problems.append(error(
                        f"stages.{stage}.shapes[{i}].width",
                        f"{shape.width} is not divisible by fixed.head_dim={f.head_dim}",
                    ))
        return problems

    def _base_shape_problems(self) -> list[dict[str, str]]:
        problems = []
        for i, arm in enumerate(self.arms):
            try:
                self._base_params(arm)
            except ModelConfigError as exc:
                problems.append(error(
                    "budget.batch_rule",
                    f"scale_with_params counts parameters at the base shape "
                    f"(fixed.base_width={self.fixed.base_width}, "
                    f"fixed.base_depth={self.fixed.base_depth}), which arms[{i}] cannot "
                    f"build: {exc}",
                ))
        return problems

    def _size_problems(self, cap: int) -> list[dict[str, str]]:
        grid, later, extra = self._trial_counts()
        total = grid + later + sum(extra.values())
        if total <= cap:
            return []
        if grid > cap or self.stages is None:
            return [error("grid", f"grid has {grid} trials, more than the cap of {cap}; "
                                  "shrink the grid or raise HPT_MAX_TRIALS")]
        # the stages push it over: name what to shrink there, the largest target cap first
        where = (f"stages.{max(extra, key=extra.__getitem__)}.max_extra_trials"
                 if extra and grid + later <= cap else "stages")
        parts = [f"{grid} in the grid", f"{later} in its later stages and extension rounds"]
        parts += [f"{n} that stages.{stage}.max_extra_trials may add"
                  for stage, n in extra.items()]
        fix = (f"lower {where}" if where != "stages"
               else "shrink the later stages (their shapes, offsets or extend)")
        return [error(where, f"the study may plan {total} trials ({', '.join(parts)}), more "
                             f"than the cap of {cap}; {fix} or raise HPT_MAX_TRIALS")]

    def _scaled_batch_problems(self) -> list[dict[str, str]]:
        # scale_with_params may scale a shape's batch out of bounds: that is the budget's
        # doing, so name its exponent rather than the arm that cannot be built
        if self.budget.batch_rule != "scale_with_params":
            return []
        shapes = [(w, d) for w in self.grid.widths for d in self.grid.depths]
        shapes += [(s.width, s.depth) for _, _, s in self._stage_shapes()]
        for arm in self.arms:
            for width, depth in shapes:
                try:
                    batch = self.batch_size_for(arm, width, depth)
                except ModelConfigError:
                    continue  # the arm's own problem, said by _build_problems
                if not 1 <= batch <= MAX_BATCH_SIZE:
                    return [error("budget.batch_exponent", (
                        f"scale_with_params gives arm {arm.name!r} a batch of {batch:,} "
                        f"sequences at width {width}, depth {depth} (batch_size "
                        f"{self.budget.batch_size} x (P/P_base)^{self.budget.batch_exponent:g})"
                        f", above the limit of {MAX_BATCH_SIZE:,}; lower batch_exponent or "
                        "batch_size"))]
        return []

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
                        failures.setdefault(plain_message(exc, SweepSpec), []).append(shape)
            problems.extend(
                error(f"arms[{i}]", f"arm {arm.name!r} cannot be built at "
                       f"{'; '.join(shapes)}: {cause}")
                for cause, shapes in failures.items()
            )
            for stage, j, shape in self._stage_shapes():
                try:
                    self.trial_spec(arm, shape.width, shape.depth, lr, sigma, seed)
                except ValueError as exc:
                    problems.append(error(
                        f"stages.{stage}.shapes[{j}]",
                        f"arm {arm.name!r} cannot be built at width {shape.width}, depth "
                        f"{shape.depth}: {plain_message(exc, SweepSpec)}",
                    ))
        return problems

    def _aspect_size_problems(self) -> list[dict[str, str]]:
        # The N:L fit compares shapes of one size only (contracts/sizes.py): a stage whose
        # shapes are spread over several sizes would train, then fit nothing.
        stage = self.stages.aspect_ratio if self.stages is not None else None
        if stage is None:
            return []
        problems = []
        for arm in self.arms:
            sizes = [self._non_embedding_params(arm, s.width, s.depth, self.fixed.head_dim)
                     for s in stage.shapes]
            groups = group_by_size(sizes)
            ratios = max(len({s.width / s.depth for s, g in zip(stage.shapes, groups,
                                                                  strict=True) if g == label})
                         for label in set(groups))
            if ratios < MIN_ASPECT_RATIOS:
                listed = ", ".join(f"{s.width}x{s.depth}: {n:,}"
                                   for s, n in zip(stage.shapes, sizes, strict=True))
                problems.append(error(
                    "stages.aspect_ratio.shapes",
                    f"the N:L fit needs {MIN_ASPECT_RATIOS} width:depth ratios at one size "
                    f"(non-embedding parameters within ±{SIZE_TOLERANCE:.0%} of their "
                    f"median), and arm {arm.name!r} has at most {ratios} ({listed}); give "
                    "shapes of about equal width² x depth"))
        return problems

    def _stage_shapes(self) -> list[tuple[str, int, Any]]:
        if self.stages is None:
            return []
        return [(stage, j, shape) for stage in self.stages.enabled()[1:]
                for j, shape in enumerate(getattr(self.stages, stage).shapes or [])]

    # ---- expansion helpers (used by plan.py) -------------------------------------------

    def trial_count(self) -> int:
        """The most trials the sweep can plan (a study: at its worst case)."""
        grid, later, extra = self._trial_counts()
        return grid + later + sum(extra.values())

    def _trial_counts(self) -> tuple[int, int, dict[str, int]]:
        """(the grid's trials, the most a study's grid-edge extensions and later stages
        can add, each stage target's cap: stage -> max_extra_trials)."""
        g = self.grid
        if self.search.method == "optuna":
            per_shape = self.search.n_trials or 0
        else:
            per_shape = len(g.lr_values())
        tune = (len(self.arms) * len(g.widths) * len(g.depths) * len(g.sigma_bases)
                * len(g.seeds) * per_shape)
        if self.stages is None:
            return tune, 0, {}
        # the most a study can plan: grid-edge extensions and every later stage's shapes
        st = self.stages
        per_arm_seed = st.tune.extend * st.tune.extend_lrs * len(g.sigma_bases)
        for stage in st.enabled()[1:]:
            extension = (st.check.extend * st.check.extend_lrs
                         if stage == "check" and st.check else 0)
            per_arm_seed += sum(len(st.lr_offsets(stage, shape)) + extension
                                for shape in st.shapes_of(stage))
        # every target's cap, whole (one arm's, or one seed's, target may spend it all)
        extra = {stage: n for stage in STAGE_ORDER if (n := st.extra_cap(stage))}
        return tune, len(self.arms) * len(g.seeds) * per_arm_seed, extra

    def arm(self, label: str) -> Arm:
        for arm in self.arms:
            if arm.name == label:
                return arm
        raise KeyError(f"no arm labelled {label!r}; arms: {[a.name for a in self.arms]}")

    def model_vocab_size(self) -> int:
        """The vocabulary the models are built with: data.vocab_size, else the tokenizer's
        (for shards, vocab_size is required). Used for parameter counts and admission."""
        if self.data.vocab_size:
            return self.data.vocab_size
        return self.data.bpe_vocab_size if self.data.tokenizer == "bpe" else 256

    def task_resources(self, trial: TrialSpec, stage: str | None = None) -> TaskResources:
        """What the Ray task of `trial` (a trial of this sweep, in `stage`) asks for:
        resources.scale_out's first rule it matches, else the base resources."""
        if not self.resources.scale_out:
            return self.resources.base
        cfg = trial.model_config_obj(vocab_size=self.model_vocab_size())
        return self.resources.task_for(param_counts(cfg).non_embedding,
                                       self.trial_flops(trial), stage)

    def trial_flops(self, trial: TrialSpec) -> float:
        """The analytic training FLOPs of `trial` (a trial of this sweep): its steps x
        tokens per step x `models.flops` training FLOPs per token. The one count pricing,
        scale_out rules and a stage target's `max_extra_flops` use."""
        cfg = trial.model_config_obj(vocab_size=self.model_vocab_size())
        tokens_per_step = trial.batch_size * trial.seq_len
        steps = trial.budget.steps_for(tokens_per_step, param_counts(cfg).non_embedding)
        return float(steps) * tokens_per_step * flops_per_token(cfg, trial.seq_len).training

    def _non_embedding_params(self, arm: Arm, width: int, depth: int, head_dim: int) -> int:
        cfg = ModelConfig(
            arch=arm.arch, width=width, depth=depth, head_dim=head_dim,
            vocab_size=self.model_vocab_size(), max_seq_len=self.fixed.seq_len,
            **arm.arch_options.model_dump(),
        )
        return param_counts(cfg).non_embedding

    def _base_params(self, arm: Arm) -> int:
        # Parameter counts do not depend on head_dim, and the base width need not be a
        # multiple of it, so count the base shape with single-dimension heads (counted,
        # never built: ModelConfig.build_problem is not asked).
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
        self, arm: Arm, width: int, depth: int, lr: float, sigma_base: float, seed: int,
        tokens_per_param: float | None = None,
    ) -> TrialSpec:
        """The TrialSpec of one grid point (validated by TrialSpec itself);
        `tokens_per_param` replaces the sweep's budget (a ladder shape's own budget)."""
        budget = (self.budget.trial_budget() if tokens_per_param is None
                  else Budget(tokens_per_param=tokens_per_param))
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
            budget=budget,
            schedule=self.schedule,
            data=self.data,
            # Only a thread count (not in the content hash): keep torch to the CPUs Ray gave.
            num_threads=self.resources.threads,
            **self.fixed.model_dump(),
        )


def _finite_float(value: Any) -> bool:
    return isinstance(value, float) and math.isfinite(value)


# ---- loading ---------------------------------------------------------------------------


def load_spec(
    source: SweepSpec | dict | str | os.PathLike, max_trials: int | None = None
) -> SweepSpec:
    """Validate a sweep from a SweepSpec, a dict, a .yaml/.yml/.json path, or YAML/JSON text.

    Raises SpecError listing every problem with its field path. `max_trials` caps the number
    of trials (default: the service setting, $HPT_MAX_TRIALS, else 5000).
    """
    if max_trials is not None and max_trials < 1:
        raise SpecError([error("", f"max_trials must be >= 1, got {max_trials}")])
    cap = max_trials or _settings_max_trials()
    if isinstance(source, SweepSpec):
        data: Any = source.model_dump()  # re-validated: the cap may differ from the first time
    else:
        data = read_spec_data(source)
    try:
        return SweepSpec.model_validate(data, context={"max_trials": cap})
    except ValidationError as exc:
        raise spec_error(exc, SweepSpec) from None


def _settings_max_trials() -> int:
    from hptransfer.config import SettingsError, get_settings

    try:
        return get_settings().max_trials
    except SettingsError as exc:  # e.g. HPT_MAX_TRIALS=abc: say so as a spec-level error
        raise SpecError([error("", str(exc))]) from None


def storable(spec: SweepSpec) -> dict:
    """The spec as the JSON the store keeps, checked to read back as the same spec (strict
    JSON: no NaN/Infinity), so a stored sweep can always be listed and dispatched."""
    data = spec.model_dump(mode="json")
    try:
        text = json.dumps(data, allow_nan=False)
        again = SweepSpec.model_validate(json.loads(text))
    except (ValueError, ValidationError) as exc:
        raise SpecError([error("", f"the spec does not survive storage: {exc}")]) from None
    if again != spec:
        raise SpecError([error("", "the spec does not read back as given from storage")])
    return data
