"""A trial over several data-parallel workers, run by Ray Train: a TorchTrainer of W workers
(DDP over NCCL on GPUs, gloo on CPUs; FSDP where the trial shards, sharding.py), each
running the same trainer (run_trial) on its rows of every global batch. Rank 0 reports
progress, evaluates and checkpoints; its result is the trial's.

The dispatcher runs `execute_trial_on_workers` as a Ray task (fit() blocks its caller, so not
on the coordinator's loop). A worker that dies ends the attempt as lost (Ray Train does not
restart the group itself: FailureConfig(max_failures=0)), so every attempt is a row the
coordinator counts and retries, and the retry resumes from the trial's latest checkpoint.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from hptransfer.contracts.status import LOST

from .checkpoints import CheckpointPolicy, open_root
from .data_parallel import DataParallel
from .remote import progress_channel, result_payload
from .trainer import run_trial

log = logging.getLogger(__name__)


COLLECTIVE_TIMEOUT_S = 600
RESULT_FILE = "result.json"


class TrialFailedOnWorker(RuntimeError):
    """A rank's trial failed (a Python error, not a lost process): raised so that Ray Train
    stops the whole group at once (the other ranks would wait in a collective), and carried
    back to the driver as the failed result it is."""

    def __init__(self, result: dict[str, Any]) -> None:
        super().__init__(result.get("error") or "the trial failed")
        self.result = result


def failed_result_in(exc: BaseException) -> dict[str, Any] | None:
    """The failed result a rank raised, from Ray Train's error (its worker failures)."""
    failures = getattr(exc, "worker_failures", None) or {}
    for failure in [exc, *failures.values()]:
        seen = failure
        while seen is not None:
            if isinstance(seen, TrialFailedOnWorker):
                return seen.result
            cause = getattr(seen, "cause", None)  # RayTaskError's original exception
            seen = cause if cause is not seen else None
    return None


def train_worker(config: dict[str, Any]) -> None:
    """One Ray Train worker's loop: its rank of the trial, then rank 0's result reported."""
    import ray.train

    parallel = DataParallel.current(shard=bool(config.get("shard")))
    leads = parallel is None or parallel.leads
    report = progress_channel(config["progress"] if leads else None)
    trial_id = config["trial_id"]
    policy = config["checkpoint"]
    result = run_trial(
        config["spec"], reporter=(lambda m: report(trial_id, m)) if leads else None,
        cache_dir=config["cache_dir"], roots=config["roots"], data_hash=config["data_hash"],
        checkpoints=CheckpointPolicy(**policy) if policy else None, parallel=parallel,
        max_hours=config.get("max_hours"))
    if result.status == "failed" and parallel is not None:
        raise TrialFailedOnWorker(result_payload(result))
    # every rank reports (Ray Train waits for all of them); rank 0's result travels as the
    # run's checkpoint, which is what Ray Train hands back to the driver
    if not leads:
        ray.train.report({"rank": parallel.rank if parallel else 0})
        return
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, RESULT_FILE).write_text(json.dumps(result_payload(result)))
        ray.train.report({"rank": 0}, checkpoint=ray.train.Checkpoint.from_directory(folder))


def execute_trial_on_workers(
    spec: dict[str, Any], trial_id: str, progress: Any | None, cache_dir: str | None,
    roots: list[str] | None, data_hash: str | None, *, workers: int, cpus: float,
    gpus: float, checkpoint: dict[str, Any] | None, storage_path: str, run_name: str,
    max_hours: float | None = None, shard: bool = False,
) -> dict[str, Any]:
    """Train one trial on `workers` Ray Train workers of `cpus` and `gpus` each (`shard`:
    the model sharded over them with FSDP, sharding.py; else DDP); its result as
    execute_trial returns one, or a lost outcome when a worker died."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    per_worker = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    trainer = _trainer_class(TorchTrainer)(
        train_worker,
        train_loop_config={"spec": spec, "trial_id": trial_id, "progress": progress,
                           "cache_dir": cache_dir, "roots": roots, "data_hash": data_hash,
                           "checkpoint": checkpoint, "max_hours": max_hours,
                           "shard": shard},
        # a rank that stops answering ends the group after this long, not gloo's 30 minutes
        torch_config=TorchConfig(backend="nccl" if gpus else "gloo",
                                 timeout_s=COLLECTIVE_TIMEOUT_S),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=bool(gpus),
                                     resources_per_worker=per_worker),
        run_config=RunConfig(name=run_name, storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=0)),
    )
    try:
        result = trainer.fit()
    except Exception as exc:  # noqa: BLE001 - a rank failed, or a worker died
        failed = failed_result_in(exc)
        if failed is not None:
            return failed
        log.warning("trial %s: Ray Train run %s ended: %s", trial_id, run_name, exc)
        return {"status": LOST, "error": f"{type(exc).__name__}: {exc}"[:4000]}
    checkpoint = result.checkpoint
    if checkpoint is None:
        return {"status": LOST, "error": "Ray Train finished without rank 0's result"}
    with checkpoint.as_directory() as folder:
        out = json.loads(Path(folder, RESULT_FILE).read_text())
    _forget_run(f"{storage_path}/{run_name}")
    return out


def _trainer_class(torch_trainer: type) -> type:
    """TorchTrainer without Ray Train's placement group cleaner. The cleaner, a detached
    actor per run, asks Ray's state API whether the run's controller lives; a cluster without
    a dashboard (the embedded default) has none, so it never cleans anything up, and every
    run's shutdown waits up to 12 s for it to stop. The coordinator removes the group of a
    run whose controller died itself (hptransfer.coordinator.placement_groups)."""

    class Trainer(torch_trainer):
        def _create_default_callbacks(self) -> list:
            return [c for c in super()._create_default_callbacks()
                    if type(c).__name__ != "PlacementGroupCleanerCallback"]

    return Trainer


def _forget_run(path: str) -> None:
    """The run's folder in Ray Train's storage (its result, now stored by the coordinator)."""
    try:
        filesystem, where = open_root(path)
        filesystem.delete_dir(where)
    except Exception as exc:  # noqa: BLE001 - a leftover folder is harmless
        log.info("could not remove Ray Train run folder %s: %s", path, exc)
