"""Per-trial overhead of the whole service path for trivial trials, against `run_trial`.

The path: POST /sweeps (validate, plan, hash the data, store) -> dispatcher lease -> Ray task
-> trainer -> result row in the app DB -> MLflow run finished. A real `hpt serve` runs as a
subprocess with its own local Ray cluster, SQLite app DB and SQLite MLflow store in a scratch
HPT_HOME. Trials are tiny (width 32, depth 1, 2 steps by default) so what is measured is the
machinery, not training.

* baseline: `run_trial` called directly in this process for the same TrialSpec (warmed up);
* latency: N one-trial sweeps, one after another; per trial, submit -> result row, minus the
  trial's own `wall_time_s` (the trainer's figure) = overhead; also split into submit -> lease,
  lease -> row beyond the trial's own time, and row -> MLflow done (the sweep's finished_at,
  written after the trial's MLflow run is finished);
* throughput: one N-trial sweep with max_concurrent 1, then 2: trials per minute from submit to
  the last result row, and (max_concurrent 1) the steady-state cost per trial: the gap between
  consecutive result rows minus the trial's own time.

All times come from the app DB's timestamps and one clock (this machine's), so polling does not
blur them.

    .venv/bin/python benchmarks/dispatch_overhead.py [--trials 20] [--steps 2] [--keep]
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import ray  # noqa: F401  (puts Ray's vendored psutil on sys.path)
from mlflow.tracking import MlflowClient

from hptransfer.api.server import free_port
from hptransfer.client import Client
from hptransfer.coordinator.plan import plan_sweep
from hptransfer.spec import SweepSpec
from hptransfer.store.store import Store
from hptransfer.workers.trainer import run_trial

psutil = importlib.import_module("psutil")  # vendored by Ray: importable after `import ray`

FOREIGN_ENV = ("RAY_ADDRESS", "HPT_DATABASE_URL", "HPT_OPTUNA_URL", "MLFLOW_TRACKING_URI",
               "HPT_API_TOKEN", "HPT_PORT", "HPT_HOST")


def sweep_spec(name: str, n_trials: int, width: int, depth: int, steps: int,
               max_concurrent: int) -> dict[str, Any]:
    """`n_trials` distinct trivial trials (they differ in LR only); reuse off so each runs."""
    return {
        "name": name,
        "arms": [{"arch": "gpt", "parameterization": "completep"}],
        "grid": {"widths": [width], "depths": [depth],
                 "lrs": [2.0 ** (-6 - 0.25 * i) for i in range(n_trials)], "seeds": [0]},
        "fixed": {"head_dim": 32, "seq_len": 32, "base_width": width, "base_depth": depth,
                  "device": "cpu", "eval_every": steps},
        "budget": {"steps": steps, "batch_size": 4},
        "data": {"source": "stdlib", "val_tokens": 1024, "max_corpus_bytes": 400_000},
        "max_concurrent": max_concurrent,
        "retries": 0,
        "reuse": False,
    }


# ------------------------------------------------------------------ the server


class Server:
    """`hpt serve` in a session of its own, with its own in-process Ray cluster."""

    def __init__(self, home: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = home.parent / "serve.log"
        env = {k: v for k, v in os.environ.items() if k not in FOREIGN_ENV}
        env.update(HPT_HOME=str(home), OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "hptransfer.cli", "serve", "--port", str(self.port),
               "--log-level", "warning"]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_ready(self, timeout: float = 180) -> float:
        start = time.perf_counter()
        while time.perf_counter() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"hpt serve exited:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.perf_counter() - start
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError("hpt serve did not come up")

    def stop(self) -> None:
        """SIGTERM (graceful: dispatcher stop, Ray shutdown); SIGKILL whatever is left of the
        tree (the process group, and Ray workers, which run in sessions of their own)."""
        if self.proc.poll() is not None:
            return
        root = psutil.Process(self.proc.pid)
        tree = [root, *root.children(recursive=True)]
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for proc in tree:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(tree, timeout=30)
        self.proc.wait(30)


# ------------------------------------------------------------------ measuring


def run_sweep(client: Client, store: Store, mlflow: MlflowClient, spec: dict[str, Any],
              timeout: float = 600) -> tuple[datetime, dict[str, Any], list[dict[str, Any]]]:
    """Submit, wait until the sweep has ended and its MLflow parent run is closed (so the
    sweep-finished hook cannot delay the next measurement); (submit time, sweep, trials)."""
    t0 = datetime.now(UTC)
    sweep_id = client.submit(spec)["id"]
    deadline = time.monotonic() + timeout
    while client.get(sweep_id)["status"] not in ("completed", "failed", "cancelled"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"sweep {sweep_id} not done after {timeout} s")
        time.sleep(0.1)
    sweep = store.get_sweep(sweep_id)
    parent = sweep.mlflow_run_id
    while parent and mlflow.get_run(parent).info.status == "RUNNING":
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    trials = store.trials(sweep_id, limit=None)
    bad = [t.status for t in trials if t.status != "completed"]
    if bad:
        raise RuntimeError(f"sweep {sweep_id}: trials ended {bad}: {trials[0].error}")
    return t0, sweep, trials


def seconds(a: datetime, b: datetime) -> float:
    return (b - a).total_seconds()


def med_p90(values: list[float]) -> tuple[float, float]:
    arr = np.asarray(values, dtype=float)
    return float(np.median(arr)), float(np.percentile(arr, 90))


def baseline(spec: dict[str, Any], n: int, cache_dir: Path) -> tuple[list[float], list[float]]:
    """run_trial in this process for the same TrialSpec (as the dispatcher sends it:
    num_threads = cpus per trial = 1); (call times, the trainer's own wall_time_s)."""
    trial = plan_sweep(SweepSpec.model_validate(spec))[0].trial
    trial_spec = trial.model_dump(mode="json") | {"num_threads": 1}
    for _ in range(2):  # warm-up: tokenizer cache, torch kernels
        run_trial(trial_spec, cache_dir=str(cache_dir))
    calls, own = [], []
    for _ in range(n):
        start = time.perf_counter()
        result = run_trial(trial_spec, cache_dir=str(cache_dir))
        calls.append(time.perf_counter() - start)
        own.append(result.wall_time_s)
        assert result.status == "completed", result.error
    return calls, own


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=20, help="trials per measurement")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--depth", type=int, default=1)
    p.add_argument("--keep", action="store_true", help="keep the scratch HPT_HOME")
    a = p.parse_args(argv)
    n = a.trials
    logging.getLogger("mlflow").setLevel(logging.WARNING)  # its DB-setup INFO lines

    scratch = Path(tempfile.mkdtemp(prefix="hpt-bench-"))
    home = scratch / "hpt"
    home.mkdir()
    print(f"scratch HPT_HOME {home}; {os.cpu_count()} CPUs; one torch thread per trial",
          flush=True)

    def spec(name: str, trials: int, mc: int = 1) -> dict[str, Any]:
        return sweep_spec(name, trials, a.width, a.depth, a.steps, mc)

    # 1. baseline first, alone on the CPUs
    calls, own_direct = baseline(spec("baseline", 1), n, home / "cache")
    print(f"baseline done: run_trial median {np.median(calls) * 1e3:.1f} ms", flush=True)

    server = Server(home)
    try:
        startup = server.wait_ready()
        print(f"hpt serve up in {startup:.1f} s on {server.url}", flush=True)
        store = Store(f"sqlite:///{home / 'hpt.db'}")
        mlflow = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
        with Client(server.url) as client:
            # warm-up: Ray starts and imports torch in both workers
            run_sweep(client, store, mlflow, spec("warmup", 4, mc=2))

            # 2. latency: one-trial sweeps, one after another
            lat: dict[str, list[float]] = {k: [] for k in
                                           ("own", "row", "lease", "ray", "mlflow", "all")}
            for i in range(n):
                one = spec(f"latency-{i}", 1)
                one["grid"]["lrs"] = [2.0 ** (-6 - 0.25 * i)]
                t0, sweep, (trial,) = run_sweep(client, store, mlflow, one)
                own = trial.wall_time_s
                lat["own"].append(own)
                lat["row"].append(seconds(t0, trial.finished_at))
                lat["lease"].append(seconds(t0, trial.started_at))
                lat["ray"].append(seconds(trial.started_at, trial.finished_at) - own)
                lat["mlflow"].append(seconds(trial.finished_at, sweep.finished_at))
                lat["all"].append(seconds(t0, sweep.finished_at))
            print("latency done", flush=True)

            # 3. throughput: one n-trial sweep per max_concurrent
            thr: dict[int, dict[str, Any]] = {}
            for mc in (1, 2):
                t0, _, trials = run_sweep(client, store, mlflow, spec(f"throughput-{mc}", n, mc))
                ends = sorted(t.finished_at for t in trials)
                span = seconds(t0, ends[-1])
                thr[mc] = {"span": span, "per_min": 60 * n / span,
                           "own": [t.wall_time_s for t in trials]}
                if mc == 1:
                    by_end = sorted(trials, key=lambda t: t.finished_at)
                    prev = [t0] + [t.finished_at for t in by_end[:-1]]
                    thr[mc]["gap_over"] = [seconds(p_, t.finished_at) - t.wall_time_s
                                           for p_, t in zip(prev, by_end, strict=True)][1:]
                print(f"throughput max_concurrent={mc} done", flush=True)
        store.close()
    finally:
        server.stop()
        if not a.keep:
            shutil.rmtree(scratch, ignore_errors=True)

    # ---------------------------------------------------------------- report
    own_med = float(np.median(own_direct))
    print()
    print(f"Dispatch overhead: gpt/completep width {a.width} depth {a.depth}, {a.steps} steps "
          f"x batch 4 x seq 32, stdlib bytes; {n} trials per row; {os.cpu_count()} CPUs")
    print()
    head = (f"{'path':<48} {'own run s':>10} {'to result s':>17} {'overhead s':>17} "
            f"{'overhead/own':>13}")
    print(head)
    print(f"{'':<48} {'median':>10} {'median / p90':>17} {'median / p90':>17} {'median':>13}")
    print("-" * len(head))

    def row(label: str, own: list[float], total: list[float] | None,
            over: list[float]) -> None:
        o_med = float(np.median(own))
        tot = "" if total is None else "{:.3f} / {:.3f}".format(*med_p90(total))
        ov_med, ov_p90 = med_p90(over)
        print(f"{label:<48} {o_med:>10.3f} {tot:>17} {f'{ov_med:.3f} / {ov_p90:.3f}':>17} "
              f"{ov_med / o_med:>12.1f}x")

    row("run_trial in-process (baseline)", own_direct, calls,
        [c - o for c, o in zip(calls, own_direct, strict=True)])
    over_row = [r - o for r, o in zip(lat["row"], lat["own"], strict=True)]
    row("service: submit -> result row (1-trial sweeps)", lat["own"], lat["row"], over_row)
    over_all = [r - o for r, o in zip(lat["all"], lat["own"], strict=True)]
    row("service: submit -> row + MLflow done", lat["own"], lat["all"], over_all)
    row("service: in a sweep, mc=1 (gap between rows)", thr[1]["own"], None, thr[1]["gap_over"])
    print()
    print("where the 1-trial overhead goes (median / p90 s):")
    for key, label in (("lease", "submit (HTTP, validate, data hash, store) -> leased"),
                       ("ray", "leased -> result row, beyond the trial's own time"),
                       ("mlflow", "result row -> MLflow run finished")):
        print("  {:<56} {:.3f} / {:.3f}".format(label, *med_p90(lat[key])))
    print()
    print(f"{'throughput':<48} {'trials/min':>10} {'wall s':>8}")
    print(f"{'run_trial in-process, back to back':<48} {60 / np.median(calls):>10.1f} "
          f"{sum(calls):>8.2f}")
    for mc in (1, 2):
        print(f"{f'service sweep, max_concurrent={mc}':<48} {thr[mc]['per_min']:>10.1f} "
              f"{thr[mc]['span']:>8.2f}")
    print(f"\n(service startup, Ray included: {startup:.1f} s; trial own time in-process "
          f"{own_med * 1e3:.0f} ms median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
