"""The MLflow mirror against a real MLflow (SQLite store in tmp_path) and a real app database.

The app database is the only writer of trial state; these tests check what the mirror copies
to MLflow, and that copying is idempotent: run twice, MLflow down then back, a kill between
creating a run and recording it, or mid-way through finishing one, all converge to the same
MLflow content with no duplicate run, no duplicate metric point and no RUNNING orphan.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient
from sqlalchemy import text

from hptransfer.contracts.mlflow_keys import MAX_KEY, mlflow_key
from hptransfer.contracts.records import AttemptRecord
from hptransfer.store.store import Store, TrialRecord
from hptransfer.tracking import mirror as mirror_module
from hptransfer.tracking.mirror import Mirror
from hptransfer.tracking.params import MAX_PARAM_VALUE, flatten
from hptransfer.tracking.tracking import ui_command

SWEEP_SPEC: dict[str, Any] = {
    "name": "demo",
    "arms": [{"name": "sp", "parameterization": "sp"},
             {"name": "cp", "parameterization": "completep"}],
    "grid": {"lr": [2**-8, 2**-6], "width": [64, 128]},
    "tags": {"owner": "tests"},
    "notes": "x" * 7000,  # longer than MLflow's 6000-character param limit
    "k" * 300: 1,  # longer than MLflow's 250-character key limit
}


class Killed(BaseException):
    """Stands for a SIGKILL at that line: nothing after it runs, no handler sees it."""


@dataclass(frozen=True)
class Planned:
    arm: str
    trial: dict[str, Any]
    width: int
    depth: int
    lr: float
    sigma_base: float
    seed: int
    content_hash: str


def trial_spec(lr: float, width: int = 128, seed: int = 0) -> dict[str, Any]:
    return {"arch": "gpt", "parameterization": "completep", "width": width, "depth": 2,
            "lr": lr, "seed": seed, "budget": {"tokens": None, "steps": 40},
            "arch_options": {"activation": "relu2", "mlp_ratio": 4}}


def curve(n: int, val_every: int = 10, start: int = 1) -> list[dict[str, Any]]:
    out = []
    for step in range(start, start + n):
        point: dict[str, Any] = {"step": step, "tokens": step * 2048,
                                 "train_loss": 5.0 - step * 1e-3, "lr": 1e-3}
        if step % val_every == 0:
            point["val_loss"] = 5.5 - step * 1e-3
        out.append(point)
    return out


def param_table(lr: float) -> dict[str, Any]:
    group = {"params": ["a.weight", "b.weight"], "init": "normal", "init_std": 0.02,
             "weight_decay": 0.1, "eps": 1e-12}
    return {
        "parameterization": "completep", "alpha": 1.0, "m_width": 2.0, "m_depth": 1.0,
        "groups": [{"name": "embedding", **group, "lr": lr, "params": ["embed.weight"]},
                   {"name": "hidden_weight", **group, "lr": lr / 2}],
        "multipliers": {"residual": 1.0, "logits": 0.5, "attn_scale": 0.125},
        "notes": [],
    }


def result(status: str, lr: float, points: list[dict[str, Any]],
           error: str | None = None) -> dict[str, Any]:
    return {
        "status": status, "final_val_loss": points[-1].get("val_loss"), "final_train_loss": 4.9,
        "curve": points, "steps": points[-1]["step"], "tokens": points[-1]["tokens"],
        "flops": 1.5e12, "flops_per_token": 6e6, "params_embedding": 1000,
        "params_non_embedding": 250_000, "wall_time_s": 12.5, "tokens_per_s": 6553.6,
        "mfu": None, "device": "cpu", "param_table": param_table(lr), "error": error, "notes": [],
    }


@pytest.fixture
def mlflow_uri(tmp_path: Path, mlflow_template: Path) -> str:
    db = tmp_path / "mlflow.db"
    shutil.copy(mlflow_template, db)  # conftest's: MLflow's schema, made once
    return f"sqlite:///{db}"


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(f"sqlite:///{tmp_path / 'hpt.db'}")
    s.migrate()
    yield s
    s.close()


def new_sweep(store: Store, lrs: tuple[float, ...] = (2**-8, 2**-6, 2**-7)) -> str:
    planned = [Planned("cp", trial_spec(lr), 128, 2, lr, 0.02, 0, f"h{i}")
               for i, lr in enumerate(lrs)]
    return store.create_sweep(name="demo", spec=SWEEP_SPEC, spec_hash="h", search="grid",
                              planned=planned, reuse=False)


def mirror_of(store: Store, uri: str, tmp_path: Path, **kw: Any) -> Mirror:
    return Mirror(store, uri, str(tmp_path / "artifacts"), **kw)


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def trial_runs(client: MlflowClient, experiment_id: str) -> list[Any]:
    return client.search_runs([experiment_id], "tags.`hpt.role` = 'trial'")


def artifact_paths(client: MlflowClient, run_id: str, path: str | None = None) -> set[str]:
    return {a.path for a in client.list_artifacts(run_id, path)}


def read_artifact(client: MlflowClient, run_id: str, path: str, tmp_path: Path) -> str:
    dst = tmp_path / "download"
    dst.mkdir(exist_ok=True)
    return Path(client.download_artifacts(run_id, path, str(dst))).read_text()


def finish_all(store: Store, sweep_id: str, trials: list[TrialRecord]) -> dict[str, str]:
    """completed / failed (an exception in training) / cancelled, one each."""
    statuses = dict(zip([t.id for t in trials], ("completed", "failed", "cancelled"),
                        strict=True))
    for t in trials:
        status = statuses[t.id]
        if status == "cancelled":
            assert store.mark_cancelled(t.id)
            continue
        error = "Traceback ...\n" + "e" * 5000 + "\nRuntimeError: boom" \
            if status == "failed" else None
        assert store.finish_trial(t.id, status, result(status, t.lr, curve(40), error),
                                  error)
    store.refresh_sweep_status(sweep_id)
    return statuses


FITS = {"fits/fit.json": json.dumps({"alpha": 0.35}), "fits/frontier.png": b"\x89PNG\r\n"}


def test_mirror_copies_sweeps_and_attempts(store: Store, mlflow_uri: str,
                                           tmp_path: Path) -> None:
    sid = new_sweep(store)
    # a hook's artifact outside the run is skipped; the others and the run's end are not
    mirror = mirror_of(store, mlflow_uri, tmp_path,
                       artifacts=lambda _: {**FITS, "../escape.txt": "x"})
    mirror.sync()
    sweep = store.get_sweep(sid)
    experiment_id, parent_id = sweep.mlflow_experiment_id, sweep.mlflow_run_id
    client = MlflowClient(mlflow_uri)
    exp = client.get_experiment(experiment_id)
    assert exp.name == f"hpt/demo/{sid}" and exp.tags["mlflow.experimentKind"] == \
        "custom_model_development"
    assert str(tmp_path / "artifacts") in exp.artifact_location
    assert client.get_run(parent_id).info.status == "RUNNING"

    trials = store.lease_pending("coord", 3)
    mirror.sync()
    running = trial_runs(client, experiment_id)
    assert len(running) == 3 and {r.info.status for r in running} == {"RUNNING"}
    statuses = finish_all(store, sid, trials)
    mirror.sync()
    assert store.mirror_backlog() == 0

    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["hpt.status"] == "completed" and parent.data.tags["owner"] == "tests"
    assert parent.data.params["grid.lr"] == json.dumps([2**-8, 2**-6])
    assert parent.data.params["arms.1.parameterization"] == "completep"
    assert len(parent.data.params["notes"]) == MAX_PARAM_VALUE
    assert all(len(k) <= MAX_KEY for k in parent.data.params)
    assert artifact_paths(client, parent_id) == {"sweep_spec.json", "fits"}
    assert artifact_paths(client, parent_id, "fits") == {"fits/fit.json", "fits/frontier.png"}
    spec_back = json.loads(read_artifact(client, parent_id, "sweep_spec.json", tmp_path))
    assert spec_back["grid"] == SWEEP_SPEC["grid"]

    runs = {r.data.tags["hpt.trial_id"]: r for r in trial_runs(client, experiment_id)}
    assert set(runs) == set(statuses)
    expected = {"completed": "FINISHED", "failed": "FAILED", "cancelled": "KILLED"}
    for t in trials:
        run, status = runs[t.id], statuses[t.id]
        tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
        assert run.info.status == expected[status]
        assert run.info.run_id == store.get_trial(t.id).mlflow_run_id
        assert run.info.run_name == f"cp N=128 L=2 lr={t.lr:.3g} seed=0"
        assert tags["mlflow.parentRunId"] == parent_id and tags["hpt.attempt"] == "1"
        assert tags["hpt.sweep_id"] == sid and tags["hpt.arm"] == "cp"
        assert tags["hpt.status"] == status
        assert params["budget.steps"] == "40" and params["arch_options.mlp_ratio"] == "4"
        if status == "cancelled":  # never produced a result: no table, no curve
            assert "group.embedding.lr" not in params and metrics == {}
            continue
        assert params["group.embedding.lr"] == str(t.lr)
        assert params["group.hidden_weight.lr"] == str(t.lr / 2)
        assert params["group.hidden_weight.n_params"] == "2"
        assert params["mult.logits"] == "0.5" and params["mult.attn_scale"] == "0.125"
        assert history(client, run.info.run_id, "val_loss") == [
            (s, pytest.approx(5.5 - s * 1e-3)) for s in (10, 20, 30, 40)]
        assert [s for s, _ in history(client, run.info.run_id, "train_loss")] == \
            list(range(1, 41))
        assert [s for s, _ in history(client, run.info.run_id, "tokens")] == list(range(1, 41))
        assert metrics["final_val_loss"] == pytest.approx(5.46)
        assert metrics["flops"] == 1.5e12 and metrics["params_non_embedding"] == 250_000
        assert metrics["tokens_per_s"] == pytest.approx(6553.6) and "mfu" not in metrics
        table = json.loads(read_artifact(client, run.info.run_id, "param_table.json", tmp_path))
        assert table["groups"][1]["lr"] == t.lr / 2
        if status == "failed":
            assert tags["hpt.error"].endswith("RuntimeError: boom")
            assert len(tags["hpt.error"]) <= 4000
        else:
            assert "hpt.error" not in tags


def snapshot(client: MlflowClient, experiment_id: str) -> dict[str, Any]:
    """Everything a user sees of a sweep's trial runs, to compare before/after a re-sync."""
    out = {}
    for run in trial_runs(client, experiment_id):
        rid = run.info.run_id
        out[rid] = (run.info.status, run.data.tags.get("hpt.status"),
                    {k: len(client.get_metric_history(rid, k)) for k in run.data.metrics})
    return out


