"""The Ray side of dispatching: start or join the cluster, run leased trials as Ray tasks
(alone, or a pack of one shape as one task), relay their live progress, cancel the tasks of
stopped sweeps, and store each attempt's outcome once Ray has it.

Retry policy lives here, not in Ray (tasks run with max_retries=0) so every attempt is
visible in the trial row: worker death, node death and OOM kills go back to pending until
the sweep's retry limit; a Python exception inside training comes back as a `failed`
TrialResult and is final. A trial leaves `in_flight` only once its outcome is durably
written; until then the outcome is kept in memory and the write retried next tick.

A pack's members each keep their own entry in `in_flight` (sharing the task's ref), so each
member's outcome is stored, retried and cancelled exactly as a lone trial's. A pack split
for memory trains in groups, and each group's results come through the progress board as
the group finishes (stored then), so a worker lost later costs only the members still
training.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
from hptransfer.contracts.status import LOST, SweepStatus, TrialStatus
from hptransfer.spec import SweepSpec
from hptransfer.spec.sections import TaskResources
from hptransfer.spec.trial import TrialSpec
from hptransfer.store.store import TrialRecord
from hptransfer.workers.checkpoints import CheckpointPolicy
from hptransfer.workers.tasks import execute_trial, execute_trial_on_workers, execute_trials

from .dispatch_context import DispatchContext, log
from .placement_groups import remove_orphaned_placement_groups
from .progress import ProgressBoard
from .ray_join import join_ray

RETRYABLE = (WorkerCrashedError, NodeDiedError, OutOfMemoryError, ObjectLostError, RayActorError)
# how long a failed pack task's members wait for the progress board to answer (results
# its members delivered before the task ended) before they are recorded lost
BOARD_GRACE_S = 30.0
# how long after a trial on several workers ended its Train run's controller may still be
# dying (a force-cancelled driver's owned actors are killed after it)
ORPHAN_WATCH_S = 60.0


def init_ray(settings: Settings) -> None:
    """Join RAY_ADDRESS when set, else start an in-process local cluster.

    Off the main thread (a server's start-up in a thread, TestClient's portal) the work is
    done by a daemon thread that lives as long as the process: Ray ties the daemons it starts
    to the life of the starting *thread* (PR_SET_PDEATHSIG), so a cluster started by a
    short-lived thread is killed when it ends, and the process with it a minute later."""
    with _RAY_INIT_LOCK:
        if threading.current_thread() is threading.main_thread():
            _init_ray(settings)
        else:
            _init_ray_in_owner_thread(settings)


_RAY_INIT_LOCK = threading.Lock()


def _init_ray_in_owner_thread(settings: Settings) -> None:
    if ray.is_initialized():
        return
    done: queue.Queue[BaseException | None] = queue.Queue()

    def own_ray() -> None:
        try:
            _init_ray(settings)
        except BaseException as exc:  # handed to the caller below
            done.put(exc)
            return
        done.put(None)
        threading.Event().wait()  # never returns: the cluster lives while the process does

    threading.Thread(target=own_ray, name="ray-owner", daemon=True).start()
    error = done.get()
    if error is not None:
        raise error


def _init_ray(settings: Settings) -> None:
    if ray.is_initialized():
        return
    if settings.ray_address:
        join_ray(settings.ray_address, ignore_reinit_error=True, log_to_driver=False)
    else:
        # "local": always a fresh in-process cluster, never one a stale
        # /tmp/ray/ray_current_cluster file points at
        # configure_logging=False: the application's logging config (levels) applies
        ray.init(address="local", include_dashboard=False, ignore_reinit_error=True,
                 log_to_driver=False, configure_logging=False)


@dataclass
class Outcome:
    """What came back from Ray for one attempt, kept until the app DB has it."""

    status: str  # a finished TrialStatus, or LOST (worker died: retried or failed)
    result: dict[str, Any] | None = None
    error: str | None = None


@dataclass
class InFlight:
    trial: TrialRecord
    ref: ray.ObjectRef
    cpus: float
    gpus: float
    last_step: int = 0  # the latest step the worker reported: > 0 once training is underway
    outcome: Outcome | None = None  # set once Ray answered; cleared from in_flight once stored
    member: int | None = None  # index in its pack's results; None: the task ran it alone
    # drains of the progress board sent before this attempt's task: what those return is an
    # earlier attempt's (lost, then leased again), not this one's
    drains_before: int = 0
    # a pack's task seen failed or cancelled: the drains sent by then, and when (see
    # RayRunner._board_heard_since)
    ended_after_drain: int | None = None
    ended_at: float = 0.0
    spans: bool = False  # a Ray Train run on several workers (placement_groups.py)


class ClusterCapacity:
    """What the Ray cluster offers: its total resources, and the CPUs of its largest live
    node (a task runs on one node). The nodes are read from Ray's control store only when
    asked for: once per tick with work to place, never while idle."""

    def __init__(self, resources: dict[str, float],
                 read_nodes: Callable[[], list[dict[str, Any]]]) -> None:
        self.resources = resources
        self._read_nodes = read_nodes
        self._largest: float | None = None

    @classmethod
    def one_node(cls, cpus: float, gpus: float = 0.0) -> ClusterCapacity:
        """A cluster of one live node with these resources (what a test fakes Ray with)."""
        resources = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
        return cls(resources, lambda: [{"Alive": True, "Resources": resources}])

    def largest_node_cpus(self) -> float:
        if self._largest is None:
            self._largest = max((float(n.get("Resources", {}).get("CPU", 0.0))
                                 for n in self._read_nodes() if n.get("Alive")), default=0.0)
        return self._largest


def task_of(spec: SweepSpec, trial: TrialRecord) -> TaskResources:
    """What `trial`'s Ray task asks for (resources.workers and scale_out)."""
    if not spec.resources.scale_out:
        return spec.resources.base
    return spec.task_resources(TrialSpec.model_validate(trial.spec), trial.stage)


