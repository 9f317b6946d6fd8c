"""Failure handling with real processes, no mocks: a Ray worker killed mid-trial, what a
coordinator killed between two writes left behind, and a Python exception inside training
(a coordinator process killed and restarted: test_resume_service.py).

Processes are only ever killed by id and only if this test started them: the `hpt serve`
subprocess with everything below it, or a Ray worker below this pytest process. Other Ray
clusters on the machine (other sessions' tests, demos) are never looked at.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import ray  # noqa: F401  (puts Ray's vendored psutil on sys.path)
from mlflow.tracking import MlflowClient
from waiting import wait_for

from hptransfer.api.server import free_port, serve_in_thread
from hptransfer.client import Client
from hptransfer.config import get_settings
from hptransfer.store.store import Store, TrialRecord

# Ray vendors psutil (ray/thirdparty_files); importable only once ray is imported.
psutil = importlib.import_module("psutil")

# Environment a subprocess server must not inherit: it gets its own HPT_HOME and Ray cluster.
FOREIGN_ENV = ("RAY_ADDRESS", "HPT_DATABASE_URL", "HPT_OPTUNA_URL", "MLFLOW_TRACKING_URI",
               "HPT_API_TOKEN", "HPT_PORT", "HPT_HOST")
WORKER_TITLE = "ray::execute_trial"  # Ray's process title while a worker runs the task


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def trial_workers(root_pid: int) -> list[Any]:
    """Ray workers below `root_pid` that are executing a trial right now."""
    found = []
    for proc in psutil.Process(root_pid).children(recursive=True):
        try:
            title = " ".join(proc.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if title.startswith(WORKER_TITLE):
            found.append(proc)
    return found


def exited(proc: Any) -> bool:
    """Gone, or a zombie: it has exited (its sockets, ports and files closed) and only waits
    for its parent or init to reap it."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def kill_tree(procs: list[Any]) -> None:
    """SIGKILL `procs`; return once every one has exited. Not psutil.wait_procs: for a
    process that is not our child it waits until the zombie is reaped, up to 1 s a pass
    (init reaps Ray's orphans only once their parent, the killed server, is reaped)."""
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    wait_for(lambda: all(exited(p) for p in procs), 30,
             lambda: f"killed processes to exit: {[p.pid for p in procs if not exited(p)]}",
             poll=0.02)


class ServerProcess:
    """`hpt serve` in its own session (process group) with its own in-process Ray cluster."""

    def __init__(self, home: Path, port: int | None = None) -> None:
        self.home = home
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = home.parent / f"serve-{self.port}-{time.time_ns()}.log"
        env = {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV}
        env.update(HPT_HOME=str(home), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "hptransfer.cli", "serve", "--port", str(self.port),
               "--log-level", "warning"]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self.killed = False

    def log_tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def wait_ready(self, timeout: float = 120) -> None:
        def up() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"hpt serve exited ({self.proc.returncode}):\n"
                                     f"{self.log_tail()}")
            try:
                return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(up, timeout, f"hpt serve on port {self.port}", poll=0.2)

    def kill(self, wait_for_port: bool = True) -> None:
        """SIGKILL the whole tree: the process group, and every descendant (Ray's workers run
        in sessions of their own); then wait until the port is free again. Idempotent."""
        if self.killed:
            return
        self.killed = True
        tree = []
        if self.proc.poll() is None:
            root = psutil.Process(self.proc.pid)
            tree = [root, *root.children(recursive=True)]
        try:
            # pgid == pid (start_new_session): Ray's gcs, raylet and agents are in the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        kill_tree(tree)
        self.proc.wait(30)
        if wait_for_port:
            wait_for(lambda: port_free(self.port), 30, f"port {self.port} to be free", poll=0.1)


@pytest.fixture
def servers() -> Iterator[Callable[..., ServerProcess]]:
    """Start `hpt serve` subprocesses; whatever is still alive is killed at teardown."""
    started: list[ServerProcess] = []

    def start(home: Path, port: int | None = None) -> ServerProcess:
        server = ServerProcess(home, port)
        started.append(server)
        server.wait_ready()
        return server

    yield start
    for server in started:
        server.kill(wait_for_port=False)


