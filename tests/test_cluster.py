"""The production topology as separate processes (scripts/cluster_up.sh): PostgreSQL, an
MLflow server with proxied artifacts, a Ray head, a second Ray node, and `hpt serve` joining
them with a token. Sweeps go through REST; results are read back from PostgreSQL, the MLflow
server (over HTTP) and the Optuna storage. `hpt doctor` passes and names PostgreSQL, MLflow
or the Ray worker when each is stopped; a killed postmaster or MLflow server comes back on
`cluster_up.sh` with nothing of the old one in the way. Kills of the worker node and the
coordinator mid-sweep are tests/test_chaos.py's storm, over this same topology.

Slow (a few minutes on 2 cores); it runs in the normal test command.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

from hptransfer.client import Client

ROOT = Path(__file__).resolve().parents[1]
UP, DOWN = ROOT / "scripts" / "cluster_up.sh", ROOT / "scripts" / "cluster_down.sh"
HPT = Path(sys.executable).with_name("hpt")
PG_BIN = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def _script(path: Path, *args: str, env: dict[str, str]) -> str:
    proc = subprocess.run(["bash", str(path), *args], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, f"{path.name} {args}: {proc.stderr[-4000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def cluster():
    if not PG_BIN and not shutil.which("initdb"):
        if os.environ.get("CI") == "true":
            pytest.fail("PostgreSQL server programs (initdb) missing in CI")
        pytest.skip("PostgreSQL server programs (initdb) not installed")
    # under /tmp and world-enterable: as root, PostgreSQL runs as the postgres user
    folder = Path(tempfile.mkdtemp(prefix="hptcl", dir="/tmp"))
    folder.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HPT_", "RAY_", "MLFLOW_"))}
    # without the Ray dashboard: nothing here reads it, and it is a dozen processes on 2 cores
    env.update(PYTHON=sys.executable, HPT_CLUSTER_DIR=str(folder / "c"), OMP_NUM_THREADS="1",
               HPT_RAY_DASHBOARD="0")
    # Ray's GCS declares a silent node dead after missed health checks (every 3 s, 5 misses
    # by default); checked twice a second, a killed worker host is noticed in ~1.5 s
    env.update(RAY_health_check_period_ms="500", RAY_health_check_timeout_ms="500",
               RAY_health_check_failure_threshold="3")
    try:
        out = _script(UP, env=env)
        assert "API" in out and "MLflow server" in out
        settings = dict(re.findall(r"^export (\w+)=(.*)$", (folder / "c" / "env").read_text(),
                                   flags=re.M))
        yield {"dir": folder / "c", "script_env": env, "env": {**env, **settings}, **settings}
    finally:
        subprocess.run(["bash", str(DOWN), "--purge"], env=env, capture_output=True,
                       timeout=300)
        shutil.rmtree(folder, ignore_errors=True)


def _client(cluster) -> Client:
    return Client(cluster["HPT_URL"], token=cluster["HPT_API_TOKEN"])


def _raylet_node_id(cluster, name: str) -> str | None:
    """The Ray node id of one of the cluster's raylets (found by its node's temp dir)."""
    state = dict(re.findall(r"^(\w+)=(.*)$", (cluster["dir"] / "state").read_text(), re.M))
    marker = f"{state['RAY_TMP']}/{name}/"
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "raylet" in (p.info["name"] or "") and marker in cmd:
            found = re.search(r"--node_id=([0-9a-f]+)", cmd)
            return found.group(1) if found else None
    return None


def _wait(client: Client, sweep_id: str, timeout: float = 900) -> dict:
    return client.wait(sweep_id, poll=0.5, timeout=timeout, progress=False)


def _store(cluster):
    from hptransfer.store.store import Store

    return Store(cluster["HPT_DATABASE_URL"])


def _mlflow(cluster):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=cluster["MLFLOW_TRACKING_URI"])


def _artifact_paths(ml, run_id: str, path: str | None = None) -> list[str]:
    out = []
    for f in ml.list_artifacts(run_id, path):
        out += _artifact_paths(ml, run_id, f.path) if f.is_dir else [f.path]
    return out


def _check_in_mlflow(cluster, sweep_id: str, rows: list[dict]) -> None:
    """Every finished trial has a run on the MLflow server with its status, final metrics
    and curve; the sweep's run has the fits and the dashboard, behind the artifact proxy;
    no trial has two finished runs."""
    ml = _mlflow(cluster)
    assert ml.tracking_uri.startswith("http://")
    store = _store(cluster)
    deadline = time.time() + 120  # MLflow mirrors the app DB shortly after
    while store.mirror_backlog(sweep_id) > 1:  # the sweep's own end may come with artifacts
        assert time.time() < deadline, "the MLflow mirror never caught up"
        time.sleep(0.5)
    sweep = store.get_sweep(sweep_id)
    parent = ml.get_run(sweep.mlflow_run_id)
    assert parent.info.artifact_uri.startswith("mlflow-artifacts:"), parent.info.artifact_uri
    runs = ml.search_runs([sweep.mlflow_experiment_id], max_results=1000)
    finished_runs = [r for r in runs
                     if r.info.status == "FINISHED" and r.info.run_id != parent.info.run_id]
    finished = Counter(r.data.tags.get("hpt.trial_id") for r in finished_runs)
    run_of = {r.data.tags.get("hpt.trial_id"): r.info.run_id for r in finished_runs}
    for row in rows:
        assert finished[row.id] == 1, (row.id, finished)
        run = ml.get_run(run_of[row.id])
        assert run.info.status == "FINISHED"
        if row.final_val_loss is not None:
            assert run.data.metrics["final_val_loss"] == pytest.approx(row.final_val_loss)
        curve = ml.get_metric_history(run.info.run_id, "train_loss")
        assert len(curve) >= 2
    deadline = time.time() + 120  # the sweep's artifacts land just after its status
    while True:
        paths = _artifact_paths(ml, parent.info.run_id)
        if any("fits" in p for p in paths) and any("dashboard" in p for p in paths):
            break
        assert time.time() < deadline, paths
        time.sleep(0.5)
    # into the cluster's folder, which its teardown removes
    local = ml.download_artifacts(parent.info.run_id, next(p for p in paths if "fits" in p),
                                  tempfile.mkdtemp(prefix="art", dir=cluster["dir"]))
    assert Path(local).stat().st_size > 0


def _grid_spec(tiny_spec: dict, name: str, steps: int, lrs: list[float]) -> dict:
    spec = {**tiny_spec, "name": name, "budget": {"steps": steps, "batch_size": 4},
            "max_concurrent": 2, "retries": 2}
    spec["grid"] = {**spec["grid"], "lrs": lrs}
    return spec


def test_grid_and_optuna_sweeps_run_across_the_cluster(cluster, tiny_spec):
    worker = _raylet_node_id(cluster, "ray-worker")
    head = _raylet_node_id(cluster, "ray-head")
    assert worker and head and worker != head
    # one trial per task, one CPU each, two at a time: the second task cannot fit on the
    # node (1 CPU each) running the first, so both nodes train; 400 steps (~1.4 s of CPU):
    # at 40 a loaded host once finished the first before Ray placed the second, on the head
    apart = {"resources": {"cpus": 1, "pack": 1}}
    grid = {**_grid_spec(tiny_spec, "cluster-grid", 400, [2**-10, 2**-9, 2**-8, 2**-7]),
            **apart}
    optuna = {**_grid_spec(tiny_spec, "cluster-optuna", 10, [2**-10, 2**-6]),
              "search": {"method": "optuna", "sampler": "tpe", "n_trials": 3}}
    with _client(cluster) as c:
        with Client(cluster["HPT_URL"]) as anonymous:  # the token is required
            with pytest.raises(RuntimeError):
                anonymous.submit(grid)
        ids = [c.submit(grid)["id"], c.submit(optuna)["id"]]
        done = [_wait(c, i) for i in ids]
    assert [d["status"] for d in done] == ["completed", "completed"], done
    store = _store(cluster)
    nodes = set()
    for sweep_id, total in zip(ids, (4, 3), strict=True):
        rows = store.trials(sweep_id, limit=None)  # read from PostgreSQL itself
        assert len(rows) == total
        assert {r.status for r in rows} <= {"completed", "diverged"}
        assert all(r.result for r in rows)
        assert all(r.final_val_loss is not None for r in rows if r.status == "completed")
        nodes |= {r.result["ray_node_id"] for r in rows}
        _check_in_mlflow(cluster, sweep_id, rows)
    assert worker in nodes, (worker, nodes)  # the second node ran trials, not only the head
    import optuna as optuna_lib

    studies = [n for n in optuna_lib.get_all_study_names(cluster["HPT_OPTUNA_URL"])
               if ids[1] in n]
    assert len(studies) == 1
    study = optuna_lib.load_study(study_name=studies[0], storage=cluster["HPT_OPTUNA_URL"])
    assert len(study.trials) == 3


def test_a_study_mixing_packed_and_two_worker_shapes_spans_both_nodes(cluster, tiny_spec):
    """The large end of a study on 2 Ray Train workers, the small shapes packed, over REST on
    the cluster, with fits. Each Ray node has 1 CPU (the coordinator's none), so the two
    1-CPU workers of a trial can only be placed one per node: the trial spans nodes."""
    study = {**tiny_spec, "name": "cluster-mixed", "max_concurrent": 2}
    study["grid"] = {**study["grid"], "lrs": [2**-9, 2**-7, 2**-5]}
    study["budget"] = {"steps": 12, "batch_size": 4}
    study["stages"] = {"transfer": {"shapes": [{"width": 32, "depth": 2},
                                               {"width": 64, "depth": 2}]}}
    # 64x2 has 12 * 64^2 * 2 = 98,304 non-embedding parameters: it trains on 2 workers
    study["resources"] = {"cpus": 1, "pack": "auto",
                          "scale_out": [{"min_params": 90_000, "workers": 2, "cpus": 1}]}
    study["checkpoint"] = {"every_steps": 4}
    with _client(cluster) as c:
        sweep_id = c.submit(study)["id"]
        done = _wait(c, sweep_id)
        trials = c.trials(sweep_id)
        fits = c.fits(sweep_id)
    assert done["status"] == "completed", done
    assert trials["status"].isin(["completed", "diverged"]).all()
    workers = {(r.width, r.depth, r.result["workers"]) for r in trials.itertuples()}
    assert workers == {(32, 1, 1), (32, 2, 1), (64, 2, 2)}
    assert (trials.loc[trials["width"] == 64, "status"] == "completed").all()
    assert fits is not None
    rows = _store(cluster).trials(sweep_id, limit=None)
    _check_in_mlflow(cluster, sweep_id, rows)  # rank 0's run, one per trial
    # its finished trials leave no checkpoints behind
    assert not list((Path(cluster["HPT_HOME"]) / "checkpoints" / sweep_id).rglob("*.ckpt"))


def _doctor(cluster, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(HPT), "doctor", *args], env=cluster["env"], capture_output=True,
                          text=True, timeout=300)


def test_doctor_passes_on_the_running_cluster(cluster):
    ok = _doctor(cluster)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "FAIL" not in ok.stdout
    assert {"database", "optuna", "mlflow", "ray", "workers", "data", "api"} <= {
        line.split()[1] for line in ok.stdout.splitlines() if line.startswith("ok")}


# after the test above, and after each case's restart (cluster_up.sh waits until the restarted
# component answers), the cluster is whole: a FAIL of the stopped component's check is its stop
@pytest.mark.parametrize("component,check", [
    ("postgres", "database"), ("mlflow", "mlflow"), ("ray-worker", "ray")])
def test_doctor_names_a_stopped_component(cluster, component, check):
    _script(DOWN, component, env=cluster["script_env"])
    try:
        deadline = time.time() + 120
        while True:  # a stopped Ray node takes the head a moment to notice
            bad = _doctor(cluster, "--quick")
            if f"FAIL  {check}" in bad.stdout:
                break
            assert time.time() < deadline, bad.stdout
            time.sleep(1)
        assert bad.returncode == 1
        assert "->" in bad.stdout  # says what to do
        assert cluster["HPT_API_TOKEN"] not in bad.stdout
        assert cluster["HPT_DATABASE_URL"].split("@")[0].split(":")[-1] not in bad.stdout
    finally:
        _script(UP, env=cluster["script_env"])


# ---------------------------------------------------------------- a crashed PostgreSQL
_SUBREAPER = """
import ctypes, subprocess, sys
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
print(subprocess.run(["bash", sys.argv[1]], capture_output=True).returncode, flush=True)
sys.stdin.read()  # holds what cluster_up.sh orphaned, without ever reaping it
"""


def _pg(cluster) -> tuple[Path, dict[str, str]]:
    state = dict(re.findall(r"^(\w+)=(.*)$", (cluster["dir"] / "state").read_text(), re.M))
    return cluster["dir"] / "pg", state


def _postmaster(cluster) -> psutil.Process:
    pgdata, _ = _pg(cluster)
    return psutil.Process(int((pgdata / "postmaster.pid").read_text().split()[0]))


def _segment(cluster) -> tuple[int, int]:
    """(key, shmid) of the System V segment the cluster's PostgreSQL runs with."""
    pgdata, _ = _pg(cluster)
    key, shmid = (pgdata / "postmaster.pid").read_text().splitlines()[6].split()
    return int(key), int(shmid)


def _segments() -> list[tuple[int, int]]:
    """(key, shmid) of every System V shared-memory segment (`ipcs -m`)."""
    rows = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    return [(int(r.split()[0]), int(r.split()[1])) for r in rows if r.strip()]


def _data_dir_processes(cluster) -> list[psutil.Process]:
    """The live processes of the cluster's PostgreSQL (they all run in its data dir)."""
    pgdata, _ = _pg(cluster)
    out = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.cwd() == str(pgdata.resolve()):
                out.append(p)
        except psutil.Error:
            pass
    return out


def _busy_backend(cluster) -> tuple[subprocess.Popen, int]:
    """A psql running a long CPU-bound query, and its backend's pid once it runs: a busy
    backend notices its postmaster's death only when it next waits."""
    _, state = _pg(cluster)
    pg_bin = PG_BIN[0].parent if PG_BIN else Path(shutil.which("initdb")).parent
    url = f"postgresql://hpt:{state['PG_PASSWORD']}@127.0.0.1:{state['PG_PORT']}/postgres"
    psql = subprocess.Popen([str(pg_bin / "psql"), url, "-c",
                             "SELECT count(*) FROM generate_series(1, 10000000000)"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import psycopg

    deadline = time.time() + 30
    with psycopg.connect(url, autocommit=True) as conn:
        while True:
            row = conn.execute("SELECT pid FROM pg_stat_activity WHERE state = 'active' "
                               "AND query LIKE '%generate_series%' AND pid <> "
                               "pg_backend_pid()").fetchone()
            if row:
                return psql, row[0]
            assert time.time() < deadline, "the long query never started"
            time.sleep(0.2)


@pytest.mark.parametrize("leftover", ["zombie", "busy-backend", "busy-backend-down"])
def test_killed_postmaster_is_restarted_promptly(cluster, tiny_spec, leftover):
    """kill -9 of PostgreSQL's postmaster, then cluster_up.sh: PostgreSQL is back within
    60 s and the coordinator works on it again. What the kill leaves: a zombie postmaster
    (its parent has not reaped it; PostgreSQL and pg_ctl take its pid for a live server),
    or a backend busy in a query that outlives it holding the shared memory (PostgreSQL
    will not start beside it); `-down`: cluster_down.sh runs first and must stop it."""
    env = {**cluster["script_env"], "HPT_CLUSTER_TIMEOUT": "90"}
    holder = psql = None
    try:
        if leftover == "zombie":  # the postmaster's parent: a process that never reaps
            _script(DOWN, "postgres", env=env)
            holder = subprocess.Popen([sys.executable, "-c", _SUBREAPER, str(UP)], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True)
            assert holder.stdout.readline().strip() == "0"
            assert _postmaster(cluster).ppid() == holder.pid
        else:
            psql, backend = _busy_backend(cluster)
        postmaster = _postmaster(cluster)
        segment = _segment(cluster)
        postmaster.kill()
        time.sleep(1)
        if leftover == "zombie":
            assert postmaster.status() == psutil.STATUS_ZOMBIE
        else:  # it outlived its postmaster
            assert psutil.Process(backend).status() != psutil.STATUS_ZOMBIE
        if leftover == "busy-backend-down":
            assert segment in _segments()  # the killed postmaster left it
            _script(DOWN, "postgres", env=env)
            assert _data_dir_processes(cluster) == []
            # nor its shared memory (left for good if the data dir is deleted next: --purge)
            assert segment not in _segments()
        started = time.monotonic()
        proc = subprocess.run(["bash", str(UP)], env=env, capture_output=True, text=True,
                              timeout=300)
        took = time.monotonic() - started
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert took < 60, took
        assert _postmaster(cluster).pid != postmaster.pid
        if leftover != "zombie":
            assert not psutil.pid_exists(backend) or \
                psutil.Process(backend).status() == psutil.STATUS_ZOMBIE
    finally:
        if psql:
            psql.kill()
            psql.wait()
        if holder:  # its zombies go to init, which reaps them
            holder.stdin.close()
            holder.wait(timeout=30)
    with _client(cluster) as c:  # the coordinator reconnects: reads, writes, dispatches
        deadline = time.time() + 120
        while (health := c.health())["status"] != "ok":  # after the dispatcher's back-off
            assert time.time() < deadline, health
            time.sleep(1)
        # LRs of this case's own: the same trials as another case's would be reused from
        # its results, and nothing would be dispatched after the restart
        lrs = {"zombie": [2**-8, 2**-6], "busy-backend": [2**-9, 2**-7],
               "busy-backend-down": [2**-10, 2**-5]}[leftover]
        sweep_id = c.submit(_grid_spec(tiny_spec, f"after-pg-{leftover}", 5, lrs))["id"]
        done = _wait(c, sweep_id, timeout=300)
        trained = c.trials(sweep_id)
    assert done["status"] == "completed", done
    assert len(trained) == 2 and not trained["reused"].any(), trained


def _session(sid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (OSError, psutil.Error):
            pass
    return out


def test_killed_mlflow_server_leaves_no_orphan_on_its_port(cluster):
    """kill -9 of `mlflow server` leaves its uvicorn child serving the port: cluster_up.sh
    must clear it and start a server of its own (not take the orphan's answer for its new
    server, which died on "address already in use"), and cluster_down.sh must stop that."""
    leader = int((cluster["dir"] / "pids" / "mlflow").read_text())
    children = [p for p in _session(leader) if p.pid != leader]
    assert children  # uvicorn
    try:
        os.kill(leader, signal.SIGKILL)
        time.sleep(1)
        assert all(p.is_running() for p in children)  # the orphan is what this test is about
        _script(UP, env=cluster["script_env"])
        new = int((cluster["dir"] / "pids" / "mlflow").read_text())
        assert new != leader
        assert not [p for p in _session(leader) if p.is_running()]
        # the new server holds the port (a server that lost it to the orphan exits just after
        # the orphan answered for it): no need to wait for that exit
        port = int(cluster["MLFLOW_TRACKING_URI"].rsplit(":", 1)[1])
        assert {os.getsid(c.pid) for c in psutil.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid} == {new}
        assert psutil.Process(new).status() != psutil.STATUS_ZOMBIE
        assert _doctor(cluster, "--quick").returncode == 0
        # cluster_down stops the whole session, also after its leader was killed
        children = [p for p in _session(new) if p.pid != new]
        os.kill(new, signal.SIGKILL)
        _script(DOWN, "mlflow", env=cluster["script_env"])
        # SIGKILLed, a process may take a moment to go on a loaded host
        _, alive = psutil.wait_procs(children, timeout=15)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    finally:  # the next test needs the whole cluster
        _script(UP, env=cluster["script_env"])
