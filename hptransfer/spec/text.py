"""Reading a sweep spec's text strictly, with no import heavier than PyYAML: shared by the
server's spec loader (spec/loading.py) and the client, so a spec is read the same way
on both sides (the client's parse is what reaches the server as JSON).

Strict: a key given twice is an error (PyYAML and Python's json keep the last silently),
``1e-3`` is a number (YAML 1.2; PyYAML's YAML 1.1 reads it as a string), and a value that no
JSON document can carry (Infinity, NaN) is found with its path.
"""

from __future__ import annotations

import math
import re
import sys
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
# Only what JSON carries: a date stays text, as in YAML 1.2 (YAML 1.1 makes 2024-05-01 a
# date, which no JSON request can hold), and the explicit tags for dates, sets, binary and
# ordered pairs are refused with their line instead of failing later without one.
StrictYAMLLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers
            if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in StrictYAMLLoader.yaml_implicit_resolvers.items()
}
NON_JSON_TAGS = ("timestamp", "set", "binary", "omap", "pairs")


def _refuse_non_json(loader: StrictYAMLLoader, node: yaml.Node) -> None:
    kind = node.tag.rsplit(":", 1)[-1]
    raise yaml.constructor.ConstructorError(
        None, None, f"!!{kind} has no JSON equivalent; give the value as text, a number, a "
        "list or a mapping", node.start_mark)


for _kind in NON_JSON_TAGS:
    StrictYAMLLoader.add_constructor(f"tag:yaml.org,2002:{_kind}", _refuse_non_json)

# values in a spec once YAML's aliases are expanded (as JSON must expand them): 64 arms of
# a few dozen fields and every grid axis at its bound are a few thousand
MAX_EXPANDED_VALUES = 100_000
# levels of mappings and lists in a spec: the deepest field (stages.transfer.shapes[0].width)
# is four down; past this, Python's parsers and encoders recurse out of stack
MAX_NESTING = 32
NESTED_TOO_DEEPLY = (f"the spec nests mappings or lists more than {MAX_NESTING} levels deep; "
                     "a sweep spec's fields are at most a few levels down")


def nesting_depth(data: Any, cap: int = MAX_NESTING) -> int:
    """How many levels of mappings and lists `data` holds, counted without recursion;
    stops counting past `cap`."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack and deepest <= cap:
        value, level = stack.pop()
        if isinstance(value, dict | list | tuple):
            deepest = max(deepest, level + 1)
            stack.extend((child, level + 1)
                         for child in (value.values() if isinstance(value, dict) else value))
    return deepest


def expanded_size(data: Any, cap: int = MAX_EXPANDED_VALUES) -> int:
    """How many values `data` holds with every shared (aliased) part counted each time it
    is used, computed without expanding it; stops counting past `cap`. Eight nested
    aliases in a 300-byte YAML text expand to 10^8 values ("billion laughs")."""
    sizes: dict[int, int] = {}

    def size(value: Any) -> int:
        if not isinstance(value, dict | list):
            return 1
        if id(value) not in sizes:
            children = value.values() if isinstance(value, dict) else value
            total = 1
            for child in children:
                total = min(total + size(child), cap + 1)
            sizes[id(value)] = total
        return sizes[id(value)]

    return size(data)


def too_many_digits(exc: ValueError) -> ValueError | None:
    """The error to show for Python's limit on an integer's digits (its own words advise
    sys.set_int_max_str_digits), or None for another ValueError."""
    if "integer string conversion" not in str(exc):
        return None
    return ValueError(f"a number in the spec has more than {sys.get_int_max_str_digits()} "
                      "digits; no spec field takes one that large")


def load_yaml(text: str) -> Any:
    """`text` read strictly (StrictYAMLLoader); ValueError if its aliases expand past
    MAX_EXPANDED_VALUES or it nests past MAX_NESTING. YAML errors are the caller's to word."""
    try:  # PyYAML's parser, and expanded_size, recurse once a level
        data = yaml.load(text, Loader=StrictYAMLLoader)  # a SafeLoader: no arbitrary objects
        size = expanded_size(data)
    except RecursionError:
        raise ValueError(NESTED_TOO_DEEPLY) from None
    except ValueError as exc:
        raise too_many_digits(exc) or exc from None
    if size > MAX_EXPANDED_VALUES:
        raise ValueError(f"the spec's aliases (*name) expand to more than "
                         f"{MAX_EXPANDED_VALUES:,} values; write the parts out or use fewer")
    if nesting_depth(data) > MAX_NESTING:  # walks the expansion: bounded just above
        raise ValueError(NESTED_TOO_DEEPLY)
    return data


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
