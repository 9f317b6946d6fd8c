"""Pure-torch models, parameterizations and FLOP accounting (imports nothing else of hptransfer)."""

from .build import BuiltModel, build_from_config, build_model, table_for
from .config import ForwardMultipliers, ModelConfig, ModelConfigError
from .parameterization import (
    ParamGroup,
    Parameterization,
    ParameterizationError,
    ParamTable,
    optimizer_groups,
)

__all__ = [
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
