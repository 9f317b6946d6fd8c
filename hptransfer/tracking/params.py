"""Values MLflow accepts: tracking-URI normalisation, flattened params, keys and values cut to
MLflow's limits, and the names runs and files get.

Pure functions with no MLflow import, used by the mirror.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from hptransfer.contracts.mlflow_keys import mlflow_key

# MLflow's limits (mlflow.utils.validation); checked here so one long value cannot sink a batch.
MAX_PARAM_VALUE = 6000
MAX_TAG_VALUE = 8000
MAX_METRICS_PER_BATCH = 1000

_FILE_BAD_CHARS = re.compile(r"[^\w.\-]")


# ------------------------------------------------------------------------------------------
# tracking URIs


def normalize_tracking_uri(uri: str) -> str:
    """A bare `*.db` path becomes an absolute sqlite URI; anything else is returned as is."""
    if "://" not in uri and uri.endswith((".db", ".sqlite", ".sqlite3")):
        return f"sqlite:///{Path(uri).expanduser().resolve()}"
    return uri


def sqlite_store_file(tracking_uri: str) -> Path | None:
    """The SQLite file an MLflow tracking URI (as users write it) names, or None."""
    return sqlite_path(normalize_tracking_uri(tracking_uri))


def sqlite_path(uri: str) -> Path | None:
    """The database file of a file-backed `sqlite:///` URI (None for other stores)."""
    if not uri.startswith("sqlite:///"):
        return None
    raw = unquote(uri[len("sqlite:///"):].split("?", 1)[0])
    if not raw or raw == ":memory:":
        return None
    return Path(raw).expanduser().resolve()


def file_store_path(uri: str) -> Path | None:
    """The directory of an MLflow file store (`file:///dir` or a bare path), else None."""
    if uri.startswith("file:"):
        raw = unquote(uri[len("file:"):].split("?", 1)[0])
        raw = raw[2:] if raw.startswith("//") else raw  # file:///dir and file:/dir alike
        return Path(raw or "/").expanduser().resolve()
    if "://" not in uri and uri.strip():
        return Path(uri).expanduser().resolve()
    return None


# ------------------------------------------------------------------------------------------
# params, keys and values


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested mapping -> {"a.b.c": "value"}; lists of mappings are indexed, other lists JSON."""
    out: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            if value:
                out.update(flatten(value, name + "."))
            else:
                out[name] = "{}"
        elif isinstance(value, list | tuple) and value and all(
            isinstance(v, Mapping) for v in value
        ):
            for i, item in enumerate(value):
                out.update(flatten(item, f"{name}.{i}."))
        elif isinstance(value, list | tuple):
            out[name] = json.dumps(list(value), default=str)
        else:
            out[name] = str(value)
    return out


def truncate(value: str, limit: int) -> str:
    marker = "...[truncated]"
    return value if len(value) <= limit else value[: limit - len(marker)] + marker


def mlflow_params(flat: Mapping[str, Any]) -> dict[str, str]:
    """Keys and values cut to MLflow's limits (key 250, value 6000 characters)."""
    return {mlflow_key(k): truncate(str(v), MAX_PARAM_VALUE) for k, v in flat.items()}


def mlflow_tags(tags: Mapping[str, Any]) -> dict[str, str]:
    """Keys and values cut to MLflow's limits (key 250, tag value 8000 characters)."""
    return {mlflow_key(k): truncate(str(v), MAX_TAG_VALUE) for k, v in tags.items()}


def to_float(value: Any) -> float | None:
    """A number as float; None for None, bools and anything that is not a number."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def table_params(table: Mapping[str, Any]) -> dict[str, str]:
    """The param table as params: group.<name>.{lr,weight_decay,eps,init,init_std,n_params},
    mult.{residual,logits,attn_scale}, table.{parameterization,alpha,m_width,m_depth}."""
    out: dict[str, Any] = {}
    for key in ("parameterization", "alpha", "m_width", "m_depth"):
        if key in table:
            out[f"table.{key}"] = table[key]
    for group in table.get("groups") or []:
        name = group.get("name", "?")
        for key in ("lr", "weight_decay", "eps", "init", "init_std"):
            if key in group:
                out[f"group.{name}.{key}"] = group[key]
        out[f"group.{name}.n_params"] = len(group.get("params") or [])  # tensors in the group
    for key, value in (table.get("multipliers") or {}).items():
        out[f"mult.{key}"] = value
    return mlflow_params(out)


# ------------------------------------------------------------------------------------------
# names


def run_name(arm: str, spec: Mapping[str, Any]) -> str:
    lr = to_float(spec.get("lr"))
    lr_text = f"{lr:.3g}" if lr is not None else "?"
    return (
        f"{arm} N={spec.get('width', '?')} L={spec.get('depth', '?')} "
        f"lr={lr_text} seed={spec.get('seed', '?')}"
    )


def safe_name(text: str) -> str:
    """File-name-safe and injective: a short hash is added whenever characters were replaced.
    Never empty, never `.` or `..` (a sweep named `..` wrote its artifacts beside, not under,
    the artifact root) and never a path (`/` is replaced)."""
    safe = _FILE_BAD_CHARS.sub("_", text)[:80]
    if not safe.strip("."):  # empty or dots only: the current or parent folder
        safe = "_" * max(1, len(safe))
    if safe != text:
        safe += "-" + hashlib.sha1(text.encode()).hexdigest()[:8]
    return safe
