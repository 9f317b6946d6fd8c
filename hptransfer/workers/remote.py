"""The function a Ray worker runs for one trial: run_trial plus a progress side channel.

`progress` is any object with a Ray-actor-like `report.remote(trial_id, metrics)` returning
an ObjectRef of bool (stop requested). The side channel must never hang or kill a trial:
if it fails or is slow, training carries on and only live metrics are lost (the final
result still carries the whole curve).
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from .trainer import run_trial

log = logging.getLogger(__name__)
_REPORT_TIMEOUT_S = 5.0


def execute_trial(
    spec: dict[str, Any], trial_id: str, progress: Any | None, cache_dir: str | None
) -> dict[str, Any]:
    import ray

    channel_ok = progress is not None

    def reporter(metrics: dict[str, Any]) -> bool:
        nonlocal channel_ok
        if not channel_ok:
            return False
        try:
            ref = progress.report.remote(trial_id, metrics)
            return bool(ray.get(ref, timeout=_REPORT_TIMEOUT_S))
        except Exception as exc:  # dead or slow actor: keep training, stop reporting
            log.warning("progress channel failed for trial %s: %s", trial_id, exc)
            channel_ok = False
            return False

    result = run_trial(spec, reporter=reporter, cache_dir=cache_dir)
    out = result.model_dump(mode="json")
    out["worker_node"] = f"{socket.gethostname()}:{os.getpid()}"
    # several Ray nodes can share a host: the node id says which one ran the trial
    out["ray_node_id"] = ray.get_runtime_context().get_node_id()
    return out
