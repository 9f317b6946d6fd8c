"""Pure-torch models, parameterizations and FLOP accounting (imports nothing else of hptransfer)."""

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
    "FlopBreakdown",
    "ParamCounts",
    "flops_per_token",
    "param_counts",
    "training_flops",
    "BuiltModel",
    "ForwardMultipliers",
    "ModelConfig",
    "ModelConfigError",
    "ParamGroup",
    "ParamTable",
    "Parameterization",
    "ParameterizationError",
    "build_from_config",
    "build_model",
    "table_for",
    "optimizer_groups",
]
