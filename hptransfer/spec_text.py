"""Reading a sweep spec's text strictly, with no import heavier than PyYAML: shared by the
server's spec loader (sweeper/spec/loading.py) and the client, so a spec is read the same way
on both sides (the client's parse is what reaches the server as JSON).

Strict: a key given twice is an error (PyYAML and Python's json keep the last silently),
``1e-3`` is a number (YAML 1.2; PyYAML's YAML 1.1 reads it as a string), and a value that no
JSON document can carry (Infinity, NaN) is found with its path.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import yaml

SPEC_SUFFIXES = (".yaml", ".yml", ".json")


class DuplicateKey(ValueError):
    """A JSON object that names one key twice."""


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook: a mapping, or DuplicateKey."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(f"duplicate key {key[:100]!r}: give each field once")
        out[key] = value
    return out


class StrictYAMLLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys and reads `1e-3` as a number."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None,
                    f"duplicate key {key!r} (first given on line {seen[key] + 1})",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


StrictYAMLLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def looks_like_path(text: str) -> bool:
    """Whether spec `text` names a file rather than holding the spec itself."""
    if "\n" in text or not text.strip() or text.lstrip().startswith("{"):
        return False
    if text.strip().lower().endswith(SPEC_SUFFIXES):
        return True
    try:
        return Path(text).is_file()
    except OSError:  # e.g. a name too long to be a path: it is text
        return False


def non_finite_paths(data: Any, path: str = "", limit: int = 10) -> list[str]:
    """Where `data` (parsed YAML/JSON) holds Infinity or NaN, by field path."""
    found: list[str] = []
    stack: list[tuple[Any, str]] = [(data, path)]
    while stack and len(found) < limit:
        value, where = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            found.append(where or "(the spec)")
        elif isinstance(value, dict):
            stack.extend((item, f"{where}.{key}" if where else str(key))
                         for key, item in value.items())
        elif isinstance(value, list | tuple):
            stack.extend((item, f"{where}[{i}]") for i, item in enumerate(value))
    return sorted(found)
