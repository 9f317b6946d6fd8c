"""The dispatch loop: lease pending trials, run them as Ray tasks, write results back.

One coordinator per app database. Retry policy lives here, not in Ray (tasks run with
max_retries=0) so every attempt is visible in the trial row: worker death, node death and
OOM kills go back to pending until the sweep's retry limit; a Python exception inside
training comes back as a `failed` TrialResult and is final. A freed slot is refilled in the
same tick, so a pruned or finished trial starts the next one immediately.

Trial state is written only to the app database (MLflow mirrors it: `mlflow/mirror.py`). A
trial leaves the in-flight set only once its outcome is durably written; until then the
outcome is kept in memory and the write retried. While the database is unreachable the loop
backs off exponentially (capped) and logs one line when the outage starts and one when it
ends. When Optuna's storage (a database of its own) fails, only the Optuna sweeps' asks,
tells and pruning wait, backing off the same way (`_optuna_calls`): results are still
stored and the other sweeps go on, and an Optuna sweep completes only once its studies have
heard every result. A stored sweep whose spec no longer validates is marked failed and
skipped.

What a failed write leaves half done is kept and finished on a later tick: a stored outcome's
Optuna tell and sweep refresh (`owed`), an asked Optuna trial whose row was not added
(`unadded`: retracted), trials leased for a task Ray did not take (`unsubmitted`: released).
A restarted coordinator finishes what its dead predecessor held in memory (`start`).

Packing (`resources.pack`, `packing.py`): pending trials of one shape may run as one Ray task
(`execute_trials`). Each member keeps its own entry in `in_flight` (sharing the task's ref),
so its outcome is stored, retried, cancelled and told to Optuna exactly as a lone trial's. A
pack split for memory trains in groups, and each group's results come through the progress
board as the group finishes (stored then), so a worker lost later costs only the members
still training.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
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

from hptransfer.backoff import Backoff
from hptransfer.config import Settings
from hptransfer.contracts.status import ACTIVE, SweepStatus, TrialStatus
from hptransfer.spec import SweepSpec
from hptransfer.spec.cache import SpecCache
from hptransfer.spec.sections import MAX_PACK
from hptransfer.store.rows import utcnow
from hptransfer.store.store import Store, SweepRecord, TrialRecord
from hptransfer.tracking.mirror import Mirror
from hptransfer.workers.remote import execute_trial, execute_trials

from .optuna_search import OptunaSearch
from .packing import measured_packs, pack_cost, pack_size, plan_packs
from .plan import ShapeKey, plan_shapes, trial_for
from .progress import ProgressBoard
from .study import next_step

log = logging.getLogger(__name__)

RETRYABLE = (WorkerCrashedError, NodeDiedError, OutOfMemoryError, ObjectLostError, RayActorError)
MAX_BACKOFF_S = 30.0  # the longest pause between tries of a failing database or Optuna storage
# how long a failed pack task's members wait for the progress board to answer (results
# its members delivered before the task ended) before they are recorded lost
BOARD_GRACE_S = 30.0
_MAX_PEEK = 2000  # pending trials read per sweep and tick to plan packs from
# Optuna sweeps stopped this recently are passed over at start-up (their trials left RUNNING
# in Optuna are told): a bound, so a start does not grow with every sweep ever cancelled
RECENTLY_STOPPED_S = 7 * 86_400.0


class BadSweep(Exception):
    """A stored sweep that cannot be dispatched (it has been marked failed)."""


class OptunaUnavailable(Exception):
    """Optuna's storage failed, or is being backed off from: the Optuna sweeps' asks, tells
    and pruning wait; storing results and every other sweep go on."""


@dataclass
class Outcome:
    """What came back from Ray for one attempt, kept until the app DB has it."""

    status: str  # a finished TrialStatus, or "lost" (worker died: retried or failed)
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
    # Dispatcher._board_heard_since)
    ended_after_drain: int | None = None
    ended_at: float = 0.0


@dataclass
class Owed:
    """What a trial's stored outcome still owes: its Optuna tell and its sweep's status.
    Kept until written, so a write that fails (the loop backs off) is retried next tick
    rather than lost with the in-flight entry the outcome has already left."""
    trial: TrialRecord
    status: str
    result: dict | None
    tell: bool  # the trial's Optuna study has yet to hear its outcome


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
        mirror: Mirror | None = None,
        owner: str | None = None,
        poll_interval: float = 0.2,
    ) -> None:
        self.store, self.settings, self.mirror = store, settings, mirror
        self.owner = owner or f"coord-{uuid.uuid4().hex[:10]}"
        self.poll_interval = poll_interval
        self.in_flight: dict[str, InFlight] = {}
        self.owed: dict[str, Owed] = {}  # trial id -> follow-ups of its stored outcome
        # Optuna trials asked whose row could not be added: retracted (optuna.retract) once
        # Optuna's storage takes it, so no phantom stays RUNNING and its LR is asked again
        self.unadded: list[tuple[optuna.Study, int]] = []
        # leased trials whose Ray task could not be submitted: released back to pending
        # (Store.release) once the database takes it, not left 'running' until a restart
        self.unsubmitted: list[list[str]] = []
        # Optuna sweeps whose start-up pass (_settle_what_the_dead_owed) Optuna's storage failed
        self.untold: set[str] = set()
        # sweeps a request cancelled (another thread): an Optuna sweep's trials asked but not
        # leased were cancelled with it, and its untold pass tells their Optuna trials FAIL
        self.stopped: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.waiting: dict[str, str] = {}  # sweep id -> why its trials cannot start now
        # Optuna sweeps active at the last tick: one that left the set stopped or finished,
        # maybe by another process's request (an API-only server cancelling it), so its
        # Optuna trials go to the untold pass
        self._optuna_active: set[str] = set()
        self.optuna = OptunaSearch(settings.optuna_url)
        self._specs = SpecCache()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._board = None
        self._drain: ray.ObjectRef | None = None  # the board's drain call in flight
        self._drains_sent = 0
        self._drains_heard = 0  # the latest drain answered (or failed): its number
        self._remote = None
        self._remote_pack = None
        self.ticks = Backoff("dispatch", log, poll_interval, MAX_BACKOFF_S)
        self.optuna_storage = Backoff("Optuna's storage", log, poll_interval, MAX_BACKOFF_S)

    @property
    def last_error(self) -> str | None:
        """Why the latest tick failed, while ticks fail."""
        return self.ticks.error

    # lifecycle -----------------------------------------------------------------------
    def start(self, background: bool = True) -> None:
        init_ray(self.settings)
        # on the coordinator's own node, restarted if it dies: losing a worker node must
        # not take the metrics side channel (and with it every dispatch tick) down
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        self._board = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(
            ProgressBoard).options(scheduling_strategy=here).remote()
        self._drain = None  # a call to an earlier board (a restart in this process) is moot
        self._remote = ray.remote(execute_trial)
        self._remote_pack = ray.remote(execute_trials)
        n = self.store.requeue_orphans(self.owner)
        if n:
            log.warning("re-queued %d trials left running by a previous coordinator", n)
        self._settle_what_the_dead_owed()
        if self.mirror:
            self.mirror.wake()
        if background:
            self._thread = threading.Thread(target=self._loop, name="hpt-dispatch", daemon=True)
            self._thread.start()

    def _settle_what_the_dead_owed(self) -> None:
        """What a dead coordinator held in memory (`owed`, `unadded`) is gone with it; on
        start, one pass over the active sweeps finishes it:
        - an Optuna trial left RUNNING (killed between storing a result and telling Optuna,
          or between asking Optuna and adding the row) is told its stored outcome, or
          retracted when no row has its number; trials still pending or running are told
          when they finish. Else the sampler would never learn its value and the bracketing
          would wait on it. A sweep whose pass Optuna's storage failed is passed over again
          on later ticks (`untold`).
        - a sweep without pending or running trials is refreshed once (killed between storing
          its last result and refreshing it), an Optuna sweep after its pass; an Optuna
          search or a study with more to do waits."""
        for sweep in self.store.active_sweeps():
            try:
                spec = self._spec(sweep)
            except BadSweep:
                continue  # marked failed
            if spec.search.method == "optuna":
                self.untold.add(sweep.id)
            elif not self.store.count_trials(sweep.id, status=list(ACTIVE)):
                self._refresh(sweep.id)
        # stopped lately while no dispatcher was there to tell Optuna (cancelled through an
        # API-only server, or just before the last coordinator died)
        self.untold |= set(self.store.stopped_sweep_ids(
            search="optuna", since=utcnow() - timedelta(seconds=RECENTLY_STOPPED_S)))
        self._tell_untold()

    def _take_stopped(self) -> None:
        """The Optuna sweeps among those requests stopped go to the untold pass."""
        while not self.stopped.empty():
            sweep_id = self.stopped.get_nowait()
            try:
                sweep = self.store.get_sweep(sweep_id)
            except Exception:  # the database failed: looked at again next tick
                self.stopped.put(sweep_id)
                raise
            if sweep is not None and sweep.search == "optuna":
                self.untold.add(sweep_id)

    def _tell_untold(self) -> None:
        """The pass over the `untold` sweeps' Optuna trials (see above, and `stopped`)."""
        if not self.untold:
            return
        with contextlib.suppress(OptunaUnavailable):
            with self._optuna_calls():
                studies = set(optuna.get_all_study_names(self.optuna.storage))
                self.optuna_storage.succeeded()
            for sweep_id in sorted(self.untold):
                try:
                    self._tell_sweep_untold(sweep_id, studies)
                    idle = not self.store.count_trials(sweep_id, status=list(ACTIVE))
                except BadSweep:  # marked failed: nothing to tell
                    idle = False
                self.untold.discard(sweep_id)  # before the refresh, which waits on it
                if idle:
                    try:
                        self._refresh(sweep_id)
                    except Exception:  # the database failed: the pass runs again (tells once)
                        self.untold.add(sweep_id)
                        raise

    def _tell_sweep_untold(self, sweep_id: str, studies: set[str]) -> None:
        """Tell or retract one sweep's Optuna trials left RUNNING."""
        spec = self._spec(self.store.get_sweep(sweep_id))
        rows: dict[tuple[ShapeKey, int], TrialRecord] = {
            (_shape_of(t), t.optuna_trial_number): t
            for t in self.store.trials(sweep_id, limit=None)
            if t.optuna_trial_number is not None}
        for shape in plan_shapes(spec):
            if self._study_name(sweep_id, shape) not in studies:
                continue  # nothing asked yet
            with self._optuna_calls():
                study = self._study(sweep_id, spec, shape)
                running = self.optuna.running_numbers(study)
            for number in running:
                row = rows.get((shape, number))
                if row is None:
                    self._retract((study, number))
                elif row.status not in ACTIVE:
                    self._tell_optuna(row, row.status, row.result)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                busy = self.run_once()
            except Exception as exc:  # keep dispatching; surface the problem in /health
                self._stop.wait(self.ticks.failed(exc))
                continue
            self.ticks.succeeded()
            if not busy:
                self._idle_wait()

    def wake(self) -> None:
        """Ask the loop to look for work now (a sweep was submitted or cancelled)."""
        self._wake.set()

    def sweep_stopped(self, sweep_id: str) -> None:
        """A request cancelled the sweep (see `stopped`); its running trials are cancelled
        by the next tick either way."""
        self.stopped.put(sweep_id)
        self.wake()

    def _idle_wait(self) -> None:
        """Sleep until a trial finishes, work is submitted, or one poll interval passes —
        whichever is first, so a finished trial's slot is refilled without polling delay."""
        if self.in_flight:
            ray.wait([f.ref for f in self._tasks()], num_returns=1, timeout=self.poll_interval)
        else:
            self._wake.wait(self.poll_interval)
        self._wake.clear()

    # one tick ------------------------------------------------------------------------
    def run_once(self) -> bool:
        self._cancel_cancelled()
        self._relay_progress()
        self._retract_unadded()
        self._release_unsubmitted()
        self._take_stopped()
        self._tell_untold()
        self._settle_owed()
        collected = self._collect()
        started = self._fill()
        return bool(collected or started)

    def _in_flight_for(self, sweep_id: str) -> list[InFlight]:
        return [f for f in self.in_flight.values() if f.trial.sweep_id == sweep_id]

    def _tasks(self, sweep_id: str | None = None) -> list[InFlight]:
        """One in-flight entry per Ray task (a pack's members share theirs)."""
        seen: dict[ray.ObjectRef, InFlight] = {}
        for f in self.in_flight.values():
            if sweep_id is None or f.trial.sweep_id == sweep_id:
                seen.setdefault(f.ref, f)
        return list(seen.values())

    def _spec(self, sweep: SweepRecord) -> SweepSpec:
        """The sweep's validated spec; a stored spec that no longer validates fails the
        sweep with the reason (BadSweep), so it cannot block the others."""
        try:
            return self._specs.get(sweep.id, sweep.spec)
        except Exception as exc:
            reason = f"stored spec is invalid: {exc}"
            log.error("sweep %s failed: %s", sweep.id, reason)
            self.store.fail_sweep(sweep.id, reason[:4000])
            self._wake_mirror()
            raise BadSweep(reason) from exc

    def _wake_mirror(self) -> None:
        if self.mirror:
            self.mirror.wake()

    def _cancel_cancelled(self) -> None:
        for sweep_id in {f.trial.sweep_id for f in self.in_flight.values()}:
            if SweepStatus(self.store.get_sweep(sweep_id).status).is_stopped():
                for ref in {f.ref for f in self._in_flight_for(sweep_id) if f.outcome is None}:
                    ray.cancel(ref, force=True)

    def _relay_progress(self) -> None:
        # one drain call outstanding at a time, waited for at most one poll interval: a board
        # actor that is restarting (killed with its node or by Ray's OOM monitor) must not
        # hold up dispatching, nor a shutdown; its answer is taken on a later tick
        if self._drain is None:
            self._drain = self._board.drain.remote()
            self._drains_sent += 1
        ready, _ = ray.wait([self._drain], timeout=self.poll_interval)
        if not ready:
            return
        ref, self._drain = self._drain, None
        self._drains_heard = self._drains_sent  # one call in flight: this is the latest sent
        try:
            updates, delivered = ray.get(ref)
        except Exception as exc:  # live metrics are best effort; results still arrive
            log.warning("progress board unavailable: %s", exc)
            return
        for trial_id, result in delivered.items():
            f = self.in_flight.get(trial_id)
            if f is not None and f.outcome is None and f.drains_before < self._drains_sent:
                # a split pack's member, done before its task: stored now (_collect)
                f.outcome = Outcome(result["status"], result, result.get("error"))
        for trial_id, points in updates.items():
            f = self.in_flight.get(trial_id)
            if f is None or f.drains_before >= self._drains_sent:
                continue  # finished, or these points are an earlier attempt's
            f.last_step = max([f.last_step, *(int(p.get("step") or 0) for p in points)])
            if self.mirror:  # best effort: the final curve is mirrored from the app DB
                self.mirror.live(trial_id, f.trial.started_at, points)
            if f.trial.optuna_trial_number is not None and self._should_prune(trial_id, points):
                self._board.request_stop.remote(trial_id)

    def _should_prune(self, trial_id: str, points: list[dict[str, Any]]) -> bool:
        """Whether Optuna's pruner stops the trial at one of its new points; not while its
        storage fails (the trial then trains on: pruning only saves time)."""
        try:
            with self._optuna_calls():
                return any(p.get("val_loss") is not None and
                           self.optuna.should_prune(trial_id, p["step"], p["val_loss"])
                           for p in points)
        except OptunaUnavailable:
            return False

    def _collect(self) -> int:
        """Store the outcome of every attempt Ray has finished. An attempt leaves in_flight
        only once its outcome is written; a failed write raises (the loop backs off) and is
        retried next tick from the outcome kept in memory."""
        if not self.in_flight:
            return 0
        refs = [f.ref for f in self._tasks()]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        ready_set = set(ready)
        for f in self.in_flight.values():
            if f.outcome is None and f.ref in ready_set:
                outcome = _outcome(f.ref, f.member)
                if outcome.status in ("lost", TrialStatus.CANCELLED) and f.member is not None \
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
        out = f.outcome
        assert out is not None
        status = out.status
        if status == "lost":
            status = self.store.requeue(trial_id, out.error, self.owner)  # pending or failed
            log.warning("trial %s lost its worker (%s); now %s", trial_id,
                        (out.error or "")[:200], status)
        elif status == TrialStatus.CANCELLED:
            self.store.mark_cancelled(trial_id, self.owner)
        else:
            node = (out.result or {}).get("worker_node")
            if not self.store.finish_trial(trial_id, status, out.result, out.error, node,
                                           owner=self.owner):
                log.warning("trial %s's %s result was not stored: it is no longer running "
                            "under this coordinator's lease", trial_id, status)
        del self.in_flight[trial_id]  # durably written: the slot is free
        self._board.forget.remote(trial_id)
        self.optuna.forget(trial_id)  # no longer live: nothing left to prune
        self._wake_mirror()
        tell = f.trial.optuna_trial_number is not None and status != "pending"
        self._owe(f.trial, status, out.result, tell)

    def _owe(self, trial: TrialRecord, status: str, result: dict | None, tell: bool) -> None:
        """Record what a stored outcome still owes (see Owed) and try to write it now."""
        self.owed[trial.id] = Owed(trial, status, result, tell)
        self._settle(trial.id)

    def _retract_unadded(self) -> None:
        """Retract the asked Optuna trials whose rows could not be added (see `unadded`)."""
        with contextlib.suppress(OptunaUnavailable):  # kept for a later tick
            _fix_queued(self.unadded, self._retract)

    def _retract(self, asked: tuple[optuna.Study, int]) -> None:
        with self._optuna_calls():
            self.optuna.retract(*asked)
            self.optuna_storage.succeeded()

    def _release_unsubmitted(self) -> None:
        """Release leased trials whose task was never submitted (see `unsubmitted`)."""
        _fix_queued(self.unsubmitted, lambda ids: self.store.release(ids, self.owner))

    def _settle_owed(self) -> None:
        """Retry the follow-ups a failed write left owing (see Owed)."""
        for trial_id in list(self.owed):
            self._settle(trial_id)

    def _settle(self, trial_id: str) -> None:
        owed = self.owed[trial_id]
        try:
            if owed.tell:
                self._tell_optuna(owed.trial, owed.status, owed.result)
                owed.tell = False  # told: a retry of the refresh must not tell twice
            self._refresh(owed.trial.sweep_id)
        except BadSweep:
            pass  # marked failed: nothing more to do for its trials
        except OptunaUnavailable:
            return  # kept: told, then refreshed, once Optuna's storage answers
        del self.owed[trial_id]

    def _refresh(self, sweep_id: str) -> None:
        sweep = self.store.get_sweep(sweep_id)
        before = sweep.status
        spec = self._spec(sweep)
        if before in ACTIVE and spec.search.method == "optuna" and (
                self._optuna_left(sweep_id, spec) or self._untold_results(sweep_id)):
            return  # the studies have trials to ask or results to hear: not finished yet
        if before in ACTIVE and sweep.study and not sweep.study.get("done"):
            return  # a study with stages to plan: _advance_study (next _fill) decides
        self.store.refresh_sweep_status(sweep_id)

    def _untold_results(self, sweep_id: str) -> bool:
        """Whether a result of the sweep has yet to reach its Optuna study (a tell owed, or
        the start-up pass still to do): an Optuna sweep completes only once it has. Else a
        coordinator that died then would leave its trials RUNNING in a finished sweep's
        study, which no start-up pass visits."""
        return sweep_id in self.untold or any(
            o.tell and o.trial.sweep_id == sweep_id for o in self.owed.values())

    # filling slots -------------------------------------------------------------------
    def _free_slots(self, spec: SweepSpec, sweep_id: str, cluster: dict[str, float],
                    largest_node_cpus: float) -> int:
        """Tasks (a trial, or a pack of them) of this sweep that can start now: within its
        max_concurrent and within the cluster's CPUs/GPUs not taken by tasks already in
        flight (of any sweep), so a leased trial is really running, not waiting in Ray's
        queue."""
        res = spec.resources
        # leasing now would leave the trial 'running' in Ray's queue forever, and the CPUs
        # it asks for counted as taken: every other sweep's trials would wait behind it
        if res.gpus and not cluster.get("GPU"):
            self.waiting[sweep_id] = (f"needs {res.gpus:g} GPU per trial and the Ray cluster "
                                      "has none; trials stay pending until a GPU node joins")
            return 0
        if res.cpus > largest_node_cpus + 1e-9:  # a task runs on one node
            self.waiting[sweep_id] = (
                f"needs {res.cpus:g} CPUs per task and the largest Ray node has "
                f"{largest_node_cpus:g}; trials stay pending until a node that large joins "
                "(or lower resources.cpus)")
            return 0
        self.waiting.pop(sweep_id, None)
        used_cpu = sum(f.cpus for f in self._tasks())
        used_gpu = sum(f.gpus for f in self._tasks())
        fits = _tasks_fitting(spec, cluster.get("CPU", 0.0) - used_cpu,
                              cluster.get("GPU", 0.0) - used_gpu)
        if not self.in_flight:
            fits = max(fits, 1)  # larger than the cluster today: let Ray queue (or autoscale)
        return min(spec.max_concurrent - len(self._tasks(sweep_id)), fits)

    def _fill(self) -> int:
        started = 0
        cluster = ray.cluster_resources()
        active = self.store.active_sweeps()
        for gone in set(self.waiting) - {sweep.id for sweep in active}:
            self.waiting.pop(gone, None)  # cancelled or finished: it waits for nothing now
        now_optuna = {sweep.id for sweep in active if sweep.search == "optuna"}
        for gone in self._optuna_active - now_optuna:  # completed, or stopped by anyone
            sweep = self.store.get_sweep(gone)
            if sweep is not None and SweepStatus(sweep.status).is_stopped():
                self.untold.add(gone)  # told by the next tick's pass
        self._optuna_active = now_optuna
        # one call to Ray's control store per tick with work to place, none while idle
        largest_node_cpus = max((float(n.get("Resources", {}).get("CPU", 0.0))
                                 for n in ray.nodes() if n.get("Alive")),
                                default=0.0) if active else 0.0
        for sweep in active:
            try:
                spec = self._spec(sweep)
            except BadSweep:
                continue  # marked failed; the other sweeps go on
            if sweep.study and self._advance_study(sweep, spec):
                continue  # the study stopped or finished
            free = self._free_slots(spec, sweep.id, cluster, largest_node_cpus)
            if free <= 0:
                continue
            if spec.search.method == "optuna":
                try:
                    self._ask_optuna(sweep, spec, free)
                except OptunaUnavailable:
                    # why, for the listing; the error itself goes to /health and the log
                    self.waiting[sweep.id] = ("Optuna's storage is failing; this sweep's next "
                                              "trials are asked once it answers (see /health)")
            leased = self._lease(sweep.id, spec, free, cluster)
            while leased:
                try:
                    self._submit(spec, leased[0])
                except Exception:
                    self._unsubmit(leased)
                    raise
                leased.pop(0)
                started += 1
        if started:
            self._wake_mirror()
        return started

    def _lease(self, sweep_id: str, spec: SweepSpec, free: int,
               cluster: dict[str, float]) -> list[list[TrialRecord]]:
        """Lease up to `free` tasks' worth of pending trials: single trials, or packs of
        one shape when the spec packs (planned over the pending trials, plan order)."""
        if spec.resources.pack == 1:
            return [[t] for t in self.store.lease_pending(self.owner, free, sweep_id=sweep_id)]
        # every task slot this sweep may fill at once, for balancing the packs
        fits = _tasks_fitting(spec, cluster.get("CPU", 0.0), cluster.get("GPU", 0.0))
        slots = min(spec.max_concurrent, max(1, fits))
        pending = self.store.leasable(sweep_id, limit=min(_MAX_PEEK, slots * MAX_PACK))
        where = measured_packs(spec)
        planned = plan_packs(pending, slots, lambda t: pack_size(spec, t.spec),
                             lambda t, n: pack_cost(n, t.spec, where))
        leased: list[list[TrialRecord]] = []
        try:
            for pack in planned[:free]:
                got = self.store.lease_pending(self.owner, len(pack), sweep_id=sweep_id,
                                               ids=[t.id for t in pack])
                if got:  # fewer when another coordinator leased some meanwhile
                    leased.append(got)
        except Exception:
            self._unsubmit(leased)  # the packs leased before the failure have no task
            raise
        return leased

    def _unsubmit(self, leased: list[list[TrialRecord]]) -> None:
        """Leased trials that will not be submitted: back to pending now, or once the
        database takes it (see `unsubmitted`)."""
        self.unsubmitted.extend([t.id for t in pack] for pack in leased)
        with contextlib.suppress(Exception):
            self._release_unsubmitted()

    def _submit(self, spec: SweepSpec, trials: list[TrialRecord]) -> None:
        """Start one Ray task for one trial or a pack of trials of one shape."""
        specs = [{**t.spec, "num_threads": spec.resources.threads} for t in trials]
        ids = [t.id for t in trials]
        options: dict[str, Any] = {"num_cpus": spec.resources.cpus, "max_retries": 0}
        if spec.resources.gpus:
            options["num_gpus"] = spec.resources.gpus
        cache = str(self.settings.cache_dir)
        # the worker checks the data again: still inside the roots, still what was submitted
        guard = ([str(r) for r in self.settings.data_roots], trials[0].data_hash)
        if len(trials) == 1:
            ref = self._remote.options(**options).remote(specs[0], ids[0], self._board, cache,
                                                         *guard)
        else:
            ref = self._remote_pack.options(**options).remote(specs, ids, self._board, cache,
                                                              *guard)
        for i, trial in enumerate(trials):
            self.in_flight[trial.id] = InFlight(trial, ref, spec.resources.cpus,
                                                   spec.resources.gpus,
                                                   member=i if len(trials) > 1 else None,
                                                   drains_before=self._drains_sent)

    # staged studies (coordinator/study.py) -------------------------------------------------
    def _advance_study(self, sweep: SweepRecord, spec: SweepSpec) -> bool:
        """When every trial of a study planned so far has finished, plan its next stage
        (or stop it, or finish it) in one transaction. True if the sweep ended."""
        sid = sweep.id
        if self._in_flight_for(sid):
            return False
        if self.store.count_trials(sid, status=list(ACTIVE)):
            return False
        if spec.search.method == "optuna" and self._optuna_left(sid, spec) > 0:
            return False
        if sweep.study.get("done"):
            # recorded done, and its status refresh lost (a failed write): finish it now
            self._refresh(sid)
            return True
        try:
            step = next_step(spec, sweep.study, self.store.results_frame(sid))
        except Exception as exc:  # a planner bug must not stall every other sweep's ticks
            reason = f"could not plan the study's next stage: {type(exc).__name__}: {exc}"
            log.exception("study %s: %s", sid, reason)
            state = {**sweep.study, "stop_reason": reason[:4000]}
            self.store.plan_stage(sid, int(sweep.study.get("round", 0)), state, [],
                                  stop=("failed", reason[:4000]))
            self._wake_mirror()
            return True
        stop = ("stopped", step.reason) if step.kind == "stop" else None
        if not self.store.plan_stage(sid, int(sweep.study.get("round", 0)), step.state,
                                     step.trials, stop=stop):
            return False  # planned by someone else in the meantime: next tick sees it
        log.info("study %s: %s%s", sid, step.kind,
                 f" ({step.reason})" if step.reason else
                 f" {len(step.trials)} trials" if step.trials else "")
        if step.kind == "stop":
            return True  # stored as `stopped` with its reason; the mirror closes the run
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

    def _ask_optuna(self, sweep: SweepRecord, spec: SweepSpec, free: int) -> None:
        if self.store.count_trials(sweep.id, status="pending"):
            return
        low, high = spec.grid.lr_bounds()
        # tasks' worth: a shape that packs asks its first batch (fixed LRs that need no
        # results) a pack at a time; every later ask learns from the results, so one by one
        asked = 0
        for shape in plan_shapes(spec):
            if asked >= free:
                return
            have = self.store.count_trials(sweep.id, arm=shape.arm, width=shape.width,
                                           depth=shape.depth, sigma_base=shape.sigma_base,
                                           seed=shape.seed)
            if have >= spec.search.n_trials:
                continue
            with self._optuna_calls():
                study = self._study(sweep.id, spec, shape)
            shape_spec = trial_for(spec, shape, low).trial.model_dump()
            batch = min(pack_size(spec, shape_spec), spec.search.startup_count() - have)
            for _ in range(max(1, batch)):
                self._ask_one(sweep.id, spec, shape, study, low, high)
            asked += 1

    def _ask_one(self, sweep_id: str, spec: SweepSpec, shape: ShapeKey, study: optuna.Study,
                 low: float, high: float) -> None:
        with self._optuna_calls():
            number, lr = self.optuna.ask(study, low, high)
            self.optuna_storage.succeeded()
        planned = trial_for(spec, shape, lr)
        try:
            trial_id = self.store.add_trial(sweep_id, planned, optuna_trial_number=number)
        except Exception:
            # asked but never to run: retracted now, or on a later tick if Optuna's storage
            # is failing too (by the next coordinator's start if this one dies first)
            self.unadded.append((study, number))
            with contextlib.suppress(Exception):
                self._retract_unadded()
            raise
        with contextlib.suppress(OptunaUnavailable), self._optuna_calls():
            # unbound when Optuna's storage failed here: it runs unpruned, as after a restart
            self.optuna.bind(trial_id, study, number, planned.trial)
        try:
            added = self.store.get_trial(trial_id)
        except Exception:
            # reused or not is unknown now: the untold pass tells it if it was (each tick)
            self.untold.add(sweep_id)
            raise
        if added is not None and added.status != "pending":
            # reused from an identical earlier trial: it never runs, so tell it now
            self.optuna.forget(trial_id)
            self._owe(added, added.status, added.result, tell=True)

    def _optuna_left(self, sweep_id: str, spec: SweepSpec) -> int:
        """Trials the Optuna studies still have to ask (never negative: a study's later
        stages add trials beyond them, and a negative count would read as "some left")."""
        asked = self.store.count_trials(sweep_id)
        return max(0, len(plan_shapes(spec)) * spec.search.n_trials - asked)

    def _tell_optuna(self, trial: TrialRecord, status: str, result: dict | None) -> None:
        sweep = self.store.get_sweep(trial.sweep_id)
        spec = self._spec(sweep)
        value = (result or {}).get("final_val_loss")
        with self._optuna_calls():
            study = self._study(sweep.id, spec, _shape_of(trial))
            # the diverged penalty scales with the models' vocabulary
            self.optuna.tell(study, trial.optuna_trial_number, status, value,
                             spec.model_vocab_size())
            self.optuna_storage.succeeded()

    @contextlib.contextmanager
    def _optuna_calls(self) -> Iterator[None]:
        """Around calls to Optuna's storage. While it fails, they wait for its backoff
        (OptunaUnavailable at once); a failure starts or extends the backoff, drops the
        storage's connections (one opened during an outage can stay unusable after it) and
        is raised as OptunaUnavailable, which holds up only Optuna's own work: storing
        results and the other sweeps go on. Callers mark a success where a call surely
        reached the storage (a study may come from memory)."""
        if not self.optuna_storage.ready():
            raise OptunaUnavailable(self.optuna_storage.error)
        try:
            yield
        except OptunaUnavailable:
            raise
        except Exception as exc:
            # Optuna wraps the database's own error in a generic "error during the commit"
            cause = exc.__cause__ if isinstance(
                exc, optuna.exceptions.StorageInternalError) and exc.__cause__ else exc
            self.optuna_storage.failed(cause)
            self.optuna.reconnect()
            raise OptunaUnavailable(f"{type(cause).__name__}: {cause}") from exc


def _fix_queued(queue: list, fix: Callable[[Any], object]) -> None:
    """Apply `fix` to each queued item, oldest first, dropping each once done; the first that
    fails raises (the loop backs off) and stays queued for the next tick."""
    while queue:
        fix(queue[0])
        queue.pop(0)


def _shape_of(trial: TrialRecord) -> ShapeKey:
    """The shape (and so the Optuna study) a trial belongs to."""
    return ShapeKey(trial.arm, trial.width, trial.depth, trial.sigma_base, trial.seed)


def _tasks_fitting(spec: SweepSpec, cpus: float, gpus: float) -> int:
    """How many of the sweep's tasks fit in these CPUs and GPUs."""
    res = spec.resources
    fits = math.floor(cpus / res.cpus + 1e-9)
    if res.gpus:
        fits = min(fits, math.floor(gpus / res.gpus + 1e-9))
    return fits


def _outcome(ref: ray.ObjectRef, member: int | None = None) -> Outcome:
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
        return Outcome("lost", error=f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # anything else escaping the task is final
        return Outcome(TrialStatus.FAILED, error=f"{type(exc).__name__}: {exc}")
