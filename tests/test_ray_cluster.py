"""RAY_ADDRESS: the coordinator joins an existing Ray cluster instead of starting its own.

A real head node is started with `ray start --head` (its own temp dir and port), and
`hpt serve` runs as a separate process pointed at it, as on a multi-node deployment.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hptransfer.client import Client
from hptransfer.sockets import free_port

RAY = Path(sys.executable).with_name("ray")
HPT = Path(sys.executable).with_name("hpt")


def _kill(proc: subprocess.Popen, marker: str | None = None) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(30)
    if marker:  # Ray daemons that left the process group
        subprocess.run(["pkill", "-9", "-f", marker], check=False)


@pytest.fixture
def ray_head():
    temp_dir = tempfile.mkdtemp(prefix="/tmp/hptray")  # short: unix socket paths are limited
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen(
        [str(RAY), "start", "--head", f"--port={port}", "--num-cpus=2", "--num-gpus=0",
         "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}",
         "--block"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True,
    )
    deadline = time.time() + 90
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        assert proc.poll() is None, "ray start --head exited"
        assert time.time() < deadline, "ray head did not come up"
        time.sleep(0.2)
    yield f"127.0.0.1:{port}"
    _kill(proc, marker=temp_dir)
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
def test_coordinator_joins_existing_cluster(ray_head, tmp_path, tiny_spec):
    port = free_port()
    env = {**os.environ, "RAY_ADDRESS": ray_head, "HPT_HOME": str(tmp_path / "hpt"),
           "OMP_NUM_THREADS": "1"}
    for var in ("HPT_DATABASE_URL", "HPT_OPTUNA_URL", "MLFLOW_TRACKING_URI", "HPT_API_TOKEN"):
        env.pop(var, None)
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen([str(HPT), "serve", "--port", str(port)], stdout=log,
                              stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        with Client(url) as c:
            deadline = time.time() + 120
            while True:
                try:
                    health = c.health()
                    break
                except RuntimeError:
                    assert server.poll() is None, (tmp_path / "serve.log").read_text()
                    assert time.time() < deadline, "hpt serve did not start"
                    time.sleep(0.2)
            # joined the head's GCS, not a cluster of its own
            assert health["ray_address"].endswith(":" + ray_head.split(":")[1])
            s = c.submit(tiny_spec)
            done = c.wait(s["id"], poll=0.25, timeout=300, progress=False)
            df = c.trials(s["id"])
        assert done["status"] == "completed"
        assert set(df["status"]) <= {"completed", "diverged"}
        assert df["worker_node"].notna().all()
    finally:
        _kill(server)
        log.close()


THREAD_SCRIPT = """
import os, sys, threading, time, ray
from hptransfer.config import get_settings
from hptransfer.coordinator.dispatch import init_ray

# a short-lived thread starts the cluster (a server thread's start-up, TestClient's portal)
t = threading.Thread(target=init_ray, args=(get_settings(),))
t.start(); t.join()
# the starting thread is gone; Ray kills what a dead thread started (PR_SET_PDEATHSIG: at
# once; such a GCS dies well within the second, and the process with it after Ray's 60 s)
time.sleep(1)
gcs = [p for p in ray._private.worker._global_node.all_processes["gcs_server"]]
assert all(p.process.poll() is None for p in gcs), "GCS died with its starting thread"
print("OK", ray.get(ray.remote(lambda: 41 + 1).remote()))
ray.shutdown()
sys.stdout.flush()
os._exit(0)  # Ray is down: not seconds more of the interpreter's teardown (gRPC, torch)
"""


def test_a_cluster_started_off_the_main_thread_outlives_that_thread(tmp_path):
    env = {**os.environ, "HPT_HOME": str(tmp_path / "hpt")}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-c", THREAD_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0 and "OK 42" in out.stdout, out.stderr[-3000:]
