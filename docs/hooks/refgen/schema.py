"""JSON-schema objects as Markdown tables: type, default and bounds of every property."""

from __future__ import annotations

import json
from typing import Any

# JSON-schema keyword -> how its bound reads
_BOUNDS = (
    ("minimum", "≥ {}"),
    ("exclusiveMinimum", "> {}"),
    ("maximum", "≤ {}"),
    ("exclusiveMaximum", "< {}"),
    ("minLength", "at least {} chars"),
    ("maxLength", "at most {} chars"),
    ("minItems", "at least {} items"),
    ("maxItems", "at most {} items"),
    ("maxProperties", "at most {} entries"),
)


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def anchor(name: str) -> str:
    return name.lower().replace("_", "-").replace(" ", "-")


def type_of(node: dict[str, Any], link: bool = True) -> str:
    """A short type expression, e.g. `list[int]`, `Fixed`, `"grid" | "optuna"`."""
    if "$ref" in node:
        name = ref_name(node["$ref"])
        return f"[{name}](#{anchor(name)})" if link else name
    if "const" in node:
        return json.dumps(node["const"])
    if "enum" in node:
        return " | ".join(json.dumps(v) for v in node["enum"])
    for key in ("anyOf", "oneOf", "allOf"):
        if key in node:
            return " | ".join(type_of(n, link) for n in node[key])
    kind = node.get("type", "any")
    if kind == "array":
        return f"list[{type_of(node.get('items', {}), link)}]"
    if kind == "object" and "additionalProperties" in node:
        extra = node["additionalProperties"]
        value = type_of(extra, link) if isinstance(extra, dict) else "any"
        return f"dict[str, {value}]"
    return {"integer": "int", "number": "float", "string": "str", "boolean": "bool",
            "null": "null"}.get(kind, str(kind))


def bounds_of(node: dict[str, Any]) -> str:
    """Bounds of a value and, for a list or dict, of its items."""
    parts = [fmt.format(_number(node[key])) for key, fmt in _BOUNDS if key in node]
    for sub in node.get("anyOf", []) + node.get("oneOf", []):
        inner = bounds_of(sub)
        if inner:
            parts.append(inner)
    items = node.get("items") or node.get("additionalProperties")
    if isinstance(items, dict):
        inner = bounds_of(items)
        if inner:
            parts.append(f"each {inner}")
    names = node.get("propertyNames")
    if isinstance(names, dict) and bounds_of(names):
        parts.append(f"keys {bounds_of(names)}")
    return ", ".join(parts)


def _number(value: Any) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value)) if abs(value) >= 1e4 else repr(value)
    return repr(value) if isinstance(value, float) else str(value)


def default_of(name: str, node: dict[str, Any], required: set[str]) -> str:
    if name in required:
        return "**required**"
    if "default" not in node:
        return ""
    value = node["default"]
    if isinstance(value, dict) and value and "$ref" in json.dumps(node):
        return "its section's defaults"
    return f"`{json.dumps(value, ensure_ascii=False)}`"


def properties_table(model: dict[str, Any]) -> str:
    """One row per property of an object schema."""
    required = set(model.get("required", []))
    rows = ["| field | type | default | bounds |", "|---|---|---|---|"]
    for name, node in model.get("properties", {}).items():
        note = node.get("description", "")
        field = f"`{name}`" + (f"<br>{cell(note)}" if note else "")
        rows.append(f"| {field} | {cell(type_of(node))} | {cell(default_of(name, node, required))}"
                    f" | {cell(bounds_of(node))} |")
    return "\n".join(rows)


def referenced(node: Any) -> list[str]:
    """Names of the $defs a schema node refers to, in order of appearance."""
    found: list[str] = []
    if isinstance(node, dict):
        if "$ref" in node:
            found.append(ref_name(node["$ref"]))
        for value in node.values():
            found += referenced(value)
    elif isinstance(node, list):
        for value in node:
            found += referenced(value)
    return found
