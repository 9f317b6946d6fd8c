"""The `stages:` section of a SweepSpec: a staged "tune small, train large" study.

A study is one sweep whose stages run in order, each planned from the results of the ones
before it (see `hptransfer.coordinator.study`):

1. tune          the sweep's own grid (or Optuna search) at the base shape
                 (fixed.base_width x fixed.base_depth): η* and σ* per arm;
2. transfer      a ladder of larger shapes at each arm's transferred η*, σ*;
3. check         at the largest shape(s), a small LR bracket around the transferred η*
                 (η* x 2^offset): how far the true optimum moved, in log2;
4. aspect_ratio  shapes of about equal non-embedding size, several width:depth ratios, at
                 the transferred HPs: the compute-optimal N:L.

Every field is bounded and checked here; checks that need the rest of the spec (head_dim,
the base shape, the arms) are `SweepSpec`'s.

Targets: the tune, transfer and check stages may each give a `target` (how sure their
headline must be), `max_extra_trials` (the most trials the study may add to meet it) and
optionally `max_extra_flops` (the most training FLOPs those trials may take together).
After the stage's trials, a target not met adds seeds where the seed noise dominates, or an
LR in the gap where η* sits between LRs far apart, refits, and repeats until it is met or
a cap would be exceeded (`hptransfer.coordinator.targets`).
"""

from __future__ import annotations

from itertools import pairwise
from typing import Annotated, Any, Literal, get_args

from pydantic import Field, field_validator, model_validator

from hptransfer.contracts.sizes import MIN_ASPECT_RATIOS
from hptransfer.spec.trial import Depth, TokensPerParam, Width

from .errors import SpecError, error
from .sections import MIN_LOG2_STEP, SpecModel, StageName

STAGE_ORDER: tuple[str, ...] = get_args(StageName)
MAX_STAGE_SHAPES = 64  # per stage: a study is a handful of shapes, not a grid
MAX_EXTEND = 4
MAX_EXTRA_TRIALS = 10_000  # per stage target; the sweep's trial cap bounds the sum too
MAX_EXTRA_FLOPS = 1e30  # per stage target: far above any sweep (admission bounds the sum)


class Shape(SpecModel):
    width: Width
    depth: Depth

    def key(self) -> tuple[int, int]:
        return (self.width, self.depth)


def _unique_shapes(shapes: list[Shape]) -> list[Shape]:
    seen: dict[tuple[int, int], int] = {}
    for i, s in enumerate(shapes):
        if s.key() in seen:
            raise ValueError(
                f"shape {i} (width {s.width}, depth {s.depth}) repeats shape {seen[s.key()]}; "
                "list each shape once"
            )
        seen[s.key()] = i
    return shapes


Shapes = Annotated[list[Shape], Field(min_length=1, max_length=MAX_STAGE_SHAPES)]


CiLog2 = Annotated[float, Field(gt=0.0, le=8.0)]


class TuneTarget(SpecModel):
    """η* of every arm at the base shape known to ±`eta_ci_log2` octaves (its 95 % CI's
    half-width from the seed noise), with a bracket whose losses rise above that noise."""

    eta_ci_log2: CiLog2


class TransferTarget(SpecModel):
    """Every FLOP-savings headline row's CI excludes 0 (which arm is cheaper is known)."""

    savings_excludes_zero: Literal[True]


class CheckTarget(SpecModel):
    """Every check shape's transfer shift (η* there minus η* at the base) known to
    ±`shift_ci_log2` octaves; the base's η* and the check's both count in its CI."""

    shift_ci_log2: CiLog2


class _Targeted(SpecModel):
    """A stage with an optional `target` and the trials it may add to meet it."""

    target: Any = None
    max_extra_trials: int | None = Field(None, ge=0, le=MAX_EXTRA_TRIALS)
    # training FLOPs of the trials it adds (`SweepSpec.trial_flops`, as pricing counts them)
    max_extra_flops: float | None = Field(None, ge=0, le=MAX_EXTRA_FLOPS)

    @model_validator(mode="after")
    def _capped(self) -> _Targeted:
        if self.target is not None and self.max_extra_trials is None:
            raise SpecError([error(
                "max_extra_trials", "a target adds trials until it is met: give "
                "max_extra_trials, the most it may add (0: only report whether it is met); "
                "max_extra_flops may cap their training FLOPs as well")])
        for name in ("max_extra_trials", "max_extra_flops"):
            if self.target is None and getattr(self, name):
                raise SpecError([error(
                    name, f"{name} is what a target may spend; give target as well, or "
                    f"leave {name} out")])
        return self

    def extra_cap(self) -> int:
        """The most trials this stage's target may add (0 without one)."""
        return (self.max_extra_trials or 0) if self.target is not None else 0

    def extra_flops_cap(self) -> float | None:
        """The most training FLOPs the trials this stage's target adds may take together
        (None: no FLOP cap, or no target)."""
        return self.max_extra_flops if self.target is not None else None