def never_fits(task: TaskResources, capacity: ClusterCapacity) -> str | None:
    """Why no trial with these resources can start until the cluster grows, if so."""
    cluster = capacity.resources
    what = (f"{task.workers} workers x {task.cpus:g} CPUs" + (f" + {task.gpus:g} GPU"
            if task.gpus else "") if task.spans else f"{task.cpus:g} CPUs per task")
    if task.gpus and not cluster.get("GPU"):
        return (f"needs {task.gpus:g} GPU per {'worker' if task.spans else 'trial'} and "
                "the Ray cluster has none; trials stay pending until a GPU node joins")
    largest = capacity.largest_node_cpus()
    if task.cpus > largest + 1e-9:  # a task (a Train worker) runs on one node
        return (f"needs {what} and the largest Ray node has {largest:g} CPUs; trials stay "
                "pending until a node that large joins (or lower resources.cpus)")
    if task.spans and (task.workers * task.cpus > cluster.get("CPU", 0.0) + 1e-9
                       or task.workers * task.gpus > cluster.get("GPU", 0.0) + 1e-9):
        return (f"needs {what} and the Ray cluster has {cluster.get('CPU', 0.0):g} CPUs, "
                f"{cluster.get('GPU', 0.0):g} GPUs in all; trials stay pending until it "
                "grows (or lower the scale_out rule's workers)")
    return None


# should_prune(trial_id, new points) -> whether Optuna's pruner stops the trial
ShouldPrune = Callable[[str, list[dict[str, Any]]], bool]
# verdict_step(trial_id) -> the step at which the trial waits for the pruner's verdict, if any
VerdictStep = Callable[[str], int | None]
# after_stored(trial, stored status, result): the follow-ups of a durably stored outcome
AfterStored = Callable[[TrialRecord, str, dict | None], None]


