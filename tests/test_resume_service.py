"""Checkpointed trials through the service, with real processes: a Ray worker killed
(SIGKILL) or preempted (SIGTERM) mid-trial, and the coordinator killed; each time the next
attempt resumes from the trial's latest checkpoint, says so on the row, re-trains less than
one checkpoint interval, and ends with the numbers of a run never interrupted (to the bit:
the CPU run is deterministic).

The coordinator (`hpt serve`, SIGKILLed with its Ray cluster and workers) is killed twice in
one module fixture, three `hpt serve` starts on one home where two tests would take four: the
first killed mid-sweep (a plain sweep: finished trials never re-run, the orphan re-run once,
the pending ones run once, MLflow's runs closed), the second, which finished that sweep,
killed while a checkpointed trial runs past its first checkpoint (it resumes from it)."""

from __future__ import annotations

import copy
import json
import os
import signal
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from conftest import TINY_SPEC
from test_resilience import (
    ServerProcess,
    busy_workers,
    one_trial_spec,
    psutil,
    server,  # noqa: F401  (the fixture)
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
    # long enough that `reached` (rewritten once a second) shows the trial past its first
    # checkpoint while it still runs on an idle host too: 600 steps (~1.2 s there) could
    # end within a second of the first mark, and the test waited for a trial already done
    spec = one_trial_spec(spec, name, steps=1800, retries=1)
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


def assert_resumed(done, seen_at: int, whole, preempted: bool = False) -> None:
    """`seen_at`: the `reached` mark read just after a kill (a retry resumes at or before
    it), or for a preemption just before the signal (the retry's own marks, written once it
    runs, may be further on by the time the test reads them after the exit). A preempted
    attempt saves the step it stopped at; a killed one resumes at the last interval's
    checkpoint."""
    result = done.result
    assert done.status == "completed" and done.attempts == 2
    start = result["resumed_from_step"]
    if preempted:
        assert start >= seen_at and result["retrained_tokens"] == 0
    else:
        assert start and start % EVERY == 0 and start <= seen_at
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
        before = reached(root, sweep["id"])
        workers[0].send_signal(how)
        psutil.wait_procs(workers, timeout=60)
        after = reached(root, sweep["id"])
        final = c.wait(sweep["id"], poll=0.3, timeout=240, progress=False)
    wait_for(lambda: store.mirror_backlog(sweep["id"]) == 0, 60, "the MLflow mirror")
    done = store.trials(sweep["id"])[0]
    experiment_id = store.get_sweep(sweep["id"]).mlflow_experiment_id
    store.close()
    assert final["status"] == "completed"
    preempted = how == signal.SIGTERM
    assert_resumed(done, before if preempted else after, uninterrupted(done.spec), preempted)
    assert not (root / sweep["id"]).exists() or not list((root / sweep["id"]).rglob("*.ckpt"))
    # MLflow: the resumed attempt's run carries the whole curve, from step 1
    runs = trial_runs(settings.mlflow_uri, experiment_id)[done.id]
    resumed = runs[-1]
    assert resumed.data.tags["hpt.resumed_from_step"] == str(done.result["resumed_from_step"])


# ------------------------------------------------------------------ coordinator killed


N_RESTART_TRIALS = 4


def restart_spec() -> dict[str, Any]:
    spec = copy.deepcopy(TINY_SPEC)
    spec.update(name="coordinator-restart", max_concurrent=1, retries=1, reuse=False)
    # all well-behaved; the kill lands as soon as one has completed while the next runs:
    # the new coordinator takes over one running and (with 4) two pending
    spec["grid"]["lrs"] = [2.0**-k for k in range(7, 7 + N_RESTART_TRIALS)]
    spec["budget"] = {"steps": 300, "batch_size": 4}  # 1-2 s each on one core
    spec["fixed"]["eval_every"] = 100
    # one trial per task, so some finish while another runs (packs: test_packed_dispatch.py)
    spec["resources"] = {"cpus": 1, "gpus": 0, "pack": 1}
    return spec


@dataclass
class Killed:
    """What the tests of the killed coordinators look at (the servers are gone by then)."""

    home: Path
    # the plain sweep: its rows just after the first kill and once the second server
    # finished it, their attempts and MLflow runs, its end and the second server's log
    killed_at: datetime
    before: dict[str, Any]
    after: dict[str, Any]
    attempts: dict[str, list[Any]]
    runs: dict[str, list[Any]]
    final: dict[str, Any]
    log: str
    # the checkpointed trial: the step its attempt had recorded at the second kill, its row
    # and its sweep's end under the third server, that server's log
    ckpt_killed_at: int
    ckpt_done: Any
    ckpt_final: dict[str, Any]
    ckpt_log: str


@pytest.fixture(scope="module")
def killed(module_hpt_home) -> Any:
    """`hpt serve` SIGKILLed while the plain sweep has a trial completed and one running; a
    new `hpt serve` on the same home and port finishes it, then is SIGKILLed itself while
    the checkpointed trial is past its first checkpoint; a third finishes that one."""
    home = module_hpt_home
    root = home / "checkpoints"
    started: list[ServerProcess] = []

    def start(port: int | None = None) -> ServerProcess:
        started.append(ServerProcess(home, port))
        started[-1].wait_ready()
        return started[-1]

    store = Store(f"sqlite:///{home}/hpt.db")
    try:
        first = start()
        with Client(first.url) as c:
            sweep_id = c.submit(restart_spec())["id"]

        def mid_sweep() -> bool:
            status = [t.status for t in store.trials(sweep_id, limit=None)]
            return status.count("completed") >= 1 and status.count("running") == 1

        wait_for(mid_sweep, 180, lambda: f"a completed and a running trial:\n{first.log_tail()}")
        first.kill()
        killed_at = datetime.now(UTC)
        before = {t.id: t for t in store.trials(sweep_id, limit=None)}

        second = start(port=first.port)  # same home, same port
        with Client(second.url) as c:
            final = c.wait(sweep_id, poll=0.3, timeout=240, progress=False)
            # MLflow mirrors the app DB shortly after: wait until it has caught up
            wait_for(lambda: store.mirror_backlog(sweep_id) == 0, 60, "the MLflow mirror",
                     poll=0.2)
            after = {t.id: t for t in store.trials(sweep_id, limit=None)}
            attempts = {tid: store.attempts(tid) for tid in after}
            runs = trial_runs(f"sqlite:///{home}/mlflow.db",
                              store.get_sweep(sweep_id).mlflow_experiment_id)
            log = second.log_tail()
            ckpt_id = c.submit(checkpointed(copy.deepcopy(TINY_SPEC),
                                            "resume-coordinator"))["id"]
        wait_for(lambda: reached(root, ckpt_id) > EVERY + 30, 180,
                 lambda: f"the trial past its first checkpoint:\n{second.log_tail()}",
                 poll=0.02)
        second.kill()
        ckpt_killed_at = reached(root, ckpt_id)
        third = start(port=first.port)
        with Client(third.url) as c:
            ckpt_final = c.wait(ckpt_id, poll=0.3, timeout=240, progress=False)
        ckpt_done, ckpt_log = store.trials(ckpt_id)[0], third.log_tail()
        third.kill(wait_for_port=False)  # idle from here: not left running the module's tests
        yield Killed(home=home, killed_at=killed_at, before=before, after=after,
                     attempts=attempts, runs=runs, final=final, log=log,
                     ckpt_killed_at=ckpt_killed_at, ckpt_done=ckpt_done,
                     ckpt_final=ckpt_final, ckpt_log=ckpt_log)
    finally:
        store.close()
        for server in started:
            server.kill(wait_for_port=False)


@pytest.mark.slow
def test_coordinator_killed_mid_sweep_resumes_without_rerunning(killed):
    before, after, final = killed.before, killed.after, killed.final
    done = {tid: t for tid, t in before.items() if t.status == "completed"}
    running = [t for t in before.values() if t.status == "running"]
    assert len(running) == 1, {t.id: t.status for t in before.values()}
    orphan = running[0]
    assert orphan.attempts == 1 and orphan.lease_owner
    assert {t.status for t in before.values()} <= {"completed", "running", "pending"}

    assert final["status"] == "completed", killed.log
    assert final["counts"]["completed"] == N_RESTART_TRIALS == final["total"]
    # no trial duplicated: the same rows, one per planned grid point
    assert set(after) == set(before)
    assert sorted(t.idx for t in after.values()) == list(range(N_RESTART_TRIALS))
    assert len({t.content_hash for t in after.values()}) == N_RESTART_TRIALS
    assert all(t.status == "completed" and t.error is None for t in after.values())

    # trials completed before the kill were never re-run: same row, same result
    for tid, old in done.items():
        new = after[tid]
        for key in ("finished_at", "started_at", "final_val_loss", "wall_time_s", "result",
                    "worker_node", "lease_owner", "attempts"):
            assert getattr(new, key) == getattr(old, key), (tid, key)
        assert new.attempts == 1

    # the orphan went back to pending, its interrupted attempt recorded but not charged to
    # its retries (requeue_orphans), then ran once under the new coordinator: attempts is 2,
    # as its attempt rows (and MLflow's runs) show
    new = after[orphan.id]
    killed_at = killed.killed_at
    assert new.attempts == 2 == len(killed.attempts[orphan.id]) and new.max_attempts == 2
    assert new.started_at > killed_at and new.finished_at > killed_at
    assert new.lease_owner != orphan.lease_owner
    assert new.final_val_loss is not None and new.result["status"] == "completed"
    # trials that were still pending ran once, under the new coordinator
    for tid, old in before.items():
        if old.status == "pending":
            assert after[tid].attempts == 1 and after[tid].started_at > killed_at

    # MLflow: exactly one completed run per trial; the pre-kill trials have no second run
    runs = killed.runs
    assert set(runs) == set(after)
    for tid, trial_runs_ in runs.items():
        completed = [r for r in trial_runs_ if r.data.tags.get("hpt.status") == "completed"]
        assert len(completed) == 1, (tid, [r.data.tags.get("hpt.status") for r in trial_runs_])
        assert completed[0].info.status == "FINISHED"
        assert completed[0].info.run_id == after[tid].mlflow_run_id
        if tid in done:
            assert len(trial_runs_) == 1
    # the attempt the dead coordinator left behind is closed, not shown running forever
    interrupted = [r for r in runs[orphan.id]
                   if r.info.run_id != after[orphan.id].mlflow_run_id]
    assert interrupted and all(r.info.status == "KILLED" for r in interrupted)


@pytest.mark.slow
def test_a_killed_coordinators_trial_resumes_from_its_checkpoint(killed):
    done = killed.ckpt_done
    assert killed.ckpt_final["status"] == "completed", killed.ckpt_log
    assert_resumed(done, killed.ckpt_killed_at, uninterrupted(done.spec))
