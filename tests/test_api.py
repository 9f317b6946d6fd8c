"""The service through HTTP: real local Ray, real MLflow sqlite store, real SQLite app DB."""

from __future__ import annotations

import itertools
import math
import time

import httpx
import pytest
from mlflow.tracking import MlflowClient

from hptransfer.api.server import serve_in_thread
from hptransfer.client import ApiError, Client
from hptransfer.config import get_settings
from hptransfer.store.store import Store


@pytest.fixture
def server(hpt_home, ray_cluster):
    settings = get_settings()
    with serve_in_thread(settings) as url:
        yield url, settings


def test_submit_run_and_track_a_sweep(server, tiny_spec):
    url, settings = server
    with Client(url) as c:
        s = c.submit(tiny_spec)
        assert s["total"] == 3 and s["status"] in ("pending", "running")
        done = c.wait(s["id"], poll=0.3, timeout=300, progress=False)
        assert done["status"] == "completed"
        assert done["counts"].get("completed", 0) + done["counts"].get("diverged", 0) == 3
        df = c.trials(s["id"], curves=True)  # the curves too: the first point is read below
    assert len(df) == 3 and set(df["lr"]) == {2**-8, 2**-6, 2**-4}
    finished = df[df["status"] == "completed"]
    assert (finished["final_val_loss"] < 5.6).all()
    # something was learned: the best trial ends well below an untrained model (uniform over
    # the byte vocabulary, ln 256 = 5.55) and below its own loss before the first update
    # (the first curve point, step 1, holds the loss of the forward pass at initialisation)
    best = finished.loc[finished["final_val_loss"].idxmin()]
    first = best["result"]["curve"][0]
    assert first["step"] == 1
    initial, final = first["train_loss"], best["final_val_loss"]
    assert final < math.log(256) - 1.0, (initial, final)
    assert final < initial - 1.0, (initial, final)
    # MLflow mirrors the app DB shortly after: wait until it has caught up with the trials
    store = Store(settings.database_url)
    deadline = time.time() + 60
    while store.mirror_backlog(s["id"]) > 1:  # the sweep's own end may come with artifacts
        assert time.time() < deadline, "the MLflow mirror never caught up"
        time.sleep(0.2)
    ids = store.get_sweep(s["id"])  # the experiment may have been created after `done`
    done.update(mlflow_experiment_id=ids.mlflow_experiment_id, mlflow_run_id=ids.mlflow_run_id)
    store.close()
    # one nested MLflow run per trial under the sweep's parent run, curves logged
    ml = MlflowClient(settings.mlflow_uri)
    runs = ml.search_runs([done["mlflow_experiment_id"]])
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == done["mlflow_run_id"]]
    assert len(children) == 3
    child = next(r for r in children if r.data.tags.get("hpt.status") == "completed")
    history = ml.get_metric_history(child.info.run_id, "val_loss")
    assert [h.step for h in history] == [5, 10]
    assert any(k.startswith("group.hidden_weight") for k in child.data.params)
    # at completion the fits and dashboards land on the parent run, which then ends (both
    # just after the sweep's status flips, so poll briefly)
    wanted = {"fits/fits.json", "dashboards/sweep.html", "dashboards/loss_vs_lr.png"}
    deadline = time.time() + 60
    while True:
        names = {f.path for d in ("fits", "dashboards")
                 for f in ml.list_artifacts(done["mlflow_run_id"], d)}
        status = ml.get_run(done["mlflow_run_id"]).info.status
        if (wanted <= names and status != "RUNNING") or time.time() > deadline:
            break
        time.sleep(0.5)
    assert wanted <= names, names
    assert status == "FINISHED"


def test_bad_spec_is_422_naming_the_field(server, tiny_spec):
    url, _ = server
    tiny_spec["grid"]["widths"] = [48]
    r = httpx.post(f"{url}/sweeps", json=tiny_spec)
    assert r.status_code == 422
    body = r.json()
    assert any(e["field"].startswith("grid.widths") for e in body["errors"])
    assert "divisible" in body["error"]
    for bad in ({"name": "x"}, {**tiny_spec, "bogus": 1}, [1, 2]):
        r = httpx.post(f"{url}/sweeps", json=bad)
        assert r.status_code == 422, r.text
        assert r.json()["error"]
    r = httpx.post(f"{url}/sweeps", content=b"{not json", headers={"content-type":
                                                                   "application/json"})
    assert r.status_code == 422
    # nothing half-written
    assert httpx.get(f"{url}/sweeps").json() == []


def test_unknown_ids_and_bad_queries(server):
    url, _ = server
    r = httpx.get(f"{url}/sweeps/nope")
    assert r.status_code == 404 and "nope" in r.json()["error"]
    assert httpx.post(f"{url}/sweeps/nope/cancel", json={}).status_code == 404
    r = httpx.get(f"{url}/sweeps/nope/trials", params={"status": "weird"})
    assert r.status_code == 422 and "status" in r.json()["error"]
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_bad_data_path_rejected_at_submit(server, tiny_spec):
    url, _ = server
    tiny_spec["data"] = {"source": "/definitely/missing/shards", "vocab_size": 256}
    r = httpx.post(f"{url}/sweeps", json=tiny_spec)
    assert r.status_code == 422
    assert r.json()["errors"][0]["field"].startswith("data")


