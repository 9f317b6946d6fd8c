"""The sweep coordinator: spec, plan, store, dispatch and tracking of hyper-parameter sweeps."""

from hptransfer.config import prepare_ray_environment

prepare_ray_environment()  # must run before any submodule imports ray
