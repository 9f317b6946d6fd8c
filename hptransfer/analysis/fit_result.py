"""The skeleton the curve fits (power law, Chinchilla) share: their status and uncertainty
fields, the cleaning of their input points and the bootstrap of their parameters."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import NotEnoughData
from .stats import percentile_ci

# An exponent whose bootstrap CI spans more than this factor is not determined by the data.
MAX_EXPONENT_CI_FACTOR = 3.0


def exponent_ci_problem(name: str, ci: dict[str, tuple[float, float]]) -> str | None:
    """Why an exponent's CI makes a fit unreliable (None when it does not): the same rule for
    the power law's b and Chinchilla's α and β."""
    if name in ci and ci[name][0] > 0 and ci[name][1] / ci[name][0] > MAX_EXPONENT_CI_FACTOR:
        return (f"the exponent {name}'s CI spans more than a factor "
                f"{MAX_EXPONENT_CI_FACTOR:g}")
    return None


# kw_only: these defaulted fields sit after each fit's own required, positional fields.
@dataclass(kw_only=True)
class FitResult:
    """What every fit carries besides its parameters; `reason` is set when no fit was possible."""

    trial_ids: list[list[str]] = field(default_factory=list)
    ci: dict[str, tuple[float, float]] = field(default_factory=dict)
    ci_level: float = 0.95
    reliable: bool = False
    warnings: list[str] = field(default_factory=list)
    reason: NotEnoughData | None = None

    @property
    def ok(self) -> bool:
        return self.reason is None

    def ci_dict(self) -> dict[str, Any]:
        """The `ci` and `ci_level` entries of `to_dict`."""
        return {"ci": {k: list(v) for k, v in self.ci.items()}, "ci_level": self.ci_level}

    def status_dict(self) -> dict[str, Any]:
        """The closing `reliable`, `warnings` and `reason` entries of `to_dict`."""
        return {"reliable": self.reliable, "warnings": self.warnings, "reason": self.reason}

    def status_row(self) -> dict[str, Any]:
        """The `reliable`, `reason` and `warnings` cells of a `to_frame` row."""
        return {
            "reliable": self.reliable,
            "reason": str(self.reason) if self.reason else None,
            "warnings": list(self.warnings),
        }


def usable_points(
    columns: Sequence[Sequence[float] | np.ndarray],
    trial_ids: Sequence[Sequence[str]] | None,
) -> tuple[list[np.ndarray], list[list[str]], list[str]]:
    """The points whose every column is finite and positive: (columns, trial ids, warnings)."""
    arrays = [np.asarray(c, dtype=float) for c in columns]
    ids = [list(t) for t in trial_ids] if trial_ids is not None else [[] for _ in arrays[0]]
    good = np.ones(arrays[0].shape, dtype=bool)
    for a in arrays:
        good &= np.isfinite(a) & (a > 0)
    warnings: list[str] = []
    if not good.all():
        warnings.append(f"ignored {int((~good).sum())} points with missing/non-positive values")
    ids = [t for t, g in zip(ids, good, strict=True) if g]
    return [a[good] for a in arrays], ids, warnings


def residual_bootstrap(
    fitted: np.ndarray, residuals: np.ndarray, n_params: int, n_resamples: int,
    seed: int | None, refit: Callable[[np.ndarray], np.ndarray],
) -> np.ndarray:
    """`refit` (responses -> parameters, NaN when it failed) on `n_resamples` redraws of the
    responses, fitted + resampled residuals; shape (n_resamples, n_params).

    A study's shapes and budgets are chosen, not sampled, so this keeps them and redraws only
    the noise (the residual bootstrap for a fixed design). Resampling the points instead
    also resamples the design: with 6-8 points per arm, a draw that misses the largest shapes
    or repeats one point far off the curve refits the exponent on much less information, and
    the CI mostly measures which points were drawn. Residuals are centred on their median
    (the fits are robust) and scaled by sqrt(n / (n - p)), which undoes the shrinkage of
    fitting p parameters (Davison & Hinkley 1997, section 6.2). Calibration against known
    laws is tested in tests/test_bootstrap.py."""
    if n_resamples <= 0:
        return np.empty((0, n_params))
    r = np.asarray(residuals, dtype=float)
    r = r - np.median(r)
    if r.size > n_params:
        r = r * np.sqrt(r.size / (r.size - n_params))
    rng = np.random.default_rng(seed)
    draws = rng.choice(r, size=(n_resamples, r.size))
    return np.array([refit(fitted + d) for d in draws]).reshape(-1, n_params)


def named_cis(samples: dict[str, np.ndarray], level: float) -> dict[str, tuple[float, float]]:
    """Percentile interval of each named parameter's bootstrap samples (none without samples)."""
    out: dict[str, tuple[float, float]] = {}
    for name, values in samples.items():
        if len(values):
            lo, hi = percentile_ci(values, level)
            out[name] = (float(lo), float(hi))
    return out