class TuneStage(_Targeted):
    """The sweep's grid (or Optuna search) at the base shape. When η* of an arm sits at an
    edge of the LR range, up to `extend` more rounds add `extend_lrs` LRs beyond that edge
    (same step); past that the study stops and says why. `target` (eta_ci_log2) with
    `max_extra_trials`: seeds or LRs are added at the base shape until η* is that sure."""

    extend: int = Field(1, ge=0, le=MAX_EXTEND)
    extend_lrs: int = Field(2, ge=1, le=8)
    target: TuneTarget | None = None


class LadderShape(Shape):
    """A ladder shape; `tokens_per_param` trains it at that token budget instead of the
    sweep's (a second budget of a shape also on the ladder at the sweep's budget), so the
    frontier can take the lower envelope over budgets and L(N, D) sees D vary at fixed N."""

    tokens_per_param: TokensPerParam | None = None


class TransferStage(_Targeted):
    """The ladder, trained once per arm and seed at the arm's transferred η*, σ*.
    `target` (savings_excludes_zero) with `max_extra_trials`: seeds are added to the
    ladder of the arms whose savings CI straddles 0."""

    shapes: Annotated[list[LadderShape], Field(min_length=1, max_length=MAX_STAGE_SHAPES)]
    target: TransferTarget | None = None

    @field_validator("shapes")
    @classmethod
    def _unique(cls, v: list[LadderShape]) -> list[LadderShape]:
        _unique_shapes([s for s in v if s.tokens_per_param is None])
        seen: dict[tuple[int, int, float], int] = {}
        default = {s.key() for s in v if s.tokens_per_param is None}
        for i, s in enumerate(v):
            if s.tokens_per_param is None:
                continue
            key = (*s.key(), s.tokens_per_param)
            if key in seen:
                raise ValueError(f"shape {i} repeats shape {seen[key]} (same width, depth and "
                                 "tokens_per_param); list each once")
            seen[key] = i
            if s.key() not in default:
                raise ValueError(
                    f"shape {i} (width {s.width}, depth {s.depth}) has its own "
                    "tokens_per_param but is not on the ladder at the sweep's budget: a "
                    "second budget is for a ladder shape, so list it without one as well")
        return v

    def default_budget_shapes(self) -> list[LadderShape]:
        return [s for s in self.shapes if s.tokens_per_param is None]


class CheckStage(_Targeted):
    """LR bracket η* x 2^offset at `shapes` (default: the transfer ladder's largest shape).
    Offset 0 at a ladder shape is the ladder's own trial, so it is not trained twice. When
    the bracket's best LR is at its edge (η* moved further than the bracket spans), up to
    `extend` more rounds each add `extend_lrs` LRs beyond that edge, spaced like the
    bracket; past that the shift is reported as a bound. `target` (shift_ci_log2) with
    `max_extra_trials`: seeds or LRs are added at the check shape, or at the base shape
    when the base's η* is the wider part of the shift's CI."""

    shapes: list[Shape] | None = Field(None, min_length=1, max_length=8)
    log2_offsets: list[float] = Field(
        [-1.0, 0.0, 1.0], min_length=3, max_length=9,
    )
    extend: int = Field(1, ge=0, le=MAX_EXTEND)
    extend_lrs: int = Field(1, ge=1, le=8)
    target: CheckTarget | None = None

    def step(self) -> float:
        """The bracket's spacing in octaves (its closest pair): how far an extension steps."""
        return min(b - a for a, b in pairwise(self.log2_offsets))

    @field_validator("shapes")
    @classmethod
    def _unique(cls, v: list[Shape] | None) -> list[Shape] | None:
        return None if v is None else _unique_shapes(v)

    @field_validator("log2_offsets")
    @classmethod
    def _offsets(cls, v: list[float]) -> list[float]:
        for x in v:
            if not -8.0 <= x <= 8.0:
                raise ValueError(f"offset {x:g} is outside [-8, 8] octaves")
        if len(set(v)) != len(v):
            raise ValueError("each offset once, please (a repeat trains the same trial twice)")
        close = [(a, b) for a, b in pairwise(sorted(v)) if b - a < MIN_LOG2_STEP]
        if close:  # LRs are planned at 1e-6 octave: closer offsets can train one LR twice
            a, b = close[0]
            raise ValueError(f"offsets {a:.12g} and {b:.12g} are less than {MIN_LOG2_STEP:g} "
                             "octave apart; space the bracket's offsets further")
        if 0.0 not in v:
            raise ValueError("include 0 (the transferred η* itself) so the bracket is centred")
        if min(v) >= 0 or max(v) <= 0:
            raise ValueError("give offsets on both sides of 0, or the bracket cannot "
                             "locate an optimum that moved either way")
        return sorted(v)


