"""Gloo ranks for the data-parallel and sharded tests (imported as a plain module: pytest
puts tests/ on sys.path): W processes with torch.distributed, each running `run_trial` as a
Ray Train worker does, without Ray's start-up. The reference against which the tests hold
Ray Train runs and one-process runs; the service itself only ever starts ranks through Ray
Train (workers/ray_train.py)."""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hptransfer.sockets import free_port

RTOL = 1e-4

# Ray Train's controller polls its workers every 2 s (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S), so
# it sees a run's end, or a killed worker, up to 2 s late (3-4 s on a loaded 2-core host);
# the tests' runs are polled every 0.25 s. A poll slower than that is waited on, not failed
# (Ray Train fails a worker after 10 minutes of them).
TRAIN_POLL_ENV, TRAIN_POLL_S = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25"

# The ranks are forks of one server process that has imported torch and the trainer (a fresh
# interpreter spends ~2.5 CPU-s on those imports, more than these trials train): the server
# starts with the first group, and every rank of every later group is a fork of it. Nothing
# of torch runs in the server (no threads to fork), and each rank sets up its own gloo group.
_RANKS = multiprocessing.get_context("forkserver")
_RANKS.set_forkserver_preload(["torch.distributed", "hptransfer.workers.checkpoints",
                               "hptransfer.workers.data_parallel",
                               "hptransfer.workers.trainer"])


def _rank(rank: int, world: int, port: str, spec: dict | list[dict], out: str, shard: bool,
          policy: str, stop_after: str, environ: dict[str, str]) -> None:
    """One rank; rank 1 may SIGTERM itself once `stop_after` (a glob) matches a file (a
    preemption notice reaching one worker). A list of specs: the group trains them one after
    another (one start-up for several trials), and rank 0 writes the list of their results."""
    import glob
    import signal
    import threading
    import time

    import torch.distributed as dist

    os.environ.clear()  # the caller's environment now, as a subprocess it started would have
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from hptransfer.workers.checkpoints import CheckpointPolicy
    from hptransfer.workers.data_parallel import DataParallel
    from hptransfer.workers.trainer import run_trial
    if stop_after and rank == 1:
        def stop() -> None:
            while not glob.glob(stop_after):
                time.sleep(0.002)
            os.kill(os.getpid(), signal.SIGTERM)
        threading.Thread(target=stop, daemon=True).start()
    results = [run_trial(one, parallel=DataParallel.current(shard=shard),
                         checkpoints=CheckpointPolicy(**json.loads(policy)) if policy else None)
               for one in (spec if isinstance(spec, list) else [spec])]
    if rank == 0:
        dumped = [r.model_dump_json() for r in results]
        Path(out).write_text(f"[{','.join(dumped)}]" if isinstance(spec, list) else dumped[0])
    # every rank done before any tears its group down (a rank leaving early can abort
    # another's gloo threads still closing the last collectives: "terminate called", SIGABRT
    # at exit); Ray Train's report() is that meeting point for its workers
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(spec: dict | list[dict], world: int, out: Path, *, shard: bool = False,
              policy: dict | None = None, stop_after: str = "") -> list[int]:
    """Train the trial (or each of a list, in turn) on `world` gloo ranks (rank 0 writes its
    result, or the list of them, to `out`); their exit codes (-15: ended by SIGTERM)."""
    port = str(free_port())
    ranks = [_RANKS.Process(target=_rank, args=(r, world, port, spec, str(out), shard,
                                                json.dumps(policy) if policy else "",
                                                stop_after, dict(os.environ)))
             for r in range(world)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(timeout=240)
    if any(p.exitcode is None for p in ranks):
        for p in ranks:
            p.kill()
        raise TimeoutError(f"gloo ranks still running after 240 s: {ranks}")
    return [p.exitcode for p in ranks]


def on_ranks(spec: dict, world: int, out: Path, *, shard: bool = False) -> dict:
    """Rank 0's result of the trial on `world` gloo ranks that all exit cleanly."""
    assert run_ranks(spec, world, out, shard=shard) == [0] * world
    return json.loads(out.read_text())


def on_ranks_each(specs: list[dict], world: int, out: Path, *,
                  shard: bool = False) -> list[dict]:
    """Rank 0's results of the trials, trained one after another by one group of `world`
    gloo ranks (one start-up of the ranks, not one per trial)."""
    assert run_ranks(specs, world, out, shard=shard) == [0] * world
    return json.loads(out.read_text())


def close(a: float, b: float) -> bool:
    return abs(a - b) <= RTOL * abs(b)


def assert_same_trial(parallel: dict, single) -> None:
    """W ranks trained what one process trained: curve and final validation loss within
    RTOL, the same steps, tokens and FLOPs."""
    assert parallel["status"] == single.status == "completed", parallel.get("error")
    assert close(parallel["final_val_loss"], single.final_val_loss)
    assert len(parallel["curve"]) == len(single.curve)
    for p, q in zip(parallel["curve"], single.curve, strict=True):
        assert p["step"] == q["step"] and close(p["train_loss"], q["train_loss"])
        if "val_loss" in q:
            assert close(p["val_loss"], q["val_loss"])
    assert (parallel["steps"], parallel["tokens"], parallel["flops"]) == (
        single.steps, single.tokens, single.flops)


def polling_quickly() -> Callable[..., dict[str, Any]]:
    """workers/ray_train.py's execute_trial_on_workers, for a Ray task (the dispatcher's
    way), with Ray Train's controller polling every TRAIN_POLL_S: set in the task's
    environment, which Ray Train hands on to its controller, and put back after (the Ray
    worker process runs other tasks later). A closure: Ray ships it by value (a Ray worker
    cannot import this module, which is not on its path); its name is the task's, as the
    dispatcher's is."""
    env, interval = TRAIN_POLL_ENV, TRAIN_POLL_S

    def execute_trial_on_workers(*args: Any, **kwargs: Any) -> dict[str, Any]:
        from hptransfer.workers import ray_train

        before = os.environ.get(env)
        os.environ[env] = interval
        try:
            return ray_train.execute_trial_on_workers(*args, **kwargs)
        finally:
            if before is None:
                del os.environ[env]
            else:
                os.environ[env] = before

    return execute_trial_on_workers
