"""The spec reference: every section of SweepSpec (and TrialSpec) from its pydantic schema."""

from __future__ import annotations

from typing import Any

from .schema import anchor, properties_table, referenced

INTRO = """# Spec reference

Generated from the pydantic models in `hptransfer/spec/` at every docs build. Specs are
YAML or JSON; every model rejects unknown keys and coerces nothing (no `true` for a number,
no `64.0` for an integer, no `"1"` for 1, no `NaN`/`Infinity`). Checks that span several
fields (widths divisible by `head_dim`, arch × parameterization pairs, the trial cap,
memory and FLOP admission) are described in [Writing a spec](../concepts/specs.md).
"""


def models_in_order(schema: dict[str, Any]) -> list[str]:
    """$defs in the order a reader meets them, walking from the root's fields."""
    defs = schema.get("$defs", {})
    order: list[str] = []
    queue = referenced(schema.get("properties", {}))
    while queue:
        name = queue.pop(0)
        if name in order or name not in defs:
            continue
        order.append(name)
        queue += referenced(defs[name].get("properties", {}))
    return order + sorted(set(defs) - set(order))


def used_at(schema: dict[str, Any]) -> dict[str, list[str]]:
    """For each $def, the field paths that hold it, e.g. Fixed -> ['fixed']."""
    defs = schema.get("$defs", {})
    paths: dict[str, list[str]] = {}

    def walk(model: dict[str, Any], prefix: str, depth: int) -> None:
        for field, node in model.get("properties", {}).items():
            path = f"{prefix}{field}"
            for name in dict.fromkeys(referenced(node)):
                paths.setdefault(name, []).append(path)
                if depth < 6 and name in defs:
                    walk(defs[name], path + ".", depth + 1)

    walk(schema, "", 0)
    return paths


def section(title: str, model_cls: Any, level: str = "##") -> str:
    schema = model_cls.model_json_schema()
    defs = schema.get("$defs", {})
    where = used_at(schema)
    parts = [f"{level} {title}", "", schema.get("description", "").strip(), "",
             properties_table(schema), ""]
    for name in models_in_order(schema):
        paths = ", ".join(f"`{p}`" for p in where.get(name, []))
        parts += [f"{level}# {name} {{ #{anchor(name)} }}", ""]
        if paths:
            parts += [f"Used at {paths}.", ""]
        doc = defs[name].get("description", "").strip()
        if doc:
            parts += [doc, ""]
        if defs[name].get("properties"):
            parts += [properties_table(defs[name]), ""]
    return "\n".join(parts)


def page() -> str:
    from hptransfer.spec import SweepSpec
    from hptransfer.spec.trial import TrialSpec

    sweep = section("SweepSpec", SweepSpec)
    # TrialSpec's sections share names with SweepSpec's; its page anchors get a prefix
    trial = section("TrialSpec", TrialSpec).replace("{ #", "{ #trial-").replace(
        "](#", "](#trial-")
    return "\n".join([
        INTRO,
        "A **sweep spec** is what `hpt submit`, `POST /sweeps` and `Client.submit` take.",
        "",
        sweep,
        "A **trial spec** is one trial, as `hpt train FILE` and `run_trial` take it; the "
        "coordinator expands every sweep into these.",
        "",
        trial,
    ])