def test_sync_twice_and_live_points_add_nothing(store: Store, mlflow_uri: str, tmp_path: Path,
                                                monkeypatch: Any) -> None:
    sizes: list[int] = []
    real_batch = MlflowClient.log_batch

    def log_batch(self: MlflowClient, run_id: str, metrics: Any = (), params: Any = (),
                  tags: Any = (), **kw: Any) -> Any:
        sizes.append(len(metrics) + len(params) + len(tags))  # MLflow's limit counts them all
        return real_batch(self, run_id, metrics, params, tags, **kw)

    monkeypatch.setattr(MlflowClient, "log_batch", log_batch)
    sid = new_sweep(store, (2**-8,))
    mirror = mirror_of(store, mlflow_uri, tmp_path)
    mirror.sync()
    (t,) = store.lease_pending("coord", 1)
    mirror.sync()
    points = curve(500, val_every=1)  # 4 metrics x 500 steps = 2000 metrics
    mirror.live(t.id, t.started_at, points[:300])  # streamed while training
    mirror.sync()
    run_id = store.get_trial(t.id).mlflow_run_id
    client = MlflowClient(mlflow_uri)
    assert [s for s, _ in history(client, run_id, "train_loss")] == list(range(1, 301))
    store.finish_trial(t.id, "completed", result("completed", 2**-8, points))
    store.refresh_sweep_status(sid)
    sizes.clear()
    mirror.sync()
    assert max(sizes) <= 1000  # curves go in log_batch calls of at most 1000 entities
    experiment_id = store.get_sweep(sid).mlflow_experiment_id
    first = snapshot(client, experiment_id)
    for key in ("train_loss", "val_loss", "lr", "tokens"):  # live + final: each point once
        assert [s for s, _ in history(client, run_id, key)] == list(range(1, 501)), key

    # the same rows copied again (their markers reset, as after a lost write): no change
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE attempts SET mlflow_synced_status = NULL, "
                          "mlflow_run_id = NULL"))
        conn.execute(text("UPDATE sweeps SET mlflow_synced_status = NULL"))
    assert store.mirror_backlog() == 2
    again = mirror_of(store, mlflow_uri, tmp_path)
    again.sync()
    again.sync()
    assert store.mirror_backlog() == 0
    assert snapshot(client, experiment_id) == first
    assert store.get_trial(t.id).mlflow_run_id == run_id


