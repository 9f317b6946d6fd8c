"""MLflow tracking against a real MLflow with a SQLite store in tmp_path (no mocks of MLflow)."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from hptransfer.sweeper.mlflow.tracking import (
    MAX_KEY,
    MAX_PARAM_VALUE,
    Tracker,
    flatten,
    mlflow_key,
    ui_command,
)

SWEEP_SPEC: dict[str, Any] = {
    "name": "demo",
    "arms": [
        {"name": "sp", "parameterization": "sp"},
        {"name": "cp", "parameterization": "completep"},
    ],
    "grid": {"lr": [2**-8, 2**-6], "width": [64, 128]},
    "notes": "x" * 7000,  # longer than MLflow's 6000-character param limit
    "k" * 300: 1,  # longer than MLflow's 250-character key limit
}


@pytest.fixture(scope="module")
def template_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Creating MLflow's schema takes seconds on two cores; migrate once, copy per test.
    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def store(tmp_path: Path, template_db: Path) -> str:
    db = tmp_path / "mlflow.db"
    shutil.copy(template_db, db)
    return f"sqlite:///{db}"


def make_tracker(uri: str, tmp_path: Path, **kw: Any) -> Tracker:
    return Tracker(uri, str(tmp_path / "artifacts"), outbox_dir=tmp_path / "outbox", **kw)


def curve(n: int, val_every: int = 10, start: int = 1) -> list[dict[str, Any]]:
    out = []
    for step in range(start, start + n):
        point: dict[str, Any] = {
            "step": step, "tokens": step * 2048, "train_loss": 5.0 - step * 1e-3, "lr": 1e-3,
        }
        if step % val_every == 0:
            point["val_loss"] = 5.5 - step * 1e-3
        out.append(point)
    return out


def param_table(lr: float) -> dict[str, Any]:
    group = {"params": ["a.weight", "b.weight"], "init": "normal", "init_std": 0.02,
             "weight_decay": 0.1, "eps": 1e-12}
    return {
        "parameterization": "completep", "alpha": 1.0, "m_width": 2.0, "m_depth": 1.0,
        "groups": [
            {"name": "embedding", **group, "lr": lr, "params": ["embed.weight"]},
            {"name": "hidden_weight", **group, "lr": lr / 2},
        ],
        "multipliers": {"residual": 1.0, "logits": 0.5, "attn_scale": 0.125},
        "notes": [],
    }


def trial_spec(lr: float, width: int = 128, seed: int = 0) -> dict[str, Any]:
    return {"arch": "gpt", "parameterization": "completep", "width": width, "depth": 2,
            "lr": lr, "seed": seed, "budget": {"tokens": None, "steps": 40},
            "arch_options": {"activation": "relu2", "mlp_ratio": 4}}


def result(status: str, lr: float, points: list[dict[str, Any]], error: str | None = None,
           ) -> dict[str, Any]:
    return {
        "status": status, "final_val_loss": points[-1].get("val_loss"), "final_train_loss": 4.9,
        "curve": points, "steps": points[-1]["step"], "tokens": points[-1]["tokens"],
        "flops": 1.5e12, "flops_per_token": 6e6, "params_embedding": 1000,
        "params_non_embedding": 250_000, "wall_time_s": 12.5, "tokens_per_s": 6553.6,
        "mfu": None, "device": "cpu", "param_table": param_table(lr), "error": error, "notes": [],
    }


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def artifact_paths(client: MlflowClient, run_id: str, path: str | None = None) -> set[str]:
    return {a.path for a in client.list_artifacts(run_id, path)}


def read_artifact(client: MlflowClient, run_id: str, path: str, tmp_path: Path) -> str:
    dst = tmp_path / "download"
    dst.mkdir(exist_ok=True)
    return Path(client.download_artifacts(run_id, path, str(dst))).read_text()


def test_full_lifecycle(store: str, tmp_path: Path) -> None:
    tracker = make_tracker(store, tmp_path)
    ids = tracker.start_sweep("sw-1", "demo", SWEEP_SPEC, {"owner": "tests"})
    assert ids is not None
    experiment_id, parent_id = ids

    cases = [("cp", 2**-8, "completed"), ("cp", 2**-6, "failed"), ("sp", 2**-7, "cancelled")]
    run_ids = {}
    for i, (arm, lr, status) in enumerate(cases):
        trial_id = f"trial-{i}"
        run_id = tracker.start_trial(experiment_id, parent_id, trial_id, arm, trial_spec(lr))
        assert run_id
        points = curve(40)
        assert tracker.log_metrics(run_id, points[:15])  # streamed while training
        error = None
        if status == "failed":
            error = "Traceback ...\n" + "e" * 5000 + "\nRuntimeError: boom"
        assert tracker.finish_trial(run_id, result(status, lr, points, error), status)
        run_ids[trial_id] = (run_id, arm, lr, status)
    fits = {"fits/fit.json": json.dumps({"alpha": 0.35}), "fits/frontier.png": b"\x89PNG\r\n"}
    assert tracker.finish_sweep(parent_id, "completed", fits)
    assert tracker.failures == 0 and tracker.pending() == 0

    client = MlflowClient(store)
    exp = client.get_experiment(experiment_id)
    assert exp.name == "hpt/demo/sw-1"
    assert str(tmp_path / "artifacts") in exp.artifact_location
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["hpt.status"] == "completed" and parent.data.tags["owner"] == "tests"
    assert parent.data.params["grid.lr"] == json.dumps([2**-8, 2**-6])
    assert parent.data.params["arms.1.parameterization"] == "completep"
    assert len(parent.data.params["notes"]) == MAX_PARAM_VALUE
    assert all(len(k) <= MAX_KEY for k in parent.data.params)
    assert {"sweep_spec.json", "fits"} <= artifact_paths(client, parent_id)
    assert artifact_paths(client, parent_id, "fits") == {"fits/fit.json", "fits/frontier.png"}
    spec_back = json.loads(read_artifact(client, parent_id, "sweep_spec.json", tmp_path))
    assert spec_back["grid"] == SWEEP_SPEC["grid"]

    children = client.search_runs([experiment_id], f"tags.`mlflow.parentRunId` = '{parent_id}'")
    assert {r.info.run_id for r in children} == {v[0] for v in run_ids.values()}
    expected_status = {"completed": "FINISHED", "failed": "FAILED", "cancelled": "KILLED"}
    for trial_id, (run_id, arm, lr, status) in run_ids.items():
        run = client.get_run(run_id)
        tags, params, metrics = run.data.tags, run.data.params, run.data.metrics
        assert run.info.status == expected_status[status]
        assert run.info.run_name == f"{arm} N=128 L=2 lr={lr:.3g} seed=0"
        assert tags["hpt.trial_id"] == trial_id and tags["hpt.sweep_id"] == "sw-1"
        assert tags["hpt.arm"] == arm and tags["hpt.status"] == status
        assert params["group.embedding.lr"] == str(lr)
        assert params["group.hidden_weight.lr"] == str(lr / 2)
        assert params["group.hidden_weight.n_params"] == "2"
        assert params["group.hidden_weight.weight_decay"] == "0.1"
        assert params["group.hidden_weight.init_std"] == "0.02"
        assert params["mult.logits"] == "0.5" and params["mult.attn_scale"] == "0.125"
        assert params["budget.steps"] == "40" and params["arch_options.mlp_ratio"] == "4"
        # Streamed points and the final curve overlap: each (metric, step) is logged once.
        assert history(client, run_id, "val_loss") == [
            (s, pytest.approx(5.5 - s * 1e-3)) for s in (10, 20, 30, 40)
        ]
        assert [s for s, _ in history(client, run_id, "train_loss")] == list(range(1, 41))
        assert [s for s, _ in history(client, run_id, "tokens")] == list(range(1, 41))
        assert metrics["final_val_loss"] == pytest.approx(5.46)
        assert metrics["flops"] == 1.5e12 and metrics["params_non_embedding"] == 250_000
        assert metrics["tokens_per_s"] == pytest.approx(6553.6) and "mfu" not in metrics
        assert artifact_paths(client, run_id) == {"param_table.json"}
        table = json.loads(read_artifact(client, run_id, "param_table.json", tmp_path))
        assert table["groups"][1]["lr"] == lr / 2
        if status == "failed":
            assert tags["hpt.error"].endswith("RuntimeError: boom")
            assert len(tags["hpt.error"]) <= 4000
        else:
            assert "hpt.error" not in tags


def test_curve_logging_is_batched(store: str, tmp_path: Path, monkeypatch: Any) -> None:
    calls: dict[str, list[int]] = {"log_batch": [], "log_metric": []}
    real_batch, real_metric = MlflowClient.log_batch, MlflowClient.log_metric

    def log_batch(self: MlflowClient, run_id: str, metrics: Any = (), *a: Any, **kw: Any) -> Any:
        calls["log_batch"].append(len(metrics))
        return real_batch(self, run_id, metrics, *a, **kw)

    def log_metric(self: MlflowClient, *a: Any, **kw: Any) -> Any:
        calls["log_metric"].append(1)
        return real_metric(self, *a, **kw)

    monkeypatch.setattr(MlflowClient, "log_batch", log_batch)
    monkeypatch.setattr(MlflowClient, "log_metric", log_metric)
    tracker = make_tracker(store, tmp_path)
    experiment_id, parent_id = tracker.start_sweep("sw-b", "batch", {"n": 1}) or (None, None)
    run_id = tracker.start_trial(experiment_id, parent_id, "t-b", "cp", trial_spec(1e-3))
    assert run_id

    points = curve(500, val_every=1)  # 4 metrics x 500 steps = 2000 metrics
    calls["log_batch"].clear()
    assert tracker.log_metrics(run_id, points)
    assert len(calls["log_batch"]) <= 2 and calls["log_metric"] == []
    assert max(calls["log_batch"]) <= 1000

    calls["log_batch"].clear()
    assert tracker.log_metrics(run_id, points)  # a resent curve adds nothing
    assert calls["log_batch"] == []
    assert tracker.finish_trial(run_id, result("completed", 1e-3, points), "completed")
    assert calls["log_metric"] == []

    client = MlflowClient(store)
    for key in ("train_loss", "val_loss", "lr", "tokens"):
        assert [s for s, _ in history(client, run_id, key)] == list(range(1, 501))


def test_unreachable_mlflow_queues_then_replays(
    store: str, tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    down = make_tracker("http://127.0.0.1:1", tmp_path)  # nothing listens on port 1
    points = curve(60)
    t0 = time.monotonic()
    assert down.start_sweep("sw-9", "offline", SWEEP_SPEC, {"owner": "tests"}) is None
    assert down.start_sweep("sw-9", "offline", SWEEP_SPEC, {"owner": "tests"}) is None  # retry
    assert down.start_trial(None, None, "t-9", "cp", trial_spec(2**-7), sweep_id="sw-9") is None
    assert down.log_metrics(None, points[:30], trial_id="t-9") is False
    assert down.log_metrics(None, points[30:], trial_id="t-9") is False
    assert down.finish_trial(None, result("completed", 2**-7, points), "completed",
                             trial_id="t-9") is False
    assert down.finish_sweep(None, "completed", {"fits/fit.json": "{}"}, sweep_id="sw-9") is False
    assert time.monotonic() - t0 < 10
    assert down.failures >= 1 and "127.0.0.1" in (down.last_error or "")
    assert not down.available

    # One file per trial plus one for the sweep; the retried start was not queued twice.
    sweep_file = tmp_path / "outbox" / "sw-9" / "sweep.jsonl"
    trial_file = tmp_path / "outbox" / "sw-9" / "trial-t-9.jsonl"
    ops = [json.loads(line)["op"] for line in sweep_file.read_text().splitlines()]
    assert ops == ["start_sweep", "finish_sweep"]
    ops = [json.loads(line)["op"] for line in trial_file.read_text().splitlines()]
    assert ops == ["start_trial", "log_metrics", "log_metrics", "finish_trial"]
    assert down.pending() == 6

    replay_started = int(time.time() * 1000)
    up = make_tracker(store, tmp_path)
    assert up.flush_outbox() == 6
    assert up.pending() == 0 and not sweep_file.exists() and not trial_file.exists()
    assert up.flush_outbox() == 0

    client = MlflowClient(store)
    exp = client.get_experiment_by_name("hpt/offline/sw-9")
    assert exp is not None
    parent_id = up.sweep_ids_for("sw-9")[1]  # type: ignore[index]
    run_id = up.run_id_for("t-9")
    assert run_id
    parent, run = client.get_run(parent_id), client.get_run(run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["owner"] == "tests"
    assert "fits" in artifact_paths(client, parent_id)
    assert run.data.tags["mlflow.parentRunId"] == parent_id
    assert run.data.tags["hpt.status"] == "completed" and run.info.status == "FINISHED"
    assert run.info.start_time < replay_started  # replayed with the original timestamps
    assert run.data.params["group.hidden_weight.lr"] == str(2**-7 / 2)
    assert history(client, run_id, "val_loss") == [
        (s, pytest.approx(5.5 - s * 1e-3)) for s in range(10, 61, 10)
    ]
    assert [s for s, _ in history(client, run_id, "train_loss")] == list(range(1, 61))
    assert artifact_paths(client, run_id) == {"param_table.json"}


def test_outage_mid_trial_queues_behind_and_recovers(
    store: str, tmp_path: Path, monkeypatch: Any
) -> None:
    outage = {"on": False, "calls": 0}
    real_batch = MlflowClient.log_batch

    def flaky_log_batch(self: MlflowClient, *a: Any, **kw: Any) -> Any:
        outage["calls"] += 1
        if outage["on"]:
            raise ConnectionError("connection refused (simulated)")
        return real_batch(self, *a, **kw)

    monkeypatch.setattr(MlflowClient, "log_batch", flaky_log_batch)
    tracker = make_tracker(store, tmp_path, retry_after_s=1.0)
    experiment_id, parent_id = tracker.start_sweep("sw-f", "flaky", {"n": 1}) or (None, None)
    run_id = tracker.start_trial(experiment_id, parent_id, "t-f", "cp", trial_spec(1e-3))
    assert run_id
    points = curve(40)

    outage["on"] = True
    assert tracker.log_metrics(run_id, points[:10]) is False
    calls = outage["calls"]
    assert tracker.log_metrics(run_id, points[10:20]) is False  # breaker open: MLflow not called
    assert outage["calls"] == calls and tracker.pending() == 2

    outage["on"] = False
    time.sleep(1.05)  # the breaker closes again
    # Queued records of this trial are replayed first, then this one goes straight through.
    assert tracker.log_metrics(run_id, points[20:30]) is True
    assert tracker.pending() == 0
    assert tracker.finish_trial(run_id, result("completed", 1e-3, points), "completed")
    client = MlflowClient(store)
    assert [s for s, _ in history(client, run_id, "train_loss")] == list(range(1, 41))
    assert client.get_run(run_id).info.status == "FINISHED"


def test_resume_reuses_experiment_and_parent(store: str, tmp_path: Path) -> None:
    first = make_tracker(store, tmp_path).start_sweep("sw-r", "resume", {"lr": 1, "a": 2})
    assert first is not None
    # A new coordinator process (fresh Tracker), and the spec changed meanwhile.
    again = make_tracker(store, tmp_path)
    assert again.start_sweep("sw-r", "resume", {"lr": 2, "b": 3}) == first
    assert again.failures == 0
    params = MlflowClient(store).get_run(first[1]).data.params
    assert params == {"lr": "1", "a": "2", "b": "3"}  # MLflow params are immutable
    # Trials of the resumed sweep still get their sweep tag (read from the parent run).
    run_id = again.start_trial(first[0], first[1], "t-r", "cp", trial_spec(1e-3))
    fresh = make_tracker(store, tmp_path)
    run_id2 = fresh.start_trial(first[0], first[1], "t-r2", "cp", trial_spec(1e-3))
    client = MlflowClient(store)
    for rid in (run_id, run_id2):
        assert rid and client.get_run(rid).data.tags["hpt.sweep_id"] == "sw-r"


def test_open_trial_runs_finds_attempts_the_app_db_never_recorded(store: str,
                                                                   tmp_path: Path) -> None:
    # A coordinator created runs, then died before storing their ids: a new process's
    # Tracker must still find them (only those still RUNNING) so they can be closed.
    dead = make_tracker(store, tmp_path)
    experiment_id, parent_id = dead.start_sweep("sw-o", "orphans", {"n": 1}) or (None, None)
    lost = dead.start_trial(experiment_id, parent_id, "t-o", "cp", trial_spec(1e-3))
    done = dead.start_trial(experiment_id, parent_id, "t-done", "cp", trial_spec(1e-3))
    assert dead.finish_trial(done, result("completed", 1e-3, curve(5)), "completed")

    fresh = make_tracker(store, tmp_path)
    assert fresh.open_trial_runs("sw-o") == {lost: "t-o"}  # not the parent, not `done`
    assert fresh.open_trial_runs("no-such-sweep") is None
    assert fresh.finish_trial(lost, {"error": "coordinator died"}, "cancelled", trial_id="t-o")
    assert MlflowClient(store).get_run(lost).info.status == "KILLED"
    assert fresh.open_trial_runs("sw-o") == {}
    assert fresh.failures == 0
    assert make_tracker("http://127.0.0.1:1", tmp_path / "down").open_trial_runs("sw-o") is None


def test_bad_input_is_reported_not_raised_or_queued(store: str, tmp_path: Path) -> None:
    tracker = make_tracker(store, tmp_path)
    ids = tracker.start_sweep("sw-x", "bad", {"n": 1})
    assert ids is not None
    assert tracker.finish_sweep(ids[1], "completed", {"../escape.txt": "x"}) is False
    assert tracker.log_metrics(None, curve(3)) is False  # no run, no trial: nothing to attach to
    assert tracker.finish_trial("0" * 32, {}, "completed") is False  # run does not exist
    assert tracker.failures == 3 and tracker.pending() == 0
    rejected = (tmp_path / "outbox" / "rejected.jsonl").read_text().splitlines()
    assert len(rejected) == 1 and json.loads(rejected[0])["record"]["op"] == "finish_trial"


def test_threads_share_one_tracker(store: str, tmp_path: Path) -> None:
    tracker = make_tracker(store, tmp_path)
    experiment_id, parent_id = tracker.start_sweep("sw-t", "threads", {"n": 4}) or (None, None)
    run_ids: dict[int, str | None] = {}

    def trial(i: int) -> None:
        rid = tracker.start_trial(experiment_id, parent_id, f"t-{i}", "cp", trial_spec(1e-3))
        run_ids[i] = rid
        points = curve(30)
        for j in range(0, 30, 10):
            tracker.log_metrics(rid, points[j : j + 10], trial_id=f"t-{i}")
        tracker.finish_trial(rid, result("completed", 1e-3, points), "completed",
                             trial_id=f"t-{i}")

    threads = [threading.Thread(target=trial, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    tracker.flush_outbox()  # whatever SQLite contention queued
    client = MlflowClient(store)
    for i in range(4):
        rid = run_ids[i] or tracker.run_id_for(f"t-{i}")
        assert rid
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
