"""A sweep's trials as the DataFrame the analysis package consumes (`RESULT_FRAME_COLUMNS`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pandas as pd
from sqlalchemy import Row, Select, select

from .schema import Trial

# Columns of results_frame(), in order; the analysis package consumes exactly this frame.
RESULT_FRAME_COLUMNS: tuple[str, ...] = (
    "trial_id", "arm", "arch", "parameterization", "width", "depth", "lr", "sigma_base",
    "seed", "status", "final_val_loss", "flops", "tokens", "params_non_embedding",
    "params_embedding", "wall_time_s", "reused", "stage", "steps", "tokens_per_param",
)
_FRAME_DTYPES: dict[str, Any] = {
    **dict.fromkeys(("trial_id", "arm", "arch", "parameterization", "status", "stage"),
                   object),
    **dict.fromkeys(("width", "depth", "seed"), "int64"),
    # tokens/params are counts, but float so rows without a result can hold NaN
    **dict.fromkeys(
        ("lr", "sigma_base", "final_val_loss", "flops", "tokens", "params_non_embedding",
         "params_embedding", "wall_time_s", "steps", "tokens_per_param"),
        "float64",
    ),
    "reused": bool,
}


def results_query(sweep_id: str) -> Select[Any]:
    """The columns the frame needs, one row per trial in plan order."""
    return (
        select(
            Trial.id, Trial.arm, Trial.spec, Trial.width, Trial.depth, Trial.lr,
            Trial.sigma_base, Trial.seed, Trial.status, Trial.final_val_loss, Trial.flops,
            Trial.tokens, Trial.params_non_embedding, Trial.params_embedding,
            Trial.wall_time_s, Trial.reused_from, Trial.stage,
        )
        .where(Trial.sweep_id == sweep_id)
        .order_by(Trial.idx)
    )


def _steps(tokens: int | None, spec: dict[str, Any]) -> int | None:
    """Optimizer steps trained (where a pruned trial stopped): tokens per step is fixed."""
    per_step = (spec.get("batch_size") or 0) * (spec.get("seq_len") or 0)
    return tokens // per_step if tokens is not None and per_step else None


def results_to_frame(rows: Iterable[Row[Any]]) -> pd.DataFrame:
    """The frame of `results_query`'s rows, typed per column even when there are none."""
    columns: dict[str, list[Any]] = {c: [] for c in RESULT_FRAME_COLUMNS}
    for r in rows:
        spec = r.spec or {}
        values = {
            "trial_id": r.id, "arm": r.arm, "arch": spec.get("arch"),
            "parameterization": spec.get("parameterization"), "width": r.width,
            "depth": r.depth, "lr": r.lr, "sigma_base": r.sigma_base, "seed": r.seed,
            "status": r.status, "final_val_loss": r.final_val_loss, "flops": r.flops,
            "tokens": r.tokens, "params_non_embedding": r.params_non_embedding,
            "params_embedding": r.params_embedding, "wall_time_s": r.wall_time_s,
            "reused": r.reused_from is not None, "stage": r.stage,
            "steps": _steps(r.tokens, spec),
            # the planned budget (NaN unless per parameter): tells a ladder shape's two
            # budgets apart, which `tokens` cannot for a trial that stopped early
            "tokens_per_param": (spec.get("budget") or {}).get("tokens_per_param"),
        }
        for name, value in values.items():
            columns[name].append(value)
    return pd.DataFrame(
        {c: pd.Series(columns[c], dtype=_FRAME_DTYPES[c]) for c in RESULT_FRAME_COLUMNS}
    )