def test_a_pass_writes_each_runs_queued_points_and_its_end_in_one_call(
        store: Store, mlflow_uri: str, tmp_path: Path, monkeypatch: Any) -> None:
    """Live points queued by several drains of the progress board go to MLflow in one
    log_batch per run, and a finished attempt's status tags travel with its curve: each
    call is a round trip and a transaction (an HTTP request to a tracking server)."""
    calls: list[tuple[str, int, int, int]] = []  # run, metrics, params, tags
    real_batch = MlflowClient.log_batch

    def log_batch(self: MlflowClient, run_id: str, metrics: Any = (), params: Any = (),
                  tags: Any = (), **kw: Any) -> Any:
        calls.append((run_id, len(metrics), len(params), len(tags)))
        return real_batch(self, run_id, metrics, params, tags, **kw)

    monkeypatch.setattr(MlflowClient, "log_batch", log_batch)
    new_sweep(store, (2**-8, 2**-6))
    mirror = mirror_of(store, mlflow_uri, tmp_path)
    mirror.sync()
    trials = store.lease_pending("coord", 2)
    mirror.sync()
    points = curve(30, val_every=1)  # 4 metrics a step
    for i in range(0, 30, 10):  # three drains, each with both trials' new points
        for t in trials:
            mirror.live(t.id, t.started_at, points[i:i + 10])
    calls.clear()
    mirror.sync()
    runs = [store.get_trial(t.id).mlflow_run_id for t in trials]
    assert sorted(calls) == sorted((run, 4 * 30, 0, 0) for run in runs)
    client = MlflowClient(mlflow_uri)
    for run in runs:
        assert [s for s, _ in history(client, run, "val_loss")] == list(range(1, 31))

    done = trials[0]
    store.finish_trial(done.id, "completed", result("completed", 2**-8, points))
    calls.clear()
    mirror.sync()
    mine = [c for c in calls if c[0] == runs[0]]
    # the param table (apart: MLflow may refuse a param alone), then tags with the curve
    assert [(m > 0, p > 0, t > 0) for _, m, p, t in mine] == [(False, True, False),
                                                              (True, False, True)]
    assert client.get_run(runs[0]).data.tags["hpt.status"] == "completed"


