"""The dispatch loop: lease pending trials, run them as Ray tasks, write results back.

One coordinator per app database. Retry policy lives here, not in Ray (tasks run with
max_retries=0) so every attempt is visible in the trial row: worker death, node death and
OOM kills go back to pending until the sweep's retry limit; a Python exception inside
training comes back as a `failed` TrialResult and is final. A freed slot is refilled in the
same tick, so a pruned or finished trial starts the next one immediately.
"""

from __future__ import annotations

import logging
import math
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optuna
import ray
from ray.exceptions import (
    NodeDiedError,
    ObjectLostError,
    OutOfMemoryError,
    RayActorError,
    TaskCancelledError,
    WorkerCrashedError,
)
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from hptransfer.config import Settings
from hptransfer.workers.remote import execute_trial

from .db.store import FINISHED_STATUSES, Store
from .mlflow.tracking import Tracker
from .optuna_search import OptunaSearch
from .plan import ShapeKey, plan_shapes, trial_for
from .progress import ProgressBoard
from .spec import SweepSpec
from .study import next_step

log = logging.getLogger(__name__)

RETRYABLE = (WorkerCrashedError, NodeDiedError, OutOfMemoryError, ObjectLostError, RayActorError)
ACTIVE = ("pending", "running")


@dataclass
class InFlight:
    trial: dict[str, Any]
    ref: ray.ObjectRef
    run_id: str | None
    cpus: float
    gpus: float
    last_step: int = 0  # the latest step the worker reported: > 0 once training is underway


def init_ray(settings: Settings) -> None:
    """Join RAY_ADDRESS when set, else start an in-process local cluster."""
    if ray.is_initialized():
        return
    if settings.ray_address:
        ray.init(address=settings.ray_address, ignore_reinit_error=True, log_to_driver=False)
    else:
        # "local": always a fresh in-process cluster, never one a stale
        # /tmp/ray/ray_current_cluster file points at
        # configure_logging=False: the application's logging config (levels) applies
        ray.init(address="local", include_dashboard=False, ignore_reinit_error=True,
                 log_to_driver=False, configure_logging=False)