class RayRunner:
    """Runs leased trials as Ray tasks and brings their outcomes home to the app database."""

    def __init__(self, context: DispatchContext, should_prune: ShouldPrune,
                 after_stored: AfterStored, verdict_step: VerdictStep | None = None) -> None:
        self.context = context
        self.should_prune, self.after_stored = should_prune, after_stored
        self.verdict_step = verdict_step
        self.in_flight: dict[str, InFlight] = {}
        self.progress_board = None  # the ProgressBoard actor, once started
        self._drain: ray.ObjectRef | None = None  # the board's drain call in flight
        self._drains_sent = 0
        self._drains_heard = 0  # the latest drain answered (or failed): its number
        self._drain_sent_idle = False  # the drain in flight was sent with no trial in flight
        self._board_empty = False  # such a drain answered, and nothing was submitted since
        self.run_trial = None  # execute_trial as a Ray remote function, once started
        self.run_pack = None  # execute_trials, likewise
        self.run_on_workers = None  # execute_trial_on_workers (Ray Train), likewise
        # until when to look for placement groups a Train run that ended left behind
        self._orphans_until = 0.0
        self._orphans_seen_at = 0.0

    def start(self) -> None:
        init_ray(self.context.settings)
        # on the coordinator's own node, restarted if it dies: losing a worker node must
        # not take the metrics side channel (and with it every dispatch tick) down
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        self.progress_board = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(
            ProgressBoard).options(scheduling_strategy=here).remote()
        self._drain = None  # a call to an earlier board (a restart in this process) is moot
        self.run_trial = ray.remote(execute_trial)
        self.run_pack = ray.remote(execute_trials)
        self.run_on_workers = ray.remote(execute_trial_on_workers)

    def stop(self) -> None:
        """End the progress board: an actor lives as long as the process that made it, so a
        coordinator stopped inside a longer-lived process (the embedded API, a notebook, the
        tests) would otherwise leave one behind per start, each an idle Ray worker. Tasks
        still running report to it in vain and train on (progress_channel)."""
        board, self.progress_board = self.progress_board, None
        self._drain = None
        if board is not None and ray.is_initialized():
            try:
                ray.kill(board)
            except Exception as exc:  # Ray already going down: the board goes with it
                log.warning("could not end the progress board: %s", exc)

    def capacity(self) -> ClusterCapacity:
        """What the cluster offers now (the one place that asks Ray; tests replace it)."""
        return ClusterCapacity(ray.cluster_resources(), ray.nodes)

    def in_flight_for(self, sweep_id: str) -> list[InFlight]:
        return [f for f in self.in_flight.values() if f.trial.sweep_id == sweep_id]

    def tasks(self, sweep_id: str | None = None) -> list[InFlight]:
        """One in-flight entry per Ray task (a pack's members share theirs)."""
        seen: dict[ray.ObjectRef, InFlight] = {}
        for f in self.in_flight.values():
            if sweep_id is None or f.trial.sweep_id == sweep_id:
                seen.setdefault(f.ref, f)
        return list(seen.values())

    def wait_for_a_result(self, timeout: float) -> None:
        """Block until a task in flight finishes, or `timeout` passes."""
        ray.wait([f.ref for f in self.tasks()], num_returns=1, timeout=timeout)

    def free_slots(self, spec: SweepSpec, sweep_id: str,
                   capacity: ClusterCapacity) -> tuple[int, str | None]:
        """Tasks (a trial, or a pack of them) of this sweep that can start now: within its
        max_concurrent and within the cluster's CPUs/GPUs not taken by tasks already in
        flight (of any sweep), so a leased trial is really running, not waiting in Ray's
        queue. With none, why, when no trial of it can start until the cluster grows."""
        cluster = capacity.resources
        # leasing now would leave the trial 'running' in Ray's queue forever, and the CPUs
        # it asks for counted as taken: every other sweep's trials would wait behind it
        why = never_fits(spec.resources.base, capacity)
        if why:
            return 0, why
        used_cpu, used_gpu = self.used()
        fits = spec.resources.base.count_in(cluster.get("CPU", 0.0) - used_cpu,
                             cluster.get("GPU", 0.0) - used_gpu)
        if not self.in_flight:
            fits = max(fits, 1)  # larger than the cluster today: let Ray queue (or autoscale)
        return min(spec.max_concurrent - len(self.tasks(sweep_id)), fits), None

    def used(self) -> tuple[float, float]:
        """CPUs and GPUs the tasks in flight hold."""
        tasks = self.tasks()
        return sum(f.cpus for f in tasks), sum(f.gpus for f in tasks)

    def submit(self, spec: SweepSpec, trials: list[TrialRecord]) -> None:
        """Start one Ray task for one trial or a pack of trials of one shape; a trial on
        several workers runs as a Ray Train run (ray_train.py) driven by a task of its own."""
        task = task_of(spec, trials[0]) if len(trials) == 1 else spec.resources.base
        specs = [{**t.spec, "num_threads": task.threads} for t in trials]
        ids = [t.id for t in trials]
        settings = self.context.settings
        cache = str(settings.cache_dir)
        # the worker checks the data again: still inside the roots, still what was submitted
        guard = ([str(r) for r in settings.data_roots], trials[0].data_hash)
        options: dict[str, Any] = {"num_cpus": task.cpus, "max_retries": 0}
        self._gate_pruning(trials)
        self._board_empty = self._drain_sent_idle = False
        if task.gpus:
            options["num_gpus"] = task.gpus
        if task.spans:
            # the driver holds nothing; its Train workers hold the resources
            ref = self.run_on_workers.options(num_cpus=0, max_retries=0).remote(
                specs[0], ids[0], self.progress_board, cache, *guard,
                workers=task.workers, cpus=task.cpus, gpus=task.gpus,
                checkpoint=self._checkpoint(spec, trials[0]),
                storage_path=f"{settings.checkpoint_root}/ray_train",
                run_name=f"{ids[0]}-{trials[0].attempts}", max_hours=settings.max_trial_hours,
                shard=task.shard)
        elif len(trials) == 1:
            ref = self.run_trial.options(**options).remote(
                specs[0], ids[0], self.progress_board, cache, *guard,
                self._checkpoint(spec, trials[0]), settings.max_trial_hours)
        else:
            # each member's policy (positional after the guard, as execute_trial's)
            ref = self.run_pack.options(**options).remote(
                specs, ids, self.progress_board, cache, *guard,
                [self._checkpoint(spec, t) for t in trials], max_hours=settings.max_trial_hours)
        for i, trial in enumerate(trials):
            self.in_flight[trial.id] = InFlight(trial, ref, task.cpus * task.workers,
                                                task.gpus * task.workers,
                                                member=i if len(trials) > 1 else None,
                                                drains_before=self._drains_sent,
                                                spans=task.spans)

    def may_resume(self, spec: SweepSpec, trial: TrialRecord) -> bool:
        """Whether a retried trial has a checkpoint to resume from (so it must run alone:
        packs start at step 0, and write checkpoints in run_trial's format)."""
        if not trial.attempts:
            return False
        try:
            policy = CheckpointPolicy(**self._checkpoint(spec, trial))
            return policy.has_checkpoint()
        except Exception as exc:  # noqa: BLE001 - an unreadable store: run it alone anyway
            log.warning("checkpoint store unreadable for trial %s: %s", trial.id, exc)
            return True

    def _checkpoint(self, spec: SweepSpec, trial: TrialRecord) -> dict[str, Any]:
        """The trial's checkpoint policy, as the worker takes it."""
        c = spec.checkpoint
        return CheckpointPolicy(
            url=self.context.settings.checkpoint_root, key=f"{trial.sweep_id}/{trial.id}",
            every_steps=c.every_steps, every_minutes=c.every_minutes,
            keep_final=c.keep_final, max_sweep_bytes=c.max_sweep_gb * 1e9).to_dict()

    def _gate_pruning(self, trials: list[TrialRecord]) -> None:
        """Tell the board where each Optuna trial waits for the pruner's verdict; sent before
        the task starts, so the board has it before the worker's first report."""
        if self.verdict_step is None:
            return
        for trial in trials:
            if trial.optuna_trial_number is not None:
                step = self.verdict_step(trial.id)
                if step is not None:
                    self.progress_board.gate.remote(trial.id, step)

    def cancel_stopped_sweeps(self) -> None:
        """Cancel the tasks in flight of every sweep a request stopped."""
        for sweep_id in {f.trial.sweep_id for f in self.in_flight.values()}:
            if SweepStatus(self.context.store.get_sweep(sweep_id).status).is_stopped():
                for ref in {f.ref for f in self.in_flight_for(sweep_id) if f.outcome is None}:
                    ray.cancel(ref, force=True)

    def relay_progress(self) -> None:
        """Take what the workers left on the progress board: live points (to the mirror and
        Optuna's pruner) and the results split packs delivered ahead of their task."""
        # one drain call outstanding at a time, waited for at most one poll interval: a board
        # actor that is restarting (killed with its node or by Ray's OOM monitor) must not
        # hold up dispatching, nor a shutdown; its answer is taken on a later tick
        if self._drain is None:
            if self._board_empty and not self.in_flight:
                return  # nothing runs and nothing is left on the board: no call every tick
            self._drain = self.progress_board.drain.remote()
            self._drains_sent += 1
            self._drain_sent_idle = not self.in_flight
        ready, _ = ray.wait([self._drain], timeout=self.context.poll_interval)
        if not ready:
            return
        ref, self._drain = self._drain, None
        self._drains_heard = self._drains_sent  # one call in flight: this is the latest sent
        try:
            updates, delivered = ray.get(ref)
        except Exception as exc:  # live metrics are best effort; results still arrive
            log.warning("progress board unavailable: %s", exc)
            return
        # sent with nothing in flight and answered: what a lost attempt left there is gone
        self._board_empty = self._drain_sent_idle
        for trial_id, result in delivered.items():
            f = self.in_flight.get(trial_id)
            if f is not None and f.outcome is None and f.drains_before < self._drains_sent:
                # a split pack's member, done before its task: stored now (collect)
                f.outcome = Outcome(result["status"], result, result.get("error"))
        mirror = self.context.mirror
        for trial_id, points in updates.items():
            f = self.in_flight.get(trial_id)
            if f is None or f.drains_before >= self._drains_sent:
                continue  # finished, or these points are an earlier attempt's
            f.last_step = max([f.last_step, *(int(p.get("step") or 0) for p in points)])
            if mirror:  # best effort: the final curve is mirrored from the app DB
                mirror.live(trial_id, f.trial.started_at, points)
            if f.trial.optuna_trial_number is not None and self.should_prune(trial_id, points):
                self.progress_board.request_stop.remote(trial_id)

    def remove_orphaned_placement_groups(self) -> None:
        """For a while after a trial on several workers ended, once a second: remove the
        placement groups its Train run's dead controller left (placement_groups.py)."""
        now = time.monotonic()
        if now < self._orphans_until and now - self._orphans_seen_at >= 1.0:
            self._orphans_seen_at = now
            remove_orphaned_placement_groups()

    def drain_pending(self) -> bool:
        """Whether a drain of the progress board is still unanswered."""
        return self._drain is not None

    def collect(self) -> int:
        """Store the outcome of every attempt Ray has finished. An attempt leaves in_flight
        only once its outcome is written; a failed write raises (the loop backs off) and is
        retried next tick from the outcome kept in memory."""
        if not self.in_flight:
            return 0
        refs = [f.ref for f in self.tasks()]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        ready_set = set(ready)
        for f in self.in_flight.values():
            if f.outcome is None and f.ref in ready_set:
                outcome = outcome_of(f.ref, f.member)
                if outcome.status in (LOST, TrialStatus.CANCELLED) and f.member is not None \
                        and not self._board_heard_since(f):
                    continue  # its final result may wait in the board: taken next tick
                f.outcome = outcome
        done = [tid for tid, f in self.in_flight.items() if f.outcome is not None]
        for trial_id in done:
            self._store_outcome(trial_id, self.in_flight[trial_id])
        return len(done)

    def _board_heard_since(self, f: InFlight) -> bool:
        """Whether a drain of the board sent after f's pack task was seen to fail (or be
        cancelled) has answered, or BOARD_GRACE_S passed. A member may have handed its final
        result to the board before the task ended (a split pack's group, a member stopped
        early); a drain that answers slower than a tick would otherwise find it only after
        the member was charged a lost attempt and trained again."""
        if f.ended_after_drain is None:
            f.ended_after_drain, f.ended_at = self._drains_sent, time.monotonic()
        return (self._drains_heard > f.ended_after_drain
                or time.monotonic() - f.ended_at > BOARD_GRACE_S)

    def _store_outcome(self, trial_id: str, f: InFlight) -> None:
        store, owner = self.context.store, self.context.owner
        out = f.outcome
        assert out is not None
        status = out.status
        if status == LOST:
            status = store.requeue(trial_id, out.error, owner)  # pending or failed
            log.warning("trial %s lost its worker (%s); now %s", trial_id,
                        (out.error or "")[:200], status)
        elif status == TrialStatus.CANCELLED:
            store.mark_cancelled(trial_id, owner)
        else:
            node = (out.result or {}).get("worker_node")
            if not store.finish_trial(trial_id, status, out.result, out.error, node,
                                      owner=owner):
                log.warning("trial %s's %s result was not stored: it is no longer running "
                            "under this coordinator's lease", trial_id, status)
        del self.in_flight[trial_id]  # durably written: the slot is free
        if f.spans:  # its controller may die after this: look for its group a while
            self._orphans_until = time.monotonic() + ORPHAN_WATCH_S
        self.progress_board.forget.remote(trial_id)
        self.after_stored(f.trial, status, out.result)


def outcome_of(ref: ray.ObjectRef, member: int | None = None) -> Outcome:
    """What Ray returned for one attempt (ray.get of a finished task: never blocks); a
    pack's member reads its own result, and shares the task's fate if the task failed."""
    try:
        result = ray.get(ref)
        if member is not None:
            result = result[member]
        return Outcome(result["status"], result, result.get("error"))
    except TaskCancelledError:
        return Outcome(TrialStatus.CANCELLED)
    except RETRYABLE as exc:
        return Outcome(LOST, error=f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # anything else escaping the task is final
        return Outcome(TrialStatus.FAILED, error=f"{type(exc).__name__}: {exc}")
