"""Validation and cleaning of the trial-results frame shared by every analysis."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from hptransfer.contracts.status import TrialStatus

from .errors import AnalysisError

# Columns every analysis needs; the rest are only needed by the fits that use them.
CORE_COLUMNS: tuple[str, ...] = (
    "trial_id",
    "arm",
    "width",
    "depth",
    "lr",
    "sigma_base",
    "seed",
    "status",
    "final_val_loss",
)
NUMERIC_COLUMNS: tuple[str, ...] = (
    "width",
    "depth",
    "lr",
    "sigma_base",
    "final_val_loss",
    "flops",
    "tokens",
    "params_non_embedding",
    "params_embedding",
    "steps",
)
TEXT_COLUMNS: tuple[str, ...] = ("trial_id", "arm", "arch", "parameterization", "status")
ALL_COLUMNS: tuple[str, ...] = (
    *CORE_COLUMNS,
    "arch",
    "parameterization",
    "flops",
    "tokens",
    "params_non_embedding",
    "params_embedding",
    "steps",  # optimizer steps trained: where a pruned trial stopped
)
STATUSES = frozenset(TrialStatus)
# how a trial frame's `parameterization` column names the paper's baselines (lower case):
# savings are quoted against µP (CompleteP over µP is the headline), else against SP
MUP_LABELS = frozenset({"mup", "µp", "μp", "mu_p", "mu-p"})
SP_LABELS = frozenset({"sp", "standard"})

# Outcome codes: only OK rows carry a loss; DIVERGED rows are counted but never averaged.
OK, DIVERGED, IGNORED = 0, 1, 2


@dataclass
class Trials:
    """A cleaned copy of the input: known columns only, typed, with an `outcome` code."""

    frame: pd.DataFrame
    warnings: list[str] = field(default_factory=list)
    status_counts: dict[str, int] = field(default_factory=dict)
    n_input: int = 0


def require_columns(df: object, required: Iterable[str]) -> pd.DataFrame:
    """Raise AnalysisError unless `df` is a DataFrame holding every required column."""
    if not isinstance(df, pd.DataFrame):
        raise AnalysisError(f"expected a pandas DataFrame of trials, got {type(df).__name__}")
    missing = [c for c in dict.fromkeys(required) if c not in df.columns]
    if missing:
        raise AnalysisError(
            "missing required columns: "
            + ", ".join(missing)
            + f" (the frame has: {', '.join(map(str, df.columns)) or 'no columns'})"
        )
    return df


def prepare_trials(df: object, required: Iterable[str] = CORE_COLUMNS) -> Trials:
    """Validate and clean a trial frame; rows that cannot be used are dropped with a warning."""
    required = tuple(required)
    frame = require_columns(df, required)
    extra = [c for c in required if c not in ALL_COLUMNS]
    keep = [c for c in (*ALL_COLUMNS, *extra) if c in frame.columns]
    out = frame[keep].reset_index(drop=True)
    warnings: list[str] = []

    for col in NUMERIC_COLUMNS:
        if col in out.columns:
            out[col] = pd.to_numeric(out[col], errors="coerce").astype(float)
        else:
            out[col] = np.nan  # optional column absent: the fits needing it say so
    for col in TEXT_COLUMNS:
        if col in out.columns:
            # Vectorised string ops: on pandas' Arrow-backed strings a Python loop is the cost.
            values = out[col]
            out[col] = values.where(values.notna(), "").astype(str)
        else:
            out[col] = ""
    out["status"] = out["status"].str.strip().str.lower()
    if "seed" not in out.columns:
        out["seed"] = 0

    counts = out["status"].value_counts()
    status_counts = {str(k): int(v) for k, v in counts.items()}
    unknown = sorted(set(status_counts) - STATUSES)
    if unknown:
        warnings.append(f"ignored trials with unknown status: {', '.join(unknown)}")

    # Shapes and LRs are taken in log space, so they must be finite and positive.
    axes = out[["width", "depth", "lr"]].to_numpy()
    bad_axes = ~(np.isfinite(axes) & (axes > 0)).all(axis=1)
    bad_arm = (out["arm"] == "").to_numpy(dtype=bool)
    drop = bad_axes | bad_arm
    if drop.any():
        warnings.append(
            f"dropped {int(drop.sum())} trials with a missing arm or a missing/non-positive "
            "width, depth or lr"
        )
        out = out.loc[~drop].reset_index(drop=True)

    loss = out["final_val_loss"].to_numpy()
    finite = np.isfinite(loss)
    completed = (out["status"] == TrialStatus.COMPLETED).to_numpy(dtype=bool)
    diverged = (out["status"] == TrialStatus.DIVERGED).to_numpy(dtype=bool)
    # A completed run whose loss is NaN/inf blew up without being flagged: count it as diverged.
    silent = completed & ~finite
    if silent.any():
        warnings.append(
            f"{int(silent.sum())} completed trials have a NaN/inf final_val_loss; "
            "counted as diverged"
        )
    outcome = np.full(len(out), IGNORED, dtype=np.int8)
    outcome[completed & finite] = OK
    outcome[diverged | silent] = DIVERGED
    out["outcome"] = outcome
    out.loc[outcome != OK, "final_val_loss"] = np.nan
    return Trials(frame=out, warnings=warnings, status_counts=status_counts, n_input=len(frame))
