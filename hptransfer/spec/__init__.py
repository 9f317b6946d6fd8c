"""The sweep spec: pydantic models (`sweep`, `sections`, `stages`; one trial is `trial`'s
TrialSpec, its data `data`'s DataSpec), loading from YAML/JSON/paths (`loading`) and
field-named errors (`errors`). The public names are `__all__`, from `sweep`. Nothing here
imports the coordinator: `hptransfer.coordinator.plan` expands a validated spec into trials."""

from __future__ import annotations

from typing import Any

# loaded from `sweep` on first use: `hptransfer.spec.text` (the spec reader the client shares)
# must not pull in the models and torch, which `sweep` imports
__all__ = [
    "Arm",
    "Fixed",
    "Grid",
    "LogRange",
    "LrGrid",
    "PositiveFloat",
    "PositiveInt",
    "Resources",
    "Search",
    "SpecError",
    "SweepBudget",
    "Stages",
    "SweepSpec",
    "load_spec",
    "storable",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import sweep

        return getattr(sweep, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
