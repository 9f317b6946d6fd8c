"""The Ray tasks the coordinator submits, as light entries: the coordinator makes its remote
functions from these without importing the trainer (and torch); each imports the worker code
it runs when it runs, on the worker. Their names and signatures are those of the functions
they run (remote.py, ray_train.py): Ray checks a call's arguments against them, and names a
worker's process after them (`ray::execute_trial`)."""

from __future__ import annotations

from typing import Any


def execute_trial(
    spec: dict[str, Any], trial_id: str, progress: Any | None, cache_dir: str | None,
    roots: list[str] | None = None, data_hash: str | None = None,
    checkpoint: dict[str, Any] | None = None, max_hours: float | None = None,
) -> dict[str, Any]:
    """remote.execute_trial."""
    from .remote import execute_trial as run

    return run(spec, trial_id, progress, cache_dir, roots=roots, data_hash=data_hash,
               checkpoint=checkpoint, max_hours=max_hours)


def execute_trials(
    specs: list[dict[str, Any]], trial_ids: list[str], progress: Any | None,
    cache_dir: str | None, roots: list[str] | None = None, data_hash: str | None = None,
    checkpoints: list[dict[str, Any] | None] | None = None, max_hours: float | None = None,
) -> list[dict[str, Any]]:
    """remote.execute_trials."""
    from .remote import execute_trials as run

    return run(specs, trial_ids, progress, cache_dir, roots=roots, data_hash=data_hash,
               checkpoints=checkpoints, max_hours=max_hours)


def execute_trial_on_workers(
    spec: dict[str, Any], trial_id: str, progress: Any | None, cache_dir: str | None,
    roots: list[str] | None, data_hash: str | None, *, workers: int, cpus: float,
    gpus: float, checkpoint: dict[str, Any] | None, storage_path: str, run_name: str,
    max_hours: float | None = None, shard: bool = False,
) -> dict[str, Any]:
    """ray_train.execute_trial_on_workers."""
    from .ray_train import execute_trial_on_workers as run

    return run(spec, trial_id, progress, cache_dir, roots, data_hash, workers=workers,
               cpus=cpus, gpus=gpus, checkpoint=checkpoint, storage_path=storage_path,
               run_name=run_name, max_hours=max_hours, shard=shard)
