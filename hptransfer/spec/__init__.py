"""The sweep spec: pydantic models (`model`, `sections`, `stages`), loading from YAML/JSON/paths
(`loading`) and field-named errors (`errors`). The public names are `model.__all__`."""

from .sweep import *  # noqa: F403
from .sweep import __all__  # noqa: F401