def trial_runs(mlflow_uri: str, experiment_id: str) -> dict[str, list[Any]]:
    """MLflow child runs of a sweep, by trial id, oldest first."""
    out: dict[str, list[Any]] = {}
    runs = MlflowClient(mlflow_uri).search_runs([experiment_id], order_by=["start_time ASC"])
    for run in runs:
        tid = run.data.tags.get("hpt.trial_id")
        if tid:
            out.setdefault(tid, []).append(run)
    return out


# ------------------------------------------------------------------ coordinator killed

# `hpt serve` killed mid-sweep and started again on the same home: test_resume_service.py
# (one module fixture kills a coordinator twice, for a plain sweep and a checkpointed one).


# ------------------------------------------------------------------ worker killed


def test_restart_reconciles_mlflow_with_what_the_dead_coordinator_half_wrote(
        hpt_home, ray_cluster, tiny_spec, monkeypatch):
    # The two windows the kill test above can hit only by chance. Trial A: the dead
    # coordinator stored A's result, then died before its mirror finished A's MLflow run.
    # Trial B: it leased B and its mirror created B's run, then died before the app DB learnt
    # the run id (the kill is a BaseException at that line: nothing after it runs).
    from hptransfer.coordinator.service import Coordinator
    from hptransfer.workers.remote import execute_trial

    class Killed(BaseException):
        pass

    tiny_spec.update(name="died-between-writes", max_concurrent=1, reuse=False)
    tiny_spec["grid"]["lrs"] = [2.0**-8, 2.0**-6]
    dead = Coordinator(get_settings())  # never started: this test drives its parts
    sweep = dead.submit(tiny_spec)
    (a,) = dead.store.lease_pending("dead-coordinator", 1, sweep_id=sweep["id"])
    dead.mirror.sync()  # the experiment, the parent run, A's run (recorded)
    experiment_id = dead.store.get_sweep(sweep["id"]).mlflow_experiment_id
    run_a = dead.store.get_trial(a.id).mlflow_run_id
    assert run_a
    (b,) = dead.store.lease_pending("dead-coordinator", 1, sweep_id=sweep["id"])
    real_record = Store.set_attempt_run

    def killed(self, trial_id, seq, run_id):
        raise Killed

    monkeypatch.setattr(Store, "set_attempt_run", killed)
    with pytest.raises(Killed):
        dead.mirror.sync()  # B's run is created; the kill comes before it is recorded
    monkeypatch.setattr(Store, "set_attempt_run", real_record)
    (lost_b,) = [r.info.run_id for r in trial_runs(get_settings().mlflow_uri,
                                                   experiment_id)[b.id]]
    assert dead.store.get_trial(b.id).mlflow_run_id is None
    result_a = execute_trial(a.spec, a.id, None, None)
    dead.store.finish_trial(a.id, "completed", result_a, None, result_a["worker_node"])
    a_before = dead.store.get_trial(a.id)

    second = Coordinator(get_settings())
    second.start()
    try:
        wait_for(lambda: second.store.get_sweep(sweep["id"]).status == "completed", 120,
                 "the re-queued trial to complete")
    finally:
        second.stop()  # its mirror's last pass
    assert second.store.mirror_backlog(sweep["id"]) == 0
    runs = {tid: {r.info.run_id: r for r in rs}
            for tid, rs in trial_runs(get_settings().mlflow_uri, experiment_id).items()}
    # A was not re-run; its one run now carries the stored result
    a_after = second.store.get_trial(a.id)
    assert a_after.finished_at == a_before.finished_at and a_after.attempts == 1
    assert set(runs[a.id]) == {run_a}
    assert runs[a.id][run_a].info.status == "FINISHED"
    assert runs[a.id][run_a].data.tags["hpt.status"] == "completed"
    assert runs[a.id][run_a].data.metrics["final_val_loss"] == pytest.approx(
        result_a["final_val_loss"])
    # B's lost attempt is found by its key and closed as KILLED (not duplicated, not left
    # RUNNING); B ran once more under the new coordinator
    b_after = second.store.get_trial(b.id)
    assert set(runs[b.id]) == {lost_b, b_after.mlflow_run_id}
    assert runs[b.id][lost_b].info.status == "KILLED"
    assert runs[b.id][lost_b].data.tags["hpt.status"] == "cancelled"
    assert runs[b.id][b_after.mlflow_run_id].info.status == "FINISHED"
    assert b_after.attempts == 2 and b_after.status == "completed"  # as MLflow's 2 runs
    assert [x.mlflow_run_id for x in second.store.attempts(b.id)] == [
        lost_b, b_after.mlflow_run_id]


