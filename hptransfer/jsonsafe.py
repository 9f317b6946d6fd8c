"""Values as JSON can hold them: no NaN or inf, no numpy scalars, frames as records. The app
database, the fits' JSON and the coord-check results all store through here."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd


def json_safe(obj: Any) -> Any:
    """Recursively turn numpy/pandas values into plain JSON types; NaN and inf become None."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (np.bool_,)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        value = float(obj)
        return value if math.isfinite(value) else None
    if hasattr(obj, "to_dict") and not isinstance(obj, (pd.DataFrame, pd.Series)):
        return json_safe(obj.to_dict())
    if isinstance(obj, pd.DataFrame):
        return frame_records(obj)
    if isinstance(obj, pd.Series):
        return [json_safe(v) for v in obj.tolist()]
    if isinstance(obj, Mapping):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, np.ndarray):
        return [json_safe(v) for v in obj.tolist()]
    if isinstance(obj, (list, tuple, set)):
        return [json_safe(v) for v in obj]
    if obj is pd.NA or obj is pd.NaT:
        return None
    if isinstance(obj, pd.Timestamp):
        return obj.isoformat()
    return str(obj)


def frame_records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """A DataFrame as a list of JSON-safe row dicts."""
    columns = [str(c) for c in frame.columns]
    return [
        {c: json_safe(v) for c, v in zip(columns, row, strict=True)}
        for row in frame.itertuples(index=False, name=None)
    ]
