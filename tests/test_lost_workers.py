"""Lost workers: a Ray node dying mid-trial, and Ray's memory monitor killing a worker.

Each runs in a child process with a Ray cluster of its own (the test session may already
hold one): a real multi-node cluster (`ray.cluster_utils.Cluster`: several raylets on this
machine), and a local cluster whose OOM threshold is set so low that Ray kills every worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from mlflow.tracking import MlflowClient

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    import ray
    from ray.cluster_utils import Cluster
    from hptransfer.config import get_settings
    from hptransfer.coordinator.service import Coordinator

    spec = json.loads(sys.argv[1])
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 0, "include_dashboard": False})
    doomed = cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False)
    coordinator = Coordinator(get_settings())
    coordinator.start()
    sweep = coordinator.submit(spec)
    store = coordinator.store

    def trial():
        return store.trials(sweep["id"], limit=None)[0]

    def training_step():
        attempt = coordinator.dispatcher.in_flight.get(trial().id)
        return attempt.last_step if attempt else 0

    deadline = time.time() + 120
    while training_step() == 0:  # the worker has reported a step: training is underway
        assert time.time() < deadline, "never started training"
        time.sleep(0.05)
    cluster.remove_node(doomed, allow_graceful=False)
    cluster.add_node(num_cpus=1)  # a replacement for the retry
    while store.get_sweep(sweep["id"]).status in ("pending", "running"):
        assert time.time() < deadline + 120, "never finished"
        time.sleep(0.3)
    coordinator.stop()
    t = trial()
    print("RESULT " + json.dumps({"status": t.status, "attempts": t.attempts, "error": t.error,
                                  "sweep": store.get_sweep(sweep["id"]).to_dict(),
                                  "mlflow_uri": get_settings().mlflow_uri}, default=str))
    ray.shutdown()
    cluster.shutdown()
    # Ray is down: skip the interpreter's teardown (seconds of gRPC's and torch's finalizers)
    sys.stdout.flush()
    os._exit(0)
    """
)


def run_in_child(script: str, spec: dict, tmp_path, timeout: float, **extra_env: str) -> dict:
    """Run `script` with the spec in a fresh process and HPT_HOME; return its RESULT line."""
    env = {**os.environ, "HPT_HOME": str(tmp_path / "hpt"), "OMP_NUM_THREADS": "1",
           **extra_env}
    for var in ("RAY_ADDRESS", "HPT_DATABASE_URL", "HPT_OPTUNA_URL", "MLFLOW_TRACKING_URI"):
        env.pop(var, None)
    out = subprocess.run([sys.executable, "-c", script, json.dumps(spec)], env=env,
                         capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_node_death_is_retried(tmp_path, tiny_spec):
    tiny_spec["grid"]["lrs"] = [2**-6]
    # the node is removed once a step is reported (step ~15-40): ~770 steps are left, seconds
    # of training (2.5-5 ms a step on 2 cores), against the removal's ~0.1 s
    tiny_spec["budget"] = {"steps": 800, "batch_size": 4}
    tiny_spec["retries"] = 1
    # Ray's GCS declares a silent node dead after a few missed health checks (3 s apart by
    # default, 5 misses); checked twice a second here, it notices in ~1.5 s, not ~15 s
    result = run_in_child(SCRIPT, tiny_spec, tmp_path, timeout=400,
                          RAY_health_check_period_ms="500", RAY_health_check_timeout_ms="500",
                          RAY_health_check_failure_threshold="3",
                          RAY_health_check_initial_delay_ms="0")
    assert result["status"] == "completed"
    assert result["attempts"] == 2  # the lost attempt counts; the retry completed
    # the lost attempt is a FAILED MLflow run that says why
    ml = MlflowClient(result["mlflow_uri"])
    runs = ml.search_runs([result["sweep"]["mlflow_experiment_id"]],
                          filter_string="tags.`hpt.role` = 'trial'")
    failed = [r for r in runs if r.info.status == "FAILED"]
    assert len(failed) == 1 and len(runs) == 2
    assert "NodeDiedError" in failed[0].data.tags.get("hpt.error", "")


OOM_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    import ray
    from hptransfer.config import get_settings
    from hptransfer.coordinator.service import Coordinator

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    coordinator = Coordinator(get_settings())
    coordinator.start()
    sweep = coordinator.submit(json.loads(sys.argv[1]))
    deadline = time.time() + 150
    while coordinator.store.get_sweep(sweep["id"]).status in ("pending", "running"):
        assert time.time() < deadline, "never finished"
        time.sleep(0.3)
    coordinator.stop()
    t = coordinator.store.trials(sweep["id"], limit=None)[0]
    print("RESULT " + json.dumps({"status": t.status, "attempts": t.attempts,
                                  "error": t.error}))
    ray.shutdown()
    sys.stdout.flush()
    os._exit(0)  # as SCRIPT does
    """
)


def test_oom_killed_worker_is_retried_then_failed(tmp_path, tiny_spec):
    tiny_spec["grid"]["lrs"] = [2**-6]
    tiny_spec["budget"] = {"steps": 300, "batch_size": 4}
    tiny_spec["retries"] = 1
    # Ray's memory monitor: kill workers once the node is 5 % full, i.e. always
    result = run_in_child(OOM_SCRIPT, tiny_spec, tmp_path, timeout=300,
                          RAY_memory_usage_threshold="0.05", RAY_memory_monitor_refresh_ms="100")
    assert result["status"] == "failed"
    assert result["attempts"] == 2  # retried once (retries: 1), then given up
    assert result["error"].startswith("OutOfMemoryError")
