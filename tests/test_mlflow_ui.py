"""`hpt mlflow-ui` on what the mirror wrote, in headless Chromium: the experiment's page, as
hpt links it, opens on its training runs, the trial runs nested under the sweep's parent run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import psutil
from test_dashboards import chromium, needs_chromium
from test_health import HPT
from test_tracking import Planned, curve, result, trial_spec

from hptransfer.api.server import free_port
from hptransfer.store.store import Store
from hptransfer.tracking.mirror import Mirror
from hptransfer.tracking.tracking import ui_url


@needs_chromium
def test_runs_page_of_a_mirrored_sweep_in_headless_chromium(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'hpt.db'}")
    store.migrate()
    planned = [Planned("cp", trial_spec(lr), 128, 2, lr, 0.02, 0, f"h{i}")
               for i, lr in enumerate((2**-8, 2**-6))]
    sid = store.create_sweep(name="ui-check", spec={"name": "ui-check"}, spec_hash="h",
                             search="grid", planned=planned, reuse=False)
    for t in store.lease_pending("coord", 2):
        store.finish_trial(t.id, "completed", result("completed", t.lr, curve(20)))
    store.refresh_sweep_status(sid)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    Mirror(store, uri, str(tmp_path / "artifacts")).sync()
    experiment_id = store.get_sweep(sid).mlflow_experiment_id
    store.close()

    port = free_port()
    log = open(tmp_path / "mlflow-ui.log", "wb")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HPT_", "MLFLOW_"))}
    ui = subprocess.Popen([str(HPT), "mlflow-ui", "--host", "127.0.0.1", "--port", str(port)],
                          env={**env, "HPT_HOME": str(tmp_path)}, stdout=log,
                          stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert ui.poll() is None, (tmp_path / "mlflow-ui.log").read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "mlflow ui did not start"
            time.sleep(0.1)
        # MLflow's GenAI job runner (huey consumers) is off: only the UI's own processes
        tree = [" ".join(p.cmdline()) for p in psutil.Process(ui.pid).children(recursive=True)]
        assert tree and not [c for c in tree if "huey" in c or "jobs._job_runner" in c], tree
        # the experiment's landing page as hpt links it, in a fresh browser profile (whose
        # stored workflow choice is MLflow's default, GenAI): it must open on the runs
        url = ui_url(f"http://127.0.0.1:{port}", experiment_id)
        dom, _ = chromium(url, tmp_path / "mlflow-runs.png", budget_ms=25_000, height=1200)
    finally:
        os.killpg(ui.pid, signal.SIGTERM)  # the ui and its server workers: our session only
        ui.wait(30)
        log.close()
    # the model-training view's runs page: its "Runs" tab, not the GenAI view (where the
    # landing page is a traces overview and the runs tab is called "Training runs")
    assert ">Runs<" in dom and "Training runs" not in dom, dom[-2000:]
    assert "mlflow.experiment.overview" not in dom  # the GenAI overview's components
    assert "ui-check" in dom  # the parent run by name, its two trial runs nested under it
    assert re.search(r">\s*3\s*<.*matching runs", dom), "3 runs: parent and two trials"