@pytest.fixture
def server(hpt_home, ray_cluster) -> Iterator[tuple[str, Any]]:
    settings = get_settings()
    with serve_in_thread(settings) as url:
        yield url, settings


def one_trial_spec(spec: dict[str, Any], name: str, steps: int, retries: int) -> dict[str, Any]:
    spec.update(name=name, max_concurrent=1, retries=retries, reuse=False)
    spec["grid"]["lrs"] = [2.0**-8]
    spec["budget"] = {"steps": steps, "batch_size": 4}
    spec["fixed"]["eval_every"] = max(1, steps // 4)
    return spec


def busy_workers() -> set[int]:
    return {w.pid for w in trial_workers(os.getpid())}


def kill_worker_of_running_trial(store: Store, sweep_id: str,
                                 busy_before: set[int]) -> tuple[TrialRecord, int]:
    """Wait until the sweep's only trial runs in a Ray worker below this process (one not
    already busy before the submit: a task left by an earlier test is not ours); SIGKILL that
    worker. Returns the trial row as it was just before and the worker's pid."""
    trial = wait_for(lambda: store.trials(sweep_id, status="running"), 120,
                     "the trial to be leased")[0]

    def ours() -> list[Any]:
        return [w for w in trial_workers(os.getpid()) if w.pid not in busy_before]

    workers = wait_for(ours, 120, f"a {WORKER_TITLE} worker", poll=0.02)
    assert len(workers) == 1, [w.pid for w in workers]  # max_concurrent 1
    row = store.get_trial(trial.id)
    assert row.status == "running", row.status  # still running: the kill is mid-trial
    kill_tree(workers)
    return row, workers[0].pid


def test_killed_worker_is_retried_and_the_attempt_recorded(server, tiny_spec):
    url, settings = server
    store = Store(settings.database_url)
    busy = busy_workers()
    with Client(url) as c:
        sweep = c.submit(one_trial_spec(tiny_spec, "worker-killed", steps=1500, retries=1))
        row, pid = kill_worker_of_running_trial(store, sweep["id"], busy)
        assert row.attempts == 1 and row.max_attempts == 2

        # Back to pending (WorkerCrashedError is retryable), then leased again. The first
        # attempt's error stays on the row while the second attempt runs...
        retry = wait_for(lambda: (t := store.get_trial(row.id)).attempts == 2 and t,
                         60, "the second attempt")
        assert retry.status == "running", retry.status
        assert retry.error.startswith("WorkerCrashedError"), retry.error
        final = c.wait(sweep["id"], poll=0.3, timeout=120, progress=False)
        trials = c.trials(sweep["id"])
    wait_for(lambda: store.mirror_backlog(sweep["id"]) == 0, 60, "the MLflow mirror")
    experiment_id = store.get_sweep(sweep["id"]).mlflow_experiment_id
    done = store.get_trial(row.id)
    attempts = store.attempts(row.id)
    store.close()

    assert final["status"] == "completed" and final["counts"]["completed"] == 1
    assert done.status == "completed" and done.attempts == 2
    assert done.final_val_loss is not None
    assert not done.worker_node.endswith(f":{pid}")  # ran in a fresh worker
    # ...and is cleared by the successful one: a completed trial carries no error
    assert done.error is None
    assert trials.loc[0, "attempts"] == 2 and trials.loc[0, "status"] == "completed"

    # The killed attempt is its own MLflow run: FAILED, with the worker error as a tag
    runs = trial_runs(settings.mlflow_uri, experiment_id)[row.id]
    assert len(runs) == 2
    failed, ok = runs
    assert failed.info.status == "FAILED" and failed.data.tags["hpt.status"] == "failed"
    assert failed.data.tags["hpt.error"].startswith("WorkerCrashedError")
    assert [a.status for a in attempts] == ["failed", "completed"]
    assert failed.info.run_id == attempts[0].mlflow_run_id
    assert ok.info.status == "FINISHED" and ok.data.tags["hpt.status"] == "completed"
    assert ok.info.run_id == done.mlflow_run_id == attempts[1].mlflow_run_id


def test_killed_worker_without_retries_fails_the_trial(server, tiny_spec):
    url, settings = server
    store = Store(settings.database_url)
    busy = busy_workers()
    with Client(url) as c:
        sweep = c.submit(one_trial_spec(tiny_spec, "worker-killed-no-retry", steps=1500,
                                        retries=0))
        row, _ = kill_worker_of_running_trial(store, sweep["id"], busy)
        final = c.wait(sweep["id"], poll=0.3, timeout=60, progress=False)
    wait_for(lambda: store.mirror_backlog(sweep["id"]) == 0, 60, "the MLflow mirror")
    experiment_id = store.get_sweep(sweep["id"]).mlflow_experiment_id
    done = store.get_trial(row.id)
    store.close()

    assert done.status == "failed" and done.attempts == 1 == done.max_attempts
    assert done.error.startswith("WorkerCrashedError"), done.error
    assert done.result is None and done.finished_at is not None
    # a sweep whose every trial failed ends `failed`, saying so
    assert final["status"] == "failed" and final["counts"]["failed"] == 1
    assert final["error"].startswith("every trial failed (1)")
    run = trial_runs(settings.mlflow_uri, experiment_id)[row.id]
    assert len(run) == 1 and run[0].info.status == "FAILED"
    assert run[0].data.tags["hpt.error"].startswith("WorkerCrashedError")


# ------------------------------------------------------------------ exception in training


def corrupt_shard(path: Path, n_tokens: int = 400_000, bad_at: int = 380_500) -> Path:
    """A raw uint16 (nanoGPT) shard of byte-range tokens with one id >= 256 inside the fixed
    validation set. The submit-time check samples the first/last 16384 tokens and 8 windows in
    between (none covers `bad_at`), so the shard loads; the first evaluation reads the whole
    validation set and raises DataError inside run_trial."""
    tokens = np.random.default_rng(0).integers(0, 256, n_tokens).astype("<u2")
    tokens[bad_at] = 300
    tokens.tofile(path)
    return path


def test_exception_in_training_fails_at_once_with_traceback(server, tiny_spec, tmp_path):
    url, settings = server
    # 5% of 400k tokens is the validation split, starting at 380000; its first 1024 tokens
    # are the validation set, so token 380500 is in it
    data_root = settings.home / "data"  # the default data root: sources must be inside one
    data_root.mkdir(parents=True, exist_ok=True)
    shard = corrupt_shard(data_root / "corrupt_000.bin")
    spec = one_trial_spec(tiny_spec, "corrupt-shard", steps=20, retries=2)
    spec["data"] = {"source": str(shard), "vocab_size": 256, "val_tokens": 1024,
                    "val_fraction": 0.05}
    store = Store(settings.database_url)
    with Client(url) as c:
        sweep = c.submit(spec)  # accepted: the sampled token check passes
        final = c.wait(sweep["id"], poll=0.3, timeout=60, progress=False)
    wait_for(lambda: store.mirror_backlog(sweep["id"]) == 0, 60, "the MLflow mirror")
    experiment_id = store.get_sweep(sweep["id"]).mlflow_experiment_id
    (done,) = store.trials(sweep["id"], limit=None)
    store.close()

    # a Python exception is a final result, not a worker loss: no retry despite retries=2
    assert done.status == "failed" and done.attempts == 1 and done.max_attempts == 3
    error = done.error
    assert error.startswith("DataError: validation set contains token id 300 >= vocab_size=256")
    assert "Traceback (most recent call last)" in error and "in evaluate" in error
    # its files named by import path, not by where this server installed them
    assert 'File "hptransfer/workers/trainer.py"' in error and 'File "/' not in error
    assert done.result["status"] == "failed" and done.result["error"] == error
    assert final["status"] == "failed" and final["counts"]["failed"] == 1
    (run,) = trial_runs(settings.mlflow_uri, experiment_id)[done.id]
    assert run.info.status == "FAILED" and "DataError" in run.data.tags["hpt.error"]


# ------------------------------------------------------------------ a study killed while planning


def study_spec(spec: dict[str, Any], name: str) -> dict[str, Any]:
    spec = {**spec, "name": name, "max_concurrent": 2, "reuse": False}
    spec["grid"] = {**spec["grid"], "lrs": {"log2_min": -9, "log2_max": -3, "step": 2}}
    spec["budget"] = {"steps": 20, "batch_size": 4}
    spec["stages"] = {"tune": {"extend": 2},
                      "transfer": {"shapes": [{"width": 32, "depth": 2}]}, "check": {}}
    return spec


def test_study_planning_is_all_or_nothing_and_resumes_once(hpt_home, ray_cluster, tiny_spec):
    # The windows of a coordinator killed around planning a stage, made deterministic: a
    # "dead" coordinator runs the tune trials itself (no dispatcher), then
    #   A: dies before planning (its study waits with every planned trial finished),
    #   B: its planning transaction fails at commit (as if killed mid-write): nothing of
    #      the stage may remain; then it plans successfully and dies before running it.
    # A new coordinator must plan A's next stage exactly once and must not re-plan B's.
    from sqlalchemy import event

    from hptransfer.coordinator.service import Coordinator
    from hptransfer.coordinator.study import next_step
    from hptransfer.spec import SweepSpec
    from hptransfer.workers.remote import execute_trial

    dead = Coordinator(get_settings(), dispatch=False)
    sweeps = {w: dead.submit(study_spec(tiny_spec, f"study-{w}"))["id"] for w in "AB"}
    for sid in sweeps.values():
        for t in dead.store.lease_pending("dead-coordinator", 100, sweep_id=sid):
            r = execute_trial(t.spec, t.id, None, None)
            dead.store.finish_trial(t.id, r["status"], r, None, r["worker_node"])
    tune_rows = {sid: {t.id: t for t in dead.store.trials(sid, limit=None)}
                 for sid in sweeps.values()}

    sid_b = sweeps["B"]
    sweep_b = dead.store.get_sweep(sid_b)
    spec_b = SweepSpec.model_validate(sweep_b.spec)
    step = next_step(spec_b, sweep_b.study, dead.store.results_frame(sid_b))

    def killed_at_commit(conn: Any) -> None:
        raise RuntimeError("coordinator killed while planning")

    event.listen(dead.store.engine, "commit", killed_at_commit)
    try:
        with pytest.raises(RuntimeError, match="killed while planning"):
            dead.store.plan_stage(sid_b, 0, step.state, step.trials)
    finally:
        event.remove(dead.store.engine, "commit", killed_at_commit)
    after_crash = dead.store.get_sweep(sid_b)
    assert after_crash.study["round"] == 0 and after_crash.n_trials == len(tune_rows[sid_b])
    assert set(t.id for t in dead.store.trials(sid_b, limit=None)) == set(tune_rows[sid_b])
    assert dead.store.plan_stage(sid_b, 0, step.state, step.trials)  # planned, then "dies"
    planned_b = {t.id: t for t in dead.store.trials(sid_b, limit=None)}

    live = Coordinator(get_settings())
    live.start()
    try:
        wait_for(lambda: all(live.store.get_sweep(s).status in ("completed", "stopped")
                             for s in sweeps.values()), 240, "both studies to end")
    finally:
        live.stop()
    for w, sid in sweeps.items():
        sweep = live.store.get_sweep(sid)
        rows = live.store.trials(sid, limit=None)
        # nothing planned twice, nothing lost: one row per content hash, idx dense
        assert len({t.content_hash for t in rows}) == len(rows) == sweep.n_trials, w
        assert [t.idx for t in rows] == list(range(len(rows)))
        # the tune trials the dead coordinator finished were never re-run
        for tid, old in tune_rows[sid].items():
            new = next(t for t in rows if t.id == tid)
            assert (new.finished_at, new.attempts) == (old.finished_at, 1)
        if sweep.status == "stopped":
            assert sweep.error and "tune stage gave no η*" in sweep.error
            continue
        assert sweep.status == "completed" and sweep.study["done"]
        assert all(t.status in ("completed", "diverged") and t.attempts == 1
                   for t in rows)
        stages = [t.stage for t in rows]
        assert stages[: len(tune_rows[sid])] == ["tune"] * len(tune_rows[sid])
    # B's stage, planned before the "death", was taken over as it was: the same rows
    rows_b = {t.id for t in live.store.trials(sid_b, limit=None)}
    if live.store.get_sweep(sid_b).status == "completed" and step.kind == "plan":
        later = {tid for tid, t in planned_b.items() if t.stage != "tune"}
        assert later <= rows_b
    dead.store.close()
