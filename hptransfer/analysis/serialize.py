"""An analysis result as a JSON-safe dict (`analysis_dict`), and frames with None for NaN."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from hptransfer.jsonsafe import json_safe


def with_none(frame: pd.DataFrame, columns: tuple[str, ...] | list[str]) -> pd.DataFrame:
    """Make optional text columns object dtype holding None, not pandas' NaN-for-missing str."""
    for col in columns:
        if col in frame.columns:
            values = frame[col].astype(object)
            frame[col] = values.where(values.notna(), None)
    return frame


def analysis_dict(
    analysis: str, result: Any, *, first: Mapping[str, Any] | None = None, **rest: Any
) -> dict[str, Any]:
    """JSON-safe `to_dict` of an analysis result: its name, `first`, status, then `rest`.

    `first` exists only to keep the key order those results always had.
    """
    return json_safe(
        {
            "analysis": analysis,
            **(first or {}),
            "reliable": result.reliable,
            "reason": result.reason,
            "warnings": result.warnings,
            **rest,
        }
    )