def test_mlflow_down_loses_nothing_and_catches_up(store: Store, mlflow_uri: str,
                                                  tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    sid = new_sweep(store)
    trials = store.lease_pending("coord", 3)
    down = mirror_of(store, "http://127.0.0.1:1", tmp_path)  # nothing listens on port 1
    t0 = time.monotonic()
    with pytest.raises(Exception) as err:
        down.sync()
    assert time.monotonic() - t0 < 10 and "127.0.0.1" in str(err.value)
    statuses = finish_all(store, sid, trials)  # results reach the app DB meanwhile
    assert {t.id: t.status for t in store.trials(sid)} == statuses
    assert store.mirror_backlog() == 4  # the sweep and its three attempts: nothing marked

    # the same mirror, MLflow away for a while mid-copy: it resumes where it stopped
    outage = {"on": True}
    real_batch = MlflowClient.log_batch

    def flaky_log_batch(self: MlflowClient, *a: Any, **kw: Any) -> Any:
        if outage["on"]:
            raise ConnectionError("connection refused (simulated)")
        return real_batch(self, *a, **kw)

    monkeypatch.setattr(MlflowClient, "log_batch", flaky_log_batch)
    mirror = mirror_of(store, mlflow_uri, tmp_path, artifacts=lambda _: FITS)
    with pytest.raises(ConnectionError):
        mirror.sync()
    assert store.mirror_backlog() == 4
    outage["on"] = False
    mirror.sync()
    assert store.mirror_backlog() == 0
    client = MlflowClient(mlflow_uri)
    sweep = store.get_sweep(sid)
    runs = trial_runs(client, sweep.mlflow_experiment_id)
    assert len(runs) == 3  # the failed first try left no second run behind
    by_trial = {r.data.tags["hpt.trial_id"]: r for r in runs}
    assert {tid: r.data.tags["hpt.status"] for tid, r in by_trial.items()} == statuses
    done = next(r for tid, r in by_trial.items() if statuses[tid] == "completed")
    assert [s for s, _ in history(client, done.info.run_id, "train_loss")] == list(range(1, 41))
    assert done.info.start_time == int(trials[0].started_at.timestamp() * 1000)
    assert client.get_run(sweep.mlflow_run_id).info.status == "FINISHED"
    assert "fits" in artifact_paths(client, sweep.mlflow_run_id)


def test_kill_between_creating_a_run_and_recording_it_converges(
        store: Store, mlflow_uri: str, tmp_path: Path, monkeypatch: Any) -> None:
    sid = new_sweep(store)
    trials = store.lease_pending("coord", 3)
    real_record = Store.set_attempt_run

    def killed(*_a: Any, **_kw: Any) -> None:
        raise Killed

    monkeypatch.setattr(Store, "set_attempt_run", killed)
    with pytest.raises(Killed):
        mirror_of(store, mlflow_uri, tmp_path).sync()  # the parent and one run created
    monkeypatch.setattr(Store, "set_attempt_run", real_record)
    client = MlflowClient(mlflow_uri)
    experiment_id = store.get_sweep(sid).mlflow_experiment_id
    (orphan,) = trial_runs(client, experiment_id)
    assert orphan.info.status == "RUNNING" and store.mirror_backlog() == 3
    finish_all(store, sid, trials)

    # killed again, after the first run's curve and tags but before it is terminated
    real_end = MlflowClient.set_terminated
    monkeypatch.setattr(MlflowClient, "set_terminated", killed)
    with pytest.raises(Killed):
        mirror_of(store, mlflow_uri, tmp_path).sync()
    monkeypatch.setattr(MlflowClient, "set_terminated", real_end)

    fresh = mirror_of(store, mlflow_uri, tmp_path)  # a new coordinator process
    fresh.sync()
    assert store.mirror_backlog() == 0
    runs = trial_runs(client, experiment_id)
    assert len(runs) == 3 and orphan.info.run_id in {r.info.run_id for r in runs}
    assert "RUNNING" not in {r.info.status for r in runs}
    for run in runs:
        assert run.info.run_id == store.get_trial(run.data.tags["hpt.trial_id"]).mlflow_run_id
        for key in run.data.metrics:  # no point logged twice by the interrupted copies
            steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
            assert len(steps) == len(set(steps)), key
    parents = client.search_runs([experiment_id], "tags.`hpt.role` = 'sweep'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"


def test_a_run_deleted_in_mlflow_is_not_copied_again_and_its_sweep_run_ends(
        store: Store, mlflow_uri: str, tmp_path: Path, caplog: Any) -> None:
    """A user deletes a trial's run in MLflow's UI while it trains. MLflow then rejects every
    write to it: the attempt used to stay unmirrored, tried again on every pass (a warning
    a second), and kept its sweep's parent run RUNNING for good."""
    sid = new_sweep(store)
    trials = store.lease_pending("coord", 3)
    mirror = mirror_of(store, mlflow_uri, tmp_path)
    mirror.sync()
    client = MlflowClient(mlflow_uri)
    experiment_id = store.get_sweep(sid).mlflow_experiment_id
    deleted = trial_runs(client, experiment_id)[0]
    client.delete_run(deleted.info.run_id)
    finish_all(store, sid, trials)
    caplog.set_level(logging.WARNING, logger="hptransfer.tracking.mirror")
    mirror.sync()
    assert store.mirror_backlog() == 0
    assert mirror.sync() == 0  # nothing left to copy, nothing tried again
    rejected = [r.getMessage() for r in caplog.records if "not copied again" in r.getMessage()]
    assert len(rejected) == 1 and deleted.data.tags["hpt.trial_id"] in rejected[0], rejected
    (parent,) = client.search_runs([experiment_id], "tags.`hpt.role` = 'sweep'")
    assert parent.info.status == "FINISHED"
    others = [r for r in trial_runs(client, experiment_id)
              if r.info.run_id != deleted.info.run_id]
    assert len(others) == 2 and all(r.info.status != "RUNNING" for r in others)
    assert client.get_run(deleted.info.run_id).info.lifecycle_stage == "deleted"


def test_mirror_thread_backs_off_and_logs_one_line_per_outage(
        store: Store, mlflow_uri: str, tmp_path: Path, monkeypatch: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    calls = {"n": 0, "on": True}
    real_search = MlflowClient.get_experiment_by_name

    def flaky(self: MlflowClient, *a: Any, **kw: Any) -> Any:
        calls["n"] += 1
        if calls["on"]:
            raise ConnectionError("connection refused (simulated)")
        return real_search(self, *a, **kw)

    monkeypatch.setattr(MlflowClient, "get_experiment_by_name", flaky)
    new_sweep(store)
    mirror = mirror_of(store, mlflow_uri, tmp_path, interval=0.01, max_backoff=0.08)
    caplog.set_level(logging.INFO, logger="hptransfer.tracking.mirror")
    mirror.start()
    try:
        deadline = time.monotonic() + 60
        while calls["n"] < 6:  # several retries during the outage
            assert time.monotonic() < deadline
            mirror.wake()  # wakes are ignored while MLflow is away (back-off)
            time.sleep(0.01)
        calls["on"] = False
        while store.mirror_backlog():
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        mirror.stop()
    lines = [r.getMessage() for r in caplog.records]
    assert sum("MLflow mirror failing" in m for m in lines) == 1, lines
    assert sum("MLflow mirror recovered" in m for m in lines) == 1, lines
    assert len(lines) == 2, lines


def test_threads_submitting_live_points_while_the_mirror_runs(
        store: Store, mlflow_uri: str, tmp_path: Path) -> None:
    sid = new_sweep(store, (2**-8, 2**-7, 2**-6, 2**-5))
    mirror = mirror_of(store, mlflow_uri, tmp_path, interval=0.02)
    mirror.start()
    try:
        trials = store.lease_pending("coord", 4)

        def stream(t: TrialRecord) -> None:
            points = curve(30)
            for j in range(0, 30, 10):
                mirror.live(t.id, t.started_at, points[j:j + 10])
                time.sleep(0.01)
            store.finish_trial(t.id, "completed", result("completed", t.lr, points))

        threads = [threading.Thread(target=stream, args=(t,)) for t in trials]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
        store.refresh_sweep_status(sid)
        mirror.wake()
    finally:
        mirror.stop()  # its last pass copies what is left
    assert store.mirror_backlog() == 0
    client = MlflowClient(mlflow_uri)
    for t in trials:
        rid = store.get_trial(t.id).mlflow_run_id
        assert client.get_run(rid).info.status == "FINISHED"
        assert [s for s, _ in history(client, rid, "train_loss")] == list(range(1, 31))


def test_flatten_and_keys() -> None:
    flat = flatten({"a": {"b": 1, "c": [1, 2]}, "d": [{"e": None}], "f": {}})
    assert flat == {"a.b": "1", "a.c": "[1, 2]", "d.0.e": "None", "f": "{}"}
    long_a, long_b = "a" * 300, "a" * 299 + "b"
    assert len(mlflow_key(long_a)) == MAX_KEY and mlflow_key(long_a) != mlflow_key(long_b)
    assert mlflow_key("x/y[0]") == "x_y_0_"


def test_ui_command() -> None:
    argv = ui_command("sqlite:////tmp/h/mlflow.db", "0.0.0.0", 5001)
    assert argv[-7:] == ["ui", "--backend-store-uri", "sqlite:////tmp/h/mlflow.db",
                         "--host", "0.0.0.0", "--port", "5001"]
    assert "mlflow" in " ".join(argv[:-7])
    with pytest.raises(ValueError):
        ui_command("http://mlflow:5000", "127.0.0.1", 5000)


def test_live_points_for_a_deleted_run_do_not_hold_up_the_other_rows(
        store: Store, mlflow_uri: str, tmp_path: Path) -> None:
    """Its live points were logged outside the per-row guard: MLflow's refusal failed every
    pass while that trial trained, and no other result reached MLflow."""
    new_sweep(store, lrs=(2**-8, 2**-7))
    a, b = store.lease_pending("coord", 2)
    mirror = mirror_of(store, mlflow_uri, tmp_path)
    mirror.sync()
    client = MlflowClient(mlflow_uri)
    client.delete_run(store.get_trial(a.id).mlflow_run_id)  # in the UI, while it trains
    assert store.finish_trial(b.id, "completed", result("completed", b.lr, curve(20)))
    for _ in range(2):
        mirror.live(a.id, a.started_at, curve(5))
        mirror.sync()  # raised every time
    assert client.get_run(store.get_trial(b.id).mlflow_run_id).info.status == "FINISHED"


def test_reserved_tags_are_refused_at_submit_and_never_steer_a_run(
        store: Store, mlflow_uri: str, tmp_path: Path) -> None:
    import copy

    from conftest import TINY_SPEC

    from hptransfer.spec import SpecError, load_spec

    spec = {**copy.deepcopy(TINY_SPEC), "tags": {"mlflow.runName": "mine", "HPT.role": "x",
                                                 "team": "a"}}
    with pytest.raises(SpecError) as exc:
        load_spec(spec)
    assert sorted(e["field"] for e in exc.value.errors) == ["tags.HPT.role",
                                                            "tags.mlflow.runName"]
    # a spec stored before: its sweep is mirrored, the reserved tags left out
    stored = {**SWEEP_SPEC, "tags": {"mlflow.runName": "mine", "mlflow.parentRunId": "abc",
                                     "team": "a"}}
    sid = store.create_sweep(name="demo", spec=stored, spec_hash="h", search="grid",
                             planned=[Planned("cp", trial_spec(2**-8), 128, 2, 2**-8, 0.02, 0,
                                              "h0")], reuse=False)
    mirror_of(store, mlflow_uri, tmp_path).sync()  # create_run was refused on every pass
    sweep = store.get_sweep(sid)
    parent = MlflowClient(mlflow_uri).get_run(sweep.mlflow_run_id)
    assert parent.info.run_name == "demo" and parent.data.tags["team"] == "a"
    assert "mlflow.parentRunId" not in parent.data.tags


def test_a_diverged_trials_run_shows_the_app_dbs_final_numbers(
        store: Store, mlflow_uri: str, tmp_path: Path) -> None:
    """Its curve ends one step past `steps` (the step that diverged) with more tokens: the
    run's `tokens` was the curve's, not the trial's."""
    new_sweep(store, lrs=(2**-8,))
    (t,) = store.lease_pending("coord", 1)
    points = curve(21)  # steps 1..21; the trial counts 20 (step 21 diverged)
    diverged = {**result("diverged", t.lr, points), "steps": 20, "tokens": 20 * 2048}
    assert store.finish_trial(t.id, "diverged", diverged)
    mirror_of(store, mlflow_uri, tmp_path).sync()
    run = MlflowClient(mlflow_uri).get_run(store.get_trial(t.id).mlflow_run_id)
    row = store.get_trial(t.id)
    assert run.data.metrics["tokens"] == row.tokens == 20 * 2048
    assert run.data.metrics["final_train_loss"] == diverged["final_train_loss"]


def test_a_reused_trial_has_its_run_in_its_sweeps_experiment(
        store: Store, mlflow_uri: str, tmp_path: Path) -> None:
    def sweep(name: str) -> str:
        planned = [Planned("cp", trial_spec(2**-8), 128, 2, 2**-8, 0.02, 0, "same")]
        return store.create_sweep(name=name, spec={**SWEEP_SPEC, "name": name},
                                  spec_hash="h", search="grid", planned=planned,
                                  data_hash="d", reuse=True)

    first = sweep("first")
    (t,) = store.lease_pending("coord", 1)
    assert store.finish_trial(t.id, "completed", result("completed", t.lr, curve(20)))
    store.refresh_sweep_status(first)
    second = sweep("second")
    (reused,) = store.trials(second)
    assert reused.reused and reused.attempts == 1  # not trained again: its one attempt is reused
    (attempt,) = store.attempts(reused.id)
    assert (attempt.status, attempt.error, attempt.result) == ("completed", None,
                                                               reused.result)
    mirror = mirror_of(store, mlflow_uri, tmp_path)
    mirror.sync()
    mirror.sync()
    assert store.mirror_backlog() == 0
    client = MlflowClient(mlflow_uri)
    (run,) = trial_runs(client, store.get_sweep(second).mlflow_experiment_id)
    assert run.data.tags["hpt.reused_from"] == t.id and run.info.status == "FINISHED"
    assert run.data.metrics["final_val_loss"] == reused.final_val_loss
    assert history(client, run.info.run_id, "train_loss") == [
        (p["step"], p["train_loss"]) for p in curve(20)]


def test_an_mlflow_outage_starts_with_one_warning_line_not_a_traceback(
        store: Store, mlflow_uri: str, tmp_path: Path, monkeypatch: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    """The start of an outage was logged as a ~110-line traceback."""
    mirror = mirror_of(store, mlflow_uri, tmp_path)

    def away() -> int:
        raise ConnectionError("HTTPConnectionPool(host='127.0.0.1', port=1): Max retries "
                              "exceeded\n(caused by NewConnectionError: refused)")

    monkeypatch.setattr(mirror, "sync", away)
    caplog.set_level(logging.DEBUG, logger="hptransfer.tracking.mirror")
    mirror._stop.set()  # one pass of the loop, then it returns
    mirror._loop()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].exc_info is None, warnings
    line = warnings[0].getMessage()
    assert "\n" not in line and line.startswith(
        "MLflow mirror failing (ConnectionError: HTTPConnectionPool(host='127.0.0.1', port=1): "
        "Max retries exceeded); retrying with backoff"), line
    assert [r.levelno for r in caplog.records if r.exc_info] == [logging.DEBUG]


def test_a_hooks_artifact_that_leaves_its_folder_is_written_nowhere(
        store: Store, mlflow_uri: str, tmp_path: Path, monkeypatch: Any) -> None:
    """A name with `..` is skipped before anything is written: the upload folder is a temporary
    directory, so `../escape.txt` would land beside it (in the system's temp directory), not in
    the run."""
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    sid = new_sweep(store, lrs=(2**-8,))
    (t,) = store.lease_pending("coord", 1)
    assert store.finish_trial(t.id, "completed", result("completed", t.lr, curve(5)))
    store.refresh_sweep_status(sid)
    names = {"../escape.txt": "x", "fits/../../escape2.txt": "y", "fits/fit.json": "{}"}
    mirror_of(store, mlflow_uri, tmp_path, artifacts=lambda _: names).sync()
    parent_id = store.get_sweep(sid).mlflow_run_id
    client = MlflowClient(mlflow_uri)
    assert client.get_run(parent_id).info.status == "FINISHED"
    assert artifact_paths(client, parent_id, "fits") == {"fits/fit.json"}
    assert sorted(p.name for p in temp.rglob("*escape*")) == []


class FakeClient:
    """The MlflowClient calls a trial's run needs, recorded: (run_id, metrics) per log_batch."""

    def __init__(self) -> None:
        self.metrics: list[tuple[str, list[Any]]] = []

    def log_batch(self, run_id: str, metrics: Any = (), params: Any = (), tags: Any = (),
                  synchronous: bool = True) -> None:
        if metrics:
            self.metrics.append((run_id, list(metrics)))

    def set_terminated(self, *args: Any, **kwargs: Any) -> None:
        pass


class QueueStore:
    """A store whose attempts to mirror are handed out one pass at a time."""

    def __init__(self) -> None:
        self.passes: list[list[AttemptRecord]] = []

    def sweeps_to_mirror(self) -> list[Any]:
        return []

    def attempts_to_mirror(self, batch: int) -> list[AttemptRecord]:
        return self.passes.pop(0) if self.passes else []

    def mark_attempt_mirrored(self, trial_id: str, seq: int, status: str) -> None:
        pass


def attempt(seq: int, status: str, started_at: datetime) -> AttemptRecord:
    return AttemptRecord(
        trial_id="t1", seq=seq, status=status, error=None, started_at=started_at,
        finished_at=None, mlflow_run_id=f"run-{seq}", mlflow_synced_status=None,
        sweep_id="s1", experiment_id="e1", parent_run_id="p1", arm="cp",
        spec=trial_spec(2**-8), result=None)


def test_live_points_go_to_the_attempt_that_is_training_and_only_to_it(
        monkeypatch: Any) -> None:
    """Attempt 2 trains while attempt 1's end is mirrored after it: attempt 2's live points
    still reach its run, at start + step ms (the docstring's derived timestamps); points
    from attempt 1's start are dropped, never logged to attempt 2's run."""
    client = FakeClient()
    monkeypatch.setattr(mirror_module, "open_client", lambda uri: client)
    store = QueueStore()
    mirror = Mirror(store, "unused://")  # type: ignore[arg-type]
    first = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    second = first + timedelta(hours=1)
    store.passes = [[attempt(2, "running", second)], [attempt(1, "failed", first)]]
    mirror.sync()
    mirror.sync()
    points = curve(3)
    mirror.live("t1", first, points)
    mirror.live("t1", second, points)
    mirror.sync()
    start_ms = int(second.timestamp() * 1000)
    (run_id, metrics), = client.metrics
    assert run_id == "run-2"
    assert sorted((m.key, m.step, m.timestamp) for m in metrics if m.key == "train_loss") == [
        ("train_loss", s, start_ms + s) for s in (1, 2, 3)]


def test_a_pass_that_fills_its_batch_is_followed_by_another_at_once(monkeypatch: Any) -> None:
    """A backlog: a pass that mirrored `batch` rows goes on without waiting its interval."""
    mirror = Mirror(QueueStore(), "unused://", batch=5, interval=30.0)  # type: ignore[arg-type]
    passes: list[int] = []
    waits: list[float] = []

    def sync() -> int:
        passes.append(1)
        mirror._stop.set()  # the pass after this one is the last
        return 5 if len(passes) == 1 else 0

    monkeypatch.setattr(mirror, "sync", sync)
    monkeypatch.setattr(mirror._wake, "wait", waits.append)
    mirror._loop()
    assert (len(passes), waits) == (2, [])