class Dispatcher:
    def __init__(
        self,
        store: Store,
        settings: Settings,
        tracker: Tracker | None = None,
        owner: str | None = None,
        poll_interval: float = 0.2,
        on_sweep_finished: Callable[[str], dict[str, str | bytes]] | None = None,
    ) -> None:
        self.store, self.settings, self.tracker = store, settings, tracker
        self.owner = owner or f"coord-{uuid.uuid4().hex[:10]}"
        self.poll_interval = poll_interval
        self.on_sweep_finished = on_sweep_finished
        self.in_flight: dict[str, InFlight] = {}
        self.waiting: dict[str, str] = {}  # sweep id -> why its trials cannot start now
        self.optuna = OptunaSearch(settings.optuna_url)
        self._specs: dict[str, SweepSpec] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._board = None
        self._remote = None
        self.last_error: str | None = None

    # lifecycle -----------------------------------------------------------------------
    def start(self, background: bool = True) -> None:
        init_ray(self.settings)
        # on the coordinator's own node, restarted if it dies: losing a worker node must
        # not take the metrics side channel (and with it every dispatch tick) down
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        self._board = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(
            ProgressBoard).options(scheduling_strategy=here).remote()
        self._remote = ray.remote(execute_trial)
        if self.tracker:
            self.tracker.flush_outbox()  # replay what an MLflow outage left behind
        self._close_orphan_runs()
        n = self.store.requeue_orphans(self.owner)
        if n:
            log.warning("re-queued %d trials left running by a previous coordinator", n)
        if background:
            self._thread = threading.Thread(target=self._loop, name="hpt-dispatch", daemon=True)
            self._thread.start()

    def _close_orphan_runs(self) -> None:
        """Bring MLflow in line with the app DB after a coordinator died: the attempts it
        left running end as KILLED (the re-queued attempt gets a new run), and a finished
        trial whose run never got its result (killed between the two writes) gets it now."""
        if not self.tracker:
            return
        for sweep in self.store.active_sweeps():
            rows = {t["id"]: t for t in self.store.trials(sweep["id"], limit=None)}
            open_runs = self.tracker.open_trial_runs(sweep["id"])
            if open_runs is None:  # MLflow away: close what the app DB knows (via the outbox)
                open_runs = {t["mlflow_run_id"]: tid for tid, t in rows.items()
                             if t["status"] == "running" and t.get("mlflow_run_id")}
            for run_id, trial_id in sorted(open_runs.items()):
                t = rows.get(trial_id)
                if t is None or (t["status"] == "running" and t.get("lease_owner") == self.owner):
                    continue
                if t["status"] in FINISHED_STATUSES and t.get("mlflow_run_id") == run_id:
                    self.tracker.finish_trial(run_id, t.get("result") or {"error": t["error"]},
                                              t["status"], trial_id=trial_id)
                else:
                    self.tracker.finish_trial(
                        run_id, {"error": "coordinator died during this attempt; re-queued"},
                        "cancelled", trial_id=trial_id)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                busy = self.run_once()
                self.last_error = None
            except Exception as exc:  # keep dispatching; surface the problem in /health
                log.exception("dispatch tick failed")
                self.last_error = f"{type(exc).__name__}: {exc}"
                busy = False
            if not busy:
                self._idle_wait()

    def wake(self) -> None:
        """Ask the loop to look for work now (a sweep was submitted or cancelled)."""
        self._wake.set()

    def _idle_wait(self) -> None:
        """Sleep until a trial finishes, work is submitted, or one poll interval passes —
        whichever is first, so a finished trial's slot is refilled without polling delay."""
        if self.in_flight:
            ray.wait([f.ref for f in self.in_flight.values()], num_returns=1,
                     timeout=self.poll_interval)
        else:
            self._wake.wait(self.poll_interval)
        self._wake.clear()

    # one tick ------------------------------------------------------------------------
    def run_once(self) -> bool:
        self._cancel_cancelled()
        self._relay_progress()
        collected = self._collect()
        started = self._fill()
        return bool(collected or started)

    def _in_flight_for(self, sweep_id: str) -> list[InFlight]:
        return [f for f in self.in_flight.values() if f.trial["sweep_id"] == sweep_id]

    def _spec(self, sweep: dict[str, Any]) -> SweepSpec:
        if sweep["id"] not in self._specs:
            self._specs[sweep["id"]] = SweepSpec.model_validate(sweep["spec"])
        return self._specs[sweep["id"]]

    def _cancel_cancelled(self) -> None:
        for sweep_id in {f.trial["sweep_id"] for f in self.in_flight.values()}:
            if self.store.get_sweep(sweep_id)["status"] == "cancelled":
                for f in self._in_flight_for(sweep_id):
                    ray.cancel(f.ref, force=True)

    def _relay_progress(self) -> None:
        try:
            updates = ray.get(self._board.drain.remote(), timeout=10)
        except Exception as exc:  # live metrics are best effort; results still arrive
            log.warning("progress board unavailable: %s", exc)
            return
        for trial_id, points in updates.items():
            f = self.in_flight.get(trial_id)
            if f is None:
                continue
            f.last_step = max([f.last_step, *(int(p.get("step") or 0) for p in points)])
            if self.tracker:
                self.tracker.log_metrics(f.run_id, points, trial_id=trial_id)
            if f.trial.get("optuna_trial_number") is not None:
                for p in points:
                    val = p.get("val_loss")
                    if val is not None and self.optuna.should_prune(trial_id, p["step"], val):
                        self._board.request_stop.remote(trial_id)
                        break

    def _collect(self) -> int:
        if not self.in_flight:
            return 0
        refs = [f.ref for f in self.in_flight.values()]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        by_ref = {f.ref: tid for tid, f in self.in_flight.items()}
        for ref in ready:
            self._finish(by_ref[ref], ref)
        return len(ready)

    def _finish(self, trial_id: str, ref: ray.ObjectRef) -> None:
        f = self.in_flight.pop(trial_id)
        sweep_id = f.trial["sweep_id"]
        status, result, error = None, None, None
        try:
            result = ray.get(ref)
            status, error = result["status"], result.get("error")
            self.store.finish_trial(trial_id, status, result, error, result.get("worker_node"))
        except TaskCancelledError:
            status = "cancelled"
            self.store.mark_cancelled(trial_id)
        except RETRYABLE as exc:
            error = f"{type(exc).__name__}: {exc}"
            status = self.store.requeue(trial_id, error)  # "pending" or "failed"
            log.warning("trial %s lost its worker (%s); now %s", trial_id, error[:200], status)
        except Exception as exc:  # anything else escaping the task is final
            status, error = "failed", f"{type(exc).__name__}: {exc}"
            self.store.finish_trial(trial_id, "failed", None, error)
        self._board.forget.remote(trial_id)
        if self.tracker:
            # a retried attempt gets a fresh run; this one ends as failed with the worker error
            self.tracker.finish_trial(f.run_id, result or {"error": error},
                                      "failed" if status == "pending" else status,
                                      trial_id=trial_id)
        if f.trial.get("optuna_trial_number") is not None and status != "pending":
            self._tell_optuna(f.trial, status, result)
        self.optuna.forget(trial_id)
        self._refresh(sweep_id)

    def _refresh(self, sweep_id: str) -> None:
        sweep = self.store.get_sweep(sweep_id)
        before = sweep["status"]
        spec = self._spec(sweep)
        if before in ACTIVE and spec.search.method == "optuna" and self._optuna_left(sweep_id,
                                                                                     spec):
            return  # the studies still have trials to ask: not finished yet
        if before in ACTIVE and sweep.get("study") and not sweep["study"].get("done"):
            return  # a study with stages to plan: _advance_study (next _fill) decides
        after = self.store.refresh_sweep_status(sweep_id)
        if before in ACTIVE and after not in ACTIVE:
            self._sweep_ended(sweep_id, after)

    def _sweep_ended(self, sweep_id: str, after: str) -> None:
        """Fits and plots for the sweep's MLflow parent run, which is closed with `after`."""
        sweep = self.store.get_sweep(sweep_id)
        artifacts: dict[str, str | bytes] = {}
        if self.on_sweep_finished:
            try:  # fits and plots for the parent run; never blocks the status change
                artifacts = self.on_sweep_finished(sweep_id) or {}
            except Exception:
                log.exception("sweep-finished hook failed for %s", sweep_id)
        if self.tracker:
            self.tracker.finish_sweep(sweep.get("mlflow_run_id"), after, artifacts,
                                      sweep_id=sweep_id)

    # filling slots -------------------------------------------------------------------
    def _free_slots(self, spec: SweepSpec, sweep_id: str, cluster: dict[str, float]) -> int:
        """Trials of this sweep that can start now: within its max_concurrent and within the
        cluster's CPUs/GPUs not taken by trials already in flight (of any sweep), so a
        leased trial is really running, not waiting in Ray's queue."""
        res = spec.resources
        if res.gpus and not cluster.get("GPU"):
            # leasing now would leave the trial 'running' in Ray's queue forever
            self.waiting[sweep_id] = (f"needs {res.gpus:g} GPU per trial and the Ray cluster "
                                      "has none; trials stay pending until a GPU node joins")
            return 0
        self.waiting.pop(sweep_id, None)
        used_cpu = sum(f.cpus for f in self.in_flight.values())
        used_gpu = sum(f.gpus for f in self.in_flight.values())
        fits = math.floor((cluster.get("CPU", 0.0) - used_cpu) / res.cpus + 1e-9)
        if res.gpus:
            fits = min(fits, math.floor((cluster.get("GPU", 0.0) - used_gpu) / res.gpus + 1e-9))
        if not self.in_flight:
            fits = max(fits, 1)  # larger than the cluster today: let Ray queue (or autoscale)
        return min(spec.max_concurrent - len(self._in_flight_for(sweep_id)), fits)

    def _fill(self) -> int:
        started = 0
        cluster = ray.cluster_resources()
        for sweep in self.store.active_sweeps():
            spec = self._spec(sweep)
            if sweep.get("study") and self._advance_study(sweep, spec):
                continue  # the study stopped or finished
            free = self._free_slots(spec, sweep["id"], cluster)
            if free <= 0:
                continue
            if spec.search.method == "optuna":
                self._ask_optuna(sweep, spec, free)
            for trial in self.store.lease_pending(self.owner, free, sweep_id=sweep["id"]):
                self._submit(sweep, spec, trial)
                started += 1
        return started

    def _submit(self, sweep: dict[str, Any], spec: SweepSpec, trial: dict[str, Any]) -> None:
        run_id = None
        if self.tracker:
            if not sweep.get("mlflow_run_id"):
                ids = self.tracker.start_sweep(sweep["id"], sweep["name"], sweep["spec"],
                                               spec.tags)
                if ids:
                    self.store.set_sweep_mlflow(sweep["id"], *ids)
                    sweep.update(mlflow_experiment_id=ids[0], mlflow_run_id=ids[1])
            # with MLflow down this queues in the tracker's outbox (run_id None)
            run_id = self.tracker.start_trial(
                sweep.get("mlflow_experiment_id"), sweep.get("mlflow_run_id"), trial["id"],
                trial["arm"], trial["spec"], sweep_id=sweep["id"],
            )
            if run_id:
                self.store.set_trial_mlflow(trial["id"], run_id)
        trial_spec = dict(trial["spec"])
        trial_spec["num_threads"] = max(1, math.ceil(spec.resources.cpus))
        options: dict[str, Any] = {"num_cpus": spec.resources.cpus, "max_retries": 0}
        if spec.resources.gpus:
            options["num_gpus"] = spec.resources.gpus
        ref = self._remote.options(**options).remote(
            trial_spec, trial["id"], self._board, str(self.settings.cache_dir)
        )
        self.in_flight[trial["id"]] = InFlight(trial, ref, run_id, spec.resources.cpus,
                                               spec.resources.gpus)

    # staged studies (sweeper/study.py) -------------------------------------------------
    def _advance_study(self, sweep: dict[str, Any], spec: SweepSpec) -> bool:
        """When every trial of a study planned so far has finished, plan its next stage
        (or stop it, or finish it) in one transaction. True if the sweep ended."""
        sid = sweep["id"]
        if sweep["study"].get("done") or self._in_flight_for(sid):
            return False
        if self.store.count_trials(sid, status=list(ACTIVE)):
            return False
        if spec.search.method == "optuna" and self._optuna_left(sid, spec) > 0:
            return False
        step = next_step(spec, sweep["study"], self.store.results_frame(sid))
        stop = ("stopped", step.reason) if step.kind == "stop" else None
        if not self.store.plan_stage(sid, int(sweep["study"].get("round", 0)), step.state,
                                     step.trials, stop=stop):
            return False  # planned by someone else in the meantime: next tick sees it
        log.info("study %s: %s%s", sid, step.kind,
                 f" ({step.reason})" if step.reason else
                 f" {len(step.trials)} trials" if step.trials else "")
        if step.kind == "stop":
            self._sweep_ended(sid, "stopped")
            return True
        if step.kind == "done":
            self._refresh(sid)
            return True
        return False

    # optuna --------------------------------------------------------------------------
    def _study_name(self, sweep_id: str, shape: ShapeKey) -> str:
        return (f"hpt-{sweep_id}-{shape.arm}-N{shape.width}-L{shape.depth}"
                f"-s{shape.sigma_base:g}-seed{shape.seed}")

    def _study(self, sweep_id: str, spec: SweepSpec, shape: ShapeKey) -> optuna.Study:
        low, high = spec.grid.lr_bounds()
        # the study name seeds its sampler; the shape alone places its first batch
        return self.optuna.study(self._study_name(sweep_id, shape), spec.search,
                                 self._study_name("", shape), low, high)

    def _ask_optuna(self, sweep: dict[str, Any], spec: SweepSpec, free: int) -> None:
        if self.store.count_trials(sweep["id"], status="pending"):
            return
        low, high = spec.grid.lr_bounds()
        asked = 0
        for shape in plan_shapes(spec):
            if asked >= free:
                return
            have = self.store.count_trials(sweep["id"], arm=shape.arm, width=shape.width,
                                           depth=shape.depth, sigma_base=shape.sigma_base,
                                           seed=shape.seed)
            if have >= spec.search.n_trials:
                continue
            study = self._study(sweep["id"], spec, shape)
            number, lr = self.optuna.ask(study, low, high)
            planned = trial_for(spec, shape, lr)
            trial_id = self.store.add_trial(sweep["id"], planned, optuna_trial_number=number)
            self.optuna.bind(trial_id, study, number, planned.trial)
            asked += 1
            added = self.store.get_trial(trial_id)
            if added is not None and added["status"] != "pending":
                # reused from an identical earlier trial: it never runs, so tell it now
                self._tell_optuna(added, added["status"], added["result"])
                self.optuna.forget(trial_id)
                self._refresh(sweep["id"])

    def _optuna_left(self, sweep_id: str, spec: SweepSpec) -> int:
        asked = self.store.count_trials(sweep_id)
        return len(plan_shapes(spec)) * spec.search.n_trials - asked

    def _tell_optuna(self, trial: dict[str, Any], status: str, result: dict | None) -> None:
        sweep = self.store.get_sweep(trial["sweep_id"])
        spec = self._spec(sweep)
        shape = ShapeKey(trial["arm"], trial["width"], trial["depth"], trial["sigma_base"],
                         trial["seed"])
        study = self._study(sweep["id"], spec, shape)
        value = (result or {}).get("final_val_loss")
        vocab = 256
        if result and result.get("param_table"):
            vocab = trial["spec"].get("data", {}).get("vocab_size") or 256
        self.optuna.tell(study, trial["optuna_trial_number"], status, value, vocab)
