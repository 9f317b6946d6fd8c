"""The functions a Ray worker runs: one trial (run_trial) or a pack of trials of one shape
(run_trials), plus a progress side channel.

`progress` is any object with a Ray-actor-like `report.remote(trial_id, metrics)` returning
an ObjectRef of bool (stop requested) or None (ask `verdict.remote(trial_id)` for the
pruner's verdict: hptransfer.coordinator.progress). The side channel must never hang or
kill a trial: if it fails or is slow, training carries on and only live metrics are lost
(the final result still carries the whole curve). A pack's members report under their own trial ids;
a pack split for memory hands each group's results over as that group finishes
(`ProgressBoard.deliver`).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from hptransfer.spec.trial import TrialResult

from .checkpoints import CheckpointPolicy
from .packed import run_trials
from .trainer import run_trial

log = logging.getLogger(__name__)
_REPORT_TIMEOUT_S = 5.0
# a trial gated for pruning waits this long at most for the coordinator to judge its point
# (a coordinator restarting or stalled must not hold training up for long)
_VERDICT_WAIT_S = 20.0
_VERDICT_POLL_S = 0.05


def progress_channel(progress: Any | None) -> Callable[[str, dict[str, Any]], bool]:
    """report(trial_id, metrics) -> stop requested; after one failure it stops reporting.
    A point the board answers None (the trial's pruning gate) waits up to _VERDICT_WAIT_S for
    the pruner's verdict; a verdict that does not come in time is taken as "train on"."""
    import ray

    ok = progress is not None

    def report(trial_id: str, metrics: dict[str, Any]) -> bool:
        nonlocal ok
        if not ok:
            return False
        try:
            stop = ray.get(progress.report.remote(trial_id, metrics), timeout=_REPORT_TIMEOUT_S)
            deadline = time.monotonic() + _VERDICT_WAIT_S
            while stop is None and time.monotonic() < deadline:
                time.sleep(_VERDICT_POLL_S)
                stop = ray.get(progress.verdict.remote(trial_id), timeout=_REPORT_TIMEOUT_S)
            if stop is None:
                log.warning("no pruning verdict for trial %s after %.0f s: training on",
                            trial_id, _VERDICT_WAIT_S)
            return bool(stop)
        except Exception as exc:  # dead or slow actor: keep training, stop reporting
            log.warning("progress channel failed for trial %s: %s", trial_id, exc)
            ok = False
            return False

    return report


def result_payload(result: TrialResult) -> dict[str, Any]:
    import ray

    out = result.model_dump(mode="json")
    out["worker_node"] = f"{socket.gethostname()}:{os.getpid()}"
    # several Ray nodes can share a host: the node id says which one ran the trial
    out["ray_node_id"] = ray.get_runtime_context().get_node_id()
    return out


def execute_trial(
    spec: dict[str, Any], trial_id: str, progress: Any | None, cache_dir: str | None,
    roots: list[str] | None = None, data_hash: str | None = None,
    checkpoint: dict[str, Any] | None = None, max_hours: float | None = None,
) -> dict[str, Any]:
    """`roots`, `data_hash`: the server's data roots and the sweep's data hash, which the
    worker checks again (plan.load_trial_data). `checkpoint`: a CheckpointPolicy's fields
    (the trial checkpoints, and resumes from its latest checkpoint). `max_hours`: the
    server's wall-time ceiling of an attempt."""
    report = progress_channel(progress)
    result = run_trial(spec, reporter=lambda m: report(trial_id, m), cache_dir=cache_dir,
                       roots=roots, data_hash=data_hash,
                       checkpoints=CheckpointPolicy(**checkpoint) if checkpoint else None,
                       max_hours=max_hours)
    return result_payload(result)


def execute_trials(
    specs: list[dict[str, Any]], trial_ids: list[str], progress: Any | None,
    cache_dir: str | None, roots: list[str] | None = None, data_hash: str | None = None,
    checkpoints: list[dict[str, Any] | None] | None = None, max_hours: float | None = None,
) -> list[dict[str, Any]]:
    """One result per spec, in order (members of one shape, trained packed; `checkpoints`:
    each member's policy, `max_hours` as execute_trial's). A pack split
    for memory delivers each group's results to `progress` as the group finishes, so they
    outlive this task should it die training a later group."""
    report = progress_channel(progress)

    def deliver(i: int, result: TrialResult) -> None:
        import ray

        try:  # waited for: delivered before the next group can take the worker down
            ray.get(progress.deliver.remote(trial_ids[i], result_payload(result)),
                    timeout=_REPORT_TIMEOUT_S)
        except Exception as exc:  # the return value still carries it
            log.warning("could not deliver trial %s's result early: %s", trial_ids[i], exc)

    results = run_trials(specs, reporter=lambda i, m: report(trial_ids[i], m),
                         cache_dir=cache_dir, on_result=deliver if progress else None,
                         roots=roots, data_hash=data_hash, max_hours=max_hours,
                         checkpoints=None if checkpoints is None else
                         [CheckpointPolicy(**c) if c else None for c in checkpoints])
    return [result_payload(r) for r in results]
