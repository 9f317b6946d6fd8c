"""The sweep spec: pydantic models (`sweep`, `sections`, `stages`; one trial is `trial`'s
TrialSpec, its data `data`'s DataSpec), loading from YAML/JSON/paths (`loading`) and
field-named errors (`errors`). The public names are `sweep.__all__`. Nothing here imports the
coordinator: `hptransfer.coordinator.plan` expands a validated spec into trials."""

from .sweep import *  # noqa: F403
from .sweep import __all__  # noqa: F401
