"""The sweep spec: pydantic models (`model`, `sections`), loading from YAML/JSON/paths
(`loading`) and field-named errors (`errors`)."""

from .model import (
    Arm,
    Fixed,
    Grid,
    LogRange,
    LrGrid,
    PositiveFloat,
    PositiveInt,
    Resources,
    Search,
    SpecError,
    SweepBudget,
    SweepSpec,
    load_spec,
    storable,
)

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
    "SweepSpec",
    "load_spec",
    "storable",
]
