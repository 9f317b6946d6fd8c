"""Expand a validated SweepSpec into TrialSpecs, in one deterministic order.

Grid search: `plan_sweep` gives every (arm, depth, width, sigma, lr, seed) point. Optuna
search: `plan_shapes` gives the points without an LR, and the coordinator calls `trial_for`
with each LR Optuna suggests. Both only read the spec, so planning twice gives equal trials
with equal content hashes.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import NamedTuple

from hptransfer.spec import SweepSpec
from hptransfer.spec.trial import TrialSpec


@dataclass(frozen=True)
class PlannedTrial:
    arm: str  # the arm's label
    trial: TrialSpec
    width: int
    depth: int
    lr: float
    sigma_base: float
    seed: int
    content_hash: str  # trial.content_hash(): identifies the result, for reuse
    stage: str | None = None  # a study's stage ("tune" for a study's own grid); else None
    reason: str | None = None  # why a stage target added it (coordinator/targets.py)


class ShapeKey(NamedTuple):
    """One Optuna study's worth of trials: everything but the learning rate."""

    arm: str
    width: int
    depth: int
    sigma_base: float
    seed: int


def spec_hash(spec: SweepSpec) -> str:
    """Hash of the whole validated spec; independent of the key order it was written in."""
    blob = json.dumps(spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def plan_shapes(spec: SweepSpec) -> list[ShapeKey]:
    """Every (arm, width, depth, sigma_base, seed), ordered by arm, depth, width, sigma, seed."""
    g = spec.grid
    return [
        ShapeKey(arm.name, width, depth, sigma, seed)
        for arm in spec.arms
        for depth in g.depths
        for width in g.widths
        for sigma in g.sigma_bases
        for seed in g.seeds
    ]


def plan_sweep(spec: SweepSpec) -> list[PlannedTrial]:
    """The full grid, ordered by arm, depth, width, sigma, lr, seed (grid search only)."""
    if spec.search.method != "grid":
        raise ValueError(
            f"plan_sweep expands grid searches; search.method is {spec.search.method!r}, "
            "so use plan_shapes() and trial_for() with the LRs Optuna suggests"
        )
    lrs = spec.grid.lr_values()
    planned: list[PlannedTrial] = []
    for arm in spec.arms:
        for depth in spec.grid.depths:
            for width in spec.grid.widths:
                planned += _shape_trials(spec, arm.name, width, depth, lrs,
                                         validate_all=not planned)
    return planned


def _shape_trials(spec: SweepSpec, arm: str, width: int, depth: int, lrs: list[float],
                  validate_all: bool) -> list[PlannedTrial]:
    """The grid's trials of one (arm, width, depth), ordered by sigma, lr, seed.

    Whether a trial builds depends on its arm and shape; its LR, sigma and seed only need to
    be in bounds. So the first trial of a shape is validated as a TrialSpec and the others
    copy it with their own LR, sigma and seed, except at the sweep's first shape
    (`validate_all`), where every trial is validated: each LR, sigma and seed once."""
    out: list[PlannedTrial] = []
    for sigma in spec.grid.sigma_bases:
        for lr in lrs:
            for seed in spec.grid.seeds:
                shape = ShapeKey(arm, width, depth, sigma, seed)
                if validate_all or not out:
                    out.append(_planned(spec, shape, lr))
                    continue
                trial = out[0].trial.model_copy(
                    update={"lr": lr, "sigma_base": sigma, "seed": seed})
                out.append(_planned_trial(spec, shape, lr, trial))
    return out


def trial_for(spec: SweepSpec, shape: ShapeKey, lr: float) -> PlannedTrial:
    """The trial of `shape` at learning rate `lr` (for an LR suggested by Optuna)."""
    g = spec.grid
    outside = [
        name
        for name, value, allowed in (
            ("width", shape.width, g.widths),
            ("depth", shape.depth, g.depths),
            ("sigma_base", shape.sigma_base, g.sigma_bases),
            ("seed", shape.seed, g.seeds),
        )
        if value not in allowed
    ]
    if outside or shape.arm not in {a.name for a in spec.arms}:
        # A shape from another spec (or a stale one) would build a trial nobody asked for.
        raise ValueError(f"{shape} is not a shape of sweep {spec.name!r} "
                         f"(unknown {', '.join(outside) or 'arm'})")
    if not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"lr must be a positive finite number, got {lr}")
    return _planned(spec, ShapeKey(*shape), float(lr))


def trial_at(spec: SweepSpec, shape: ShapeKey, lr: float, stage: str | None = None,
             tokens_per_param: float | None = None) -> PlannedTrial:
    """The trial of any shape of a study's arms (a study's later stages leave the grid);
    `tokens_per_param` replaces the sweep's budget (a ladder shape's second budget)."""
    p = _planned(spec, shape, lr, tokens_per_param)
    return p if stage is None else PlannedTrial(**{**p.__dict__, "stage": stage})


def _planned(spec: SweepSpec, shape: ShapeKey, lr: float,
             tokens_per_param: float | None = None) -> PlannedTrial:
    trial = spec.trial_spec(
        spec.arm(shape.arm), shape.width, shape.depth, lr, shape.sigma_base, shape.seed,
        tokens_per_param,
    )
    return _planned_trial(spec, shape, lr, trial)


def _planned_trial(spec: SweepSpec, shape: ShapeKey, lr: float,
                   trial: TrialSpec) -> PlannedTrial:
    return PlannedTrial(
        arm=shape.arm,
        trial=trial,
        width=shape.width,
        depth=shape.depth,
        lr=lr,
        sigma_base=shape.sigma_base,
        seed=shape.seed,
        content_hash=trial.content_hash(),
        # a study's grid is its tune stage (later stages are planned by coordinator/study.py)
        stage="tune" if spec.stages is not None else None,
    )
