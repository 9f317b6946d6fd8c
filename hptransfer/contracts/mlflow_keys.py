"""The MLflow key a name is logged under: the mirror writes it, and the spec refuses tag keys
that it would rewrite (two keys could otherwise land on one MLflow key, the later value
silently replacing the earlier)."""

from __future__ import annotations

import hashlib
import re

MAX_KEY = 250  # MLflow's limit (mlflow.utils.validation)
_KEY_BAD_CHARS = re.compile(r"[^\w.\- :]")  # MLflow allows these plus "/", which we avoid


def mlflow_key(key: str) -> str:
    """A key MLflow accepts: allowed characters only, at most 250 characters (hash-suffixed)."""
    key = _KEY_BAD_CHARS.sub("_", key) or "_"
    if key in (".", "..") or key.startswith(".."):
        key = "_" + key
    if len(key) > MAX_KEY:
        # Keep keys unique after truncation: two long keys may share their first 240 chars.
        key = key[: MAX_KEY - 9] + "-" + hashlib.sha1(key.encode()).hexdigest()[:8]
    return key
