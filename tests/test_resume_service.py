"""Checkpointed trials through the service, with real processes: a Ray worker killed
(SIGKILL) or preempted (SIGTERM) mid-trial, and the coordinator killed; each time the next
attempt resumes from the trial's latest checkpoint, says so on the row, re-trains less than
one checkpoint interval, and ends with the numbers of a run never interrupted (to the bit:
the CPU run is deterministic)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from test_resilience import (
    busy_workers,
    one_trial_spec,
    psutil,
    server,  # noqa: F401  (the fixture)
    servers,  # noqa: F401  (the fixture)
    trial_runs,
    trial_workers,
)
from waiting import wait_for

from hptransfer.client import Client
from hptransfer.store.store import Store
from hptransfer.workers.trainer import run_trial

EVERY = 100  # checkpoint interval, in steps
BATCH_TOKENS = 4 * 32  # the tiny spec's batch x seq_len


def checkpointed(spec: dict[str, Any], name: str) -> dict[str, Any]:
    spec = one_trial_spec(spec, name, steps=600, retries=1)
    spec["checkpoint"] = {"every_steps": EVERY}
    return spec


def reached(root: Path, sweep_id: str) -> int:
    """The furthest step the running attempt recorded (0 before its first record)."""
    marks = list((root / sweep_id).glob("*/reached"))
    return int(marks[0].read_text() or 0) if marks else 0


_uninterrupted: dict[str, Any] = {}


def uninterrupted(trial_spec: dict[str, Any]) -> Any:
    """The trial trained in this process, never stopped. The tests' trials share one spec
    (their sweeps differ only in name), so it is trained once for the module; the CPU run
    is deterministic, so a cached result is the one a new run would give."""
    key = json.dumps(trial_spec, sort_keys=True)
    if key not in _uninterrupted:
        _uninterrupted[key] = run_trial(trial_spec)
    return _uninterrupted[key]


def assert_resumed(done, killed_at: int, whole, preempted: bool = False) -> None:
    """`killed_at`: the furthest step the killed attempt had recorded (it lags the attempt
    by up to a second). A preempted attempt saves the step it stopped at; a killed one
    resumes at the last interval's checkpoint."""
    result = done.result
    assert done.status == "completed" and done.attempts == 2
    start = result["resumed_from_step"]
    if preempted:
        assert start >= killed_at and result["retrained_tokens"] == 0
    else:
        assert start and start % EVERY == 0 and start <= killed_at
    # killed just before the next checkpoint landed: exactly one interval again, never more
    assert result["retrained_tokens"] <= EVERY * BATCH_TOKENS
    assert result["final_val_loss"] == whole.final_val_loss  # to the bit
    assert [p["train_loss"] for p in result["curve"]] == [p["train_loss"] for p in whole.curve]


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_a_worker_killed_or_preempted_resumes_from_its_checkpoint(server, tiny_spec, how):  # noqa: F811
    url, settings = server
    root = Path(settings.checkpoint_root)
    store = Store(settings.database_url)
    busy = busy_workers()
    with Client(url) as c:
        sweep = c.submit(checkpointed(tiny_spec, f"resume-{how.name.lower()}"))
        wait_for(lambda: reached(root, sweep["id"]) > EVERY + 30, 180,
                 "the trial past its first checkpoint", poll=0.02)
        workers = [w for w in trial_workers(os.getpid()) if w.pid not in busy]
        assert len(workers) == 1
        workers[0].send_signal(how)
        psutil.wait_procs(workers, timeout=60)
        killed_at = reached(root, sweep["id"])
        final = c.wait(sweep["id"], poll=0.3, timeout=240, progress=False)
    wait_for(lambda: store.mirror_backlog(sweep["id"]) == 0, 60, "the MLflow mirror")
    done = store.trials(sweep["id"])[0]
    experiment_id = store.get_sweep(sweep["id"]).mlflow_experiment_id
    store.close()
    assert final["status"] == "completed"
    assert_resumed(done, killed_at, uninterrupted(done.spec), preempted=how == signal.SIGTERM)
    assert not (root / sweep["id"]).exists() or not list((root / sweep["id"]).rglob("*.ckpt"))
    # MLflow: the resumed attempt's run carries the whole curve, from step 1
    runs = trial_runs(settings.mlflow_uri, experiment_id)[done.id]
    resumed = runs[-1]
    assert resumed.data.tags["hpt.resumed_from_step"] == str(done.result["resumed_from_step"])


@pytest.mark.slow
def test_a_killed_coordinators_trial_resumes_from_its_checkpoint(hpt_home, servers,  # noqa: F811
                                                                   tiny_spec):
    first = servers(hpt_home)
    root = hpt_home / "checkpoints"
    with Client(first.url) as c:
        sweep_id = c.submit(checkpointed(tiny_spec, "resume-coordinator"))["id"]
    wait_for(lambda: reached(root, sweep_id) > EVERY + 30, 180,
             lambda: f"the trial past its first checkpoint:\n{first.log_tail()}", poll=0.02)
    first.kill()
    killed_at = reached(root, sweep_id)
    second = servers(hpt_home, port=first.port)
    with Client(second.url) as c:
        final = c.wait(sweep_id, poll=0.3, timeout=240, progress=False)
    store = Store(f"sqlite:///{hpt_home}/hpt.db")
    done = store.trials(sweep_id)[0]
    store.close()
    assert final["status"] == "completed", second.log_tail()
    assert_resumed(done, killed_at, uninterrupted(done.spec))
