"""benchmarks/science.py's own arithmetic (the service's fits are tested elsewhere): the steps
a curve takes to reach a loss, the depth slope's CI, the t interval over seeds and the best
LR per arm, each against a value worked out by hand."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "science.py"
_SPEC = importlib.util.spec_from_file_location("science_benchmark", _PATH)
science = importlib.util.module_from_spec(_SPEC)
sys.modules["science_benchmark"] = science
_SPEC.loader.exec_module(science)


def test_steps_to_reach_interpolates_between_evaluations():
    steps = np.array([10.0, 20.0, 30.0, 40.0])
    losses = np.array([5.0, 4.0, 3.5, 3.4])
    assert science.steps_to_reach(steps, losses, 3.75) == pytest.approx(25.0)  # 4.0 -> 3.5
    assert science.steps_to_reach(steps, losses, 3.5) == pytest.approx(30.0)
    assert science.steps_to_reach(steps, losses, 6.0) == 10.0  # already there at the first
    assert math.isnan(science.steps_to_reach(steps, losses, 3.0))  # never reached
    # the first crossing counts, not a later one after a bump
    bumpy = np.array([5.0, 3.0, 4.0, 2.0])
    assert science.steps_to_reach(steps, bumpy, 3.5) == pytest.approx(17.5)


def test_val_curve_keeps_only_evaluated_points():
    result = {"curve": [{"step": 5, "train_loss": 4.0}, {"step": 10, "train_loss": 3.9,
                                                         "val_loss": 3.8},
                        {"step": 20, "train_loss": 3.0, "val_loss": 3.1}]}
    steps, losses = science.val_curve(result)
    assert steps.tolist() == [10.0, 20.0] and losses.tolist() == [3.8, 3.1]


def test_depth_slope_and_its_ci():
    depth = np.log2([1.0, 2.0, 4.0, 8.0])
    eta = -7.0 + 0.25 * depth  # a quarter octave per doubling, exactly
    se = np.full(4, 0.2)
    slope, lo, hi = science.slope_with_ci(depth, eta, se)
    assert slope == pytest.approx(0.25)
    # by hand: x - mean = -1.5, -0.5, 0.5, 1.5; Σx² = 5; SE(slope) = 0.2 / √5
    assert (hi - lo) / 2 == pytest.approx(1.959964 * 0.2 / math.sqrt(5), rel=1e-6)
    # unequal SEs: Var = Σ w² se², w = x / Σx²
    se2 = np.array([0.1, 0.2, 0.3, 0.4])
    _, lo2, hi2 = science.slope_with_ci(depth, eta, se2)
    w = np.array([-1.5, -0.5, 0.5, 1.5]) / 5
    assert (hi2 - lo2) / 2 == pytest.approx(1.959964 * math.sqrt((w**2 * se2**2).sum()))
    # one depth without a bounded CI: the slope has none
    _, lo3, hi3 = science.slope_with_ci(depth, eta, np.array([0.2, np.inf, 0.2, 0.2]))
    assert lo3 == -math.inf and hi3 == math.inf


def test_t_interval_over_seeds():
    mean, lo, hi = science.t_ci([1.0, 3.0])
    # two values: sd √2, SE 1, t(0.975, 1 dof) = 12.7062
    assert mean == 2.0 and (hi - lo) / 2 == pytest.approx(12.7062, rel=1e-4)
    mean, lo, hi = science.t_ci([2.0, float("nan")])
    assert mean == 2.0 and math.isnan(lo) and math.isnan(hi)


def test_best_lr_needs_every_seed_completed():
    rows = [  # arm a: the lowest mean is at 0.01, but a seed diverged there
        ("a", 0.01, 0, "completed", 1.0), ("a", 0.01, 1, "diverged", None),
        ("a", 0.001, 0, "completed", 2.0), ("a", 0.001, 1, "completed", 2.2),
        ("a", 0.0001, 0, "completed", 2.5), ("a", 0.0001, 1, "completed", 2.1),
        ("b", 0.01, 0, "completed", 3.0), ("b", 0.01, 1, "completed", 3.0),
        ("b", 0.001, 0, "completed", 2.9), ("b", 0.001, 1, "completed", 3.3),
    ]
    trials = pd.DataFrame(rows, columns=["arm", "lr", "seed", "status", "final_val_loss"])
    best = science.best_lr_per_arm(trials)
    assert best.loc["a", "lr"] == 0.001 and best.loc["a", "mean"] == pytest.approx(2.1)
    assert best.loc["b", "lr"] == 0.01  # mean 3.0 beats 3.1


def test_seed_vertex_and_its_resampled_slope():
    x = np.array([-8.0, -7.0, -6.0, -5.0, -4.0])
    bowl = (x + 5.7) ** 2  # vertex at -5.7, inside the best LR's neighbours
    assert science.seed_vertex(x, bowl) == pytest.approx(-5.7)
    assert science.seed_vertex(x, (x + 9.0) ** 2) == -8.0  # best at the grid's edge
    # a diverged neighbour (no loss): the best LR itself
    assert science.seed_vertex(x, np.array([2.0, 1.0, 0.0, np.nan, 1.0])) == -6.0
    # two seeds per depth whose vertices move +0.5 octave per doubling: slope 0.5, and
    # every resample keeps it when the seeds agree
    rows = [(d, s, lr, (lr - (-7.0 + 0.5 * math.log2(d))) ** 2)
            for d in (1, 2, 4, 8) for s in (0, 1) for lr in x]
    trials = pd.DataFrame(rows, columns=["depth", "seed", "log2_lr", "loss"])
    point, draws = science.seed_resampled_slopes(trials, [1, 2, 4, 8], resamples=50)
    assert point == pytest.approx(0.5) and np.allclose(draws, 0.5)
