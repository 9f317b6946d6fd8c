"""Pure-torch models, parameterizations and FLOP accounting (imports nothing else of hptransfer).

The names below load on first use, so that `hptransfer.models.config` (the model's choices and
bounds) can be imported without torch: the CLI's client commands start faster for it.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .build import BuiltModel, build_from_config, build_model, table_for
    from .config import ForwardMultipliers, ModelConfig, ModelConfigError
    from .flops import FlopBreakdown, ParamCounts, flops_per_token, param_counts, training_flops
    from .parameterization import (
        Parameterization,
        ParameterizationError,
        ParamGroup,
        ParamTable,
        optimizer_groups,
    )

__all__ = [
    "BuiltModel", "FlopBreakdown", "ForwardMultipliers", "ModelConfig", "ModelConfigError",
    "ParamCounts", "ParamGroup", "ParamTable", "Parameterization", "ParameterizationError",
    "build_from_config", "build_model", "flops_per_token", "optimizer_groups", "param_counts",
    "table_for", "training_flops",
]


_SUBMODULES = ("config", "flops", "parameterization", "build")  # torch-free ones first


def __getattr__(name: str) -> Any:
    if name in __all__:
        for submodule in _SUBMODULES:
            module = import_module(f".{submodule}", __name__)
            if hasattr(module, name):
                globals()[name] = value = getattr(module, name)  # later lookups skip this
                return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