class AspectRatioStage(SpecModel):
    """Shapes of about equal non-embedding parameter count (12·N²·L), at least 4 width:depth
    ratios (the cubic in log N:L needs 4; a reliable fit needs 5). `tokens_per_param` trains
    all of them at that budget instead of the sweep's: one budget for the stage, since N:L
    compares its shapes at equal size and equal tokens."""

    shapes: Annotated[list[Shape], Field(min_length=4, max_length=MAX_STAGE_SHAPES)]
    tokens_per_param: TokensPerParam | None = None

    @field_validator("shapes")
    @classmethod
    def _unique(cls, v: list[Shape]) -> list[Shape]:
        v = _unique_shapes(v)
        ratios = {s.width / s.depth for s in v}
        if len(ratios) < MIN_ASPECT_RATIOS:
            raise ValueError(f"{len(ratios)} distinct width:depth ratios; the cubic in "
                             f"log(N/L) needs at least {MIN_ASPECT_RATIOS}")
        return v


class Stages(SpecModel):
    tune: TuneStage = TuneStage()
    transfer: TransferStage | None = None
    check: CheckStage | None = None
    aspect_ratio: AspectRatioStage | None = None

    @model_validator(mode="after")
    def _needs(self) -> Stages:
        if self.check is not None and self.check.shapes is None and self.transfer is None:
            raise SpecError([error(
                "check.shapes", "check without shapes brackets the transfer ladder's largest "
                "shape; add a transfer stage or give check.shapes")])
        return self

    def extra_cap(self, stage: str) -> int:
        """The most trials `stage`'s target may add (0: no target, or no such stage)."""
        section = getattr(self, stage, None)
        return section.extra_cap() if isinstance(section, _Targeted) else 0

    def extra_flops_cap(self, stage: str) -> float | None:
        """The most training FLOPs `stage`'s target may add (None: no FLOP cap)."""
        section = getattr(self, stage, None)
        return section.extra_flops_cap() if isinstance(section, _Targeted) else None

    def enabled(self) -> list[str]:
        """Stage names in the order they run."""
        return [name for name in STAGE_ORDER if name == "tune" or getattr(self, name)]

    def shapes_of(self, stage: str) -> list[Shape]:
        """The shapes a later stage trains (check defaults to the largest ladder shape,
        by 12·N²·L)."""
        if stage == "check" and self.check is not None and self.check.shapes is None:
            assert self.transfer is not None
            return [max(self.transfer.default_budget_shapes(),
                        key=lambda s: (s.width**2 * s.depth, s.width))]
        section: Any = getattr(self, stage)
        return list(section.shapes) if section is not None else []

    def tokens_per_param(self, stage: str, shape: Shape) -> float | None:
        """The budget (tokens per parameter) a later stage trains `shape` at; None: the
        sweep's own budget."""
        if stage == "aspect_ratio" and self.aspect_ratio is not None:
            return self.aspect_ratio.tokens_per_param
        return getattr(shape, "tokens_per_param", None)  # a ladder shape's second budget

    def lr_offsets(self, stage: str, shape: Shape) -> list[float]:
        """The log2 offsets from the transferred η* a later stage trains at `shape`: the
        check's bracket without 0 at a ladder shape (that is the ladder's own trial), else 0."""
        if stage != "check" or self.check is None:
            return [0.0]
        ladder = ({s.key() for s in self.transfer.default_budget_shapes()}
                  if self.transfer else set())
        return [o for o in self.check.log2_offsets if not (o == 0 and shape.key() in ladder)]
