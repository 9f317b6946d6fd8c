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
    default_max_trials,
    load_spec,
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
    "default_max_trials",
    "load_spec",
]
