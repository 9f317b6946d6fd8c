"""Polling helpers shared by the tests that run real sweeps (imported as a plain module:
pytest puts tests/ on sys.path)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(check: Callable[[], Any], timeout: float, what: str | Callable[[], str],
             poll: float = 0.05) -> Any:
    """Poll `check` until it returns something truthy; return that. `what` may be a callable
    (evaluated only on timeout, e.g. to attach a server log)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            what = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def run_sweep(coordinator: Any, spec: dict[str, Any], timeout: float) -> str:
    """Start `coordinator`, submit `spec`, wait until the sweep completes, stop the
    coordinator (also on failure); the sweep's id."""
    coordinator.start()
    try:
        sweep_id = coordinator.submit(spec)["id"]
        wait_for(lambda: coordinator.store.get_sweep(sweep_id).status == "completed", timeout,
                 f"sweep {spec.get('name')!r} to complete")
    finally:
        coordinator.stop()
    return sweep_id
