"""The sweep coordinator: spec, plan, store, dispatch and tracking of hyper-parameter sweeps."""