def test_auth_token(hpt_home, ray_cluster, monkeypatch, tiny_spec):
    monkeypatch.setenv("HPT_API_TOKEN", "s3cret")
    with serve_in_thread(get_settings()) as url:
        r = httpx.post(f"{url}/sweeps", json=tiny_spec)
        assert r.status_code == 401 and "Bearer" in r.json()["error"]
        r = httpx.post(f"{url}/sweeps", json=tiny_spec, headers={"Authorization": "Bearer no"})
        assert r.status_code == 401
        assert httpx.get(f"{url}/sweeps").status_code == 401  # reads need the token too
        assert httpx.get(f"{url}/sweeps",
                         headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200
        # ... but not the deep health check, which starts a task on every Ray node
        r = httpx.get(f"{url}/health", params={"deep": "true"})
        assert r.status_code == 401 and "Bearer" in r.json()["error"]
        r = httpx.get(f"{url}/health", params={"deep": "true"}, timeout=120,
                      headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
        with Client(url, token="s3cret") as c:
            s = c.submit(tiny_spec)
            c.cancel(s["id"])
        with Client(url, token="") as anon, pytest.raises(ApiError) as err:
            anon.cancel(s["id"])
        assert err.value.status == 401


def test_cancel_stops_pending_and_running(server, tiny_spec):
    url, _ = server
    # long enough that no trial can finish before the cancel lands (it never runs out)
    tiny_spec["budget"] = {"steps": 20000, "batch_size": 4}
    tiny_spec["max_concurrent"] = 1
    with Client(url) as c:
        s = c.submit(tiny_spec)
        deadline = time.time() + 60
        while c.get(s["id"])["counts"].get("running", 0) == 0:
            assert time.time() < deadline
            time.sleep(0.2)
        c.cancel(s["id"])
        deadline = time.time() + 60
        while (summary := c.get(s["id"]))["counts"].get("running", 0):
            assert time.time() < deadline, summary
            time.sleep(0.2)
    assert summary["status"] == "cancelled"
    assert {k: v for k, v in summary["counts"].items() if v} == {"cancelled": 3}


def test_two_sweeps_share_the_cluster_without_overcommitting(server, tiny_spec):
    url, settings = server  # the test cluster has 2 CPUs; each trial asks for 1
    tiny_spec["budget"] = {"steps": 40, "batch_size": 4}
    # one trial per task, so that running trials count the CPUs in use (a pack is one task)
    tiny_spec["resources"] = {"cpus": 1, "gpus": 0, "pack": 1}
    with Client(url) as c:
        a = c.submit({**tiny_spec, "name": "a"})
        b = c.submit({**tiny_spec, "name": "b", "grid": {**tiny_spec["grid"], "seeds": [1]}})
        for sweep in (a, b):
            assert c.wait(sweep["id"], poll=0.2, timeout=300, progress=False)["status"] == \
                "completed"
    # the most leases held at once, from every attempt's lease and end as the coordinator
    # stored them (two summaries read one after the other could straddle a tick that ended
    # one sweep's trial and leased the other's: a false 3)
    store = Store(settings.database_url)
    edges = sorted((t, step) for sweep in (a, b)
                   for r in store.trials(sweep["id"], limit=None)
                   for at in store.attempts(r.id)
                   for t, step in ((at.started_at, 1), (at.finished_at, -1)))
    held = list(itertools.accumulate(step for _, step in edges))  # an end sorts before a lease
    assert len(edges) >= 12 and 1 <= max(held) <= 2, edges


def test_a_sweep_asking_more_cpus_than_any_node_waits_visibly_and_blocks_no_other(
        server, tiny_spec):
    """A task runs on one node: asking 3 CPUs of 2-CPU nodes it could never start. Leased
    anyway, it sat 'running' in Ray's queue with its 3 CPUs counted as taken, and every
    other sweep's trials waited behind it with no word why."""
    url, _ = server  # the test cluster: one node of 2 CPUs
    with Client(url) as c:
        big = c.submit({**tiny_spec, "name": "too-big", "reuse": False,
                        "resources": {"cpus": 3}})
        deadline = time.time() + 30
        while not (summary := c.get(big["id"]))["waiting_for"]:
            assert time.time() < deadline
            time.sleep(0.2)
        assert "needs 3 CPUs per task and the largest Ray node has 2" in summary["waiting_for"]
        assert summary["counts"]["running"] == 0
        small = c.submit({**tiny_spec, "name": "fits", "reuse": False})
        assert c.wait(small["id"], poll=0.3, timeout=120, progress=False)["status"] == \
            "completed"
        assert c.get(big["id"])["counts"]["running"] == 0
        c.cancel(big["id"])


def test_gpu_sweep_waits_visibly_on_a_cluster_without_gpus(server, tiny_spec):
    url, _ = server  # the test cluster has no GPUs
    tiny_spec["resources"] = {"cpus": 1, "gpus": 0.5}
    with Client(url) as c:
        s = c.submit(tiny_spec)
        deadline = time.time() + 30
        while not (summary := c.get(s["id"]))["waiting_for"]:
            assert time.time() < deadline
            time.sleep(0.2)
        assert "GPU" in summary["waiting_for"]
        assert summary["counts"]["running"] == 0 and summary["counts"]["pending"] == 3
        c.cancel(s["id"])
        while c.get(s["id"])["waiting_for"] is not None:  # cancelled: it waits for nothing
            assert time.time() < deadline + 30
            time.sleep(0.2)
