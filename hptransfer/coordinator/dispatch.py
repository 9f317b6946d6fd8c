"""The dispatch loop: each tick leases pending trials, runs them as Ray tasks and writes
their outcomes back. One coordinator per app database.

The work is split into pieces, each with one job; the Dispatcher runs them in order:
- ray_runner.RayRunner: Ray tasks, their progress, cancels, retries and stored outcomes;
- optuna_bridge.OptunaBridge and optuna_asks.OptunaAsker: Optuna's studies (asks, tells,
  retractions, pruning), backed off while Optuna's storage fails;
- study_advancer.StudyAdvancer: a staged study's next stage;
- recovery.RecoveryLedger: what a failed write left half done, and a restart's recovery.

Trial state is written only to the app database (MLflow mirrors it: `tracking/mirror.py`).
While the database is unreachable the loop backs off exponentially (capped) and logs one
line when the outage starts and one when it ends. When Optuna's storage (a database of its
own) fails, only the Optuna sweeps' asks, tells and pruning wait, backing off the same way:
results are still stored and the other sweeps go on, and an Optuna sweep completes only once
its studies have heard every result. A stored sweep whose spec no longer validates is marked
failed and skipped. A freed slot is refilled in the same tick, so a pruned or finished trial
starts the next one immediately.

Packing (`resources.pack`, `packing.py`): pending trials of one shape may run as one Ray task
(`execute_trials`), planned here when they are leased.
"""

from __future__ import annotations

import queue
import threading
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from hptransfer.backoff import Backoff
from hptransfer.config import Settings
from hptransfer.contracts.status import SweepStatus
from hptransfer.spec import SweepSpec
from hptransfer.spec.sections import MAX_PACK
from hptransfer.store.store import Store, SweepRecord, TrialRecord
from hptransfer.tracking.mirror import Mirror

from .dispatch_context import MAX_BACKOFF_S, BadSweep, DispatchContext, log
from .optuna_asks import OptunaAsker
from .optuna_bridge import OptunaBridge, OptunaUnavailable
from .packing import measured_packs, pack_cost, pack_size, plan_packs
from .ray_runner import (
    ClusterCapacity,
    InFlight,
    RayRunner,
    init_ray,
    never_fits,
    task_of,
)
from .recovery import RecoveryLedger
from .study_advancer import StudyAdvancer

# init_ray and InFlight are imported from here by the API server and the tests
__all__ = ["Dispatcher", "InFlight", "init_ray"]

MAX_PACK_PEEK = 2000  # pending trials read per sweep and tick to plan packs from


class Dispatcher:
    """The tick loop: runs the pieces in order each tick, backs off while ticks fail, and
    sleeps between ticks until work arrives or a trial finishes."""

    def __init__(
        self,
        store: Store,
        settings: Settings,
        mirror: Mirror | None = None,
        owner: str | None = None,
        poll_interval: float = 0.2,
    ) -> None:
        self.store, self.settings = store, settings
        self.owner = owner or f"coord-{uuid.uuid4().hex[:10]}"
        self.poll_interval = poll_interval
        self.context = DispatchContext(store, settings, mirror, self.owner, poll_interval)
        self.optuna_bridge = optuna_bridge = OptunaBridge(self.context)
        self.recovery = RecoveryLedger(self.context, optuna_bridge)
        self.ray_runner = RayRunner(
            self.context,
            should_prune=lambda trial_id, points: self.optuna_bridge.should_prune(trial_id,
                                                                                 points),
            after_stored=self._outcome_stored,
            verdict_step=lambda trial_id: self.optuna_bridge.verdict_step(trial_id))
        self.optuna_asker = OptunaAsker(self.context, optuna_bridge, self.recovery)
        self.study_advancer = StudyAdvancer(self.context, self.ray_runner, optuna_bridge,
                                            self.recovery)
        # sweeps a request cancelled (another thread): an Optuna sweep's trials asked but not
        # leased were cancelled with it, and its resync pass tells their Optuna trials FAIL
        self.stopped: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.waiting: dict[str, str] = {}  # sweep id -> why its trials cannot start now
        # Optuna sweeps active at the last tick: one that left the set stopped or finished,
        # maybe by another process's request (an API-only server cancelling it), so its
        # Optuna trials go to the resync pass
        self._optuna_active: set[str] = set()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.ticks = Backoff("dispatch", log, poll_interval, MAX_BACKOFF_S)

    @property
    def mirror(self) -> Mirror | None:
        return self.context.mirror

    @mirror.setter
    def mirror(self, mirror: Mirror | None) -> None:
        self.context.mirror = mirror

    @property
    def in_flight(self) -> dict[str, InFlight]:
        """Trial id -> its attempt running in Ray (see RayRunner)."""
        return self.ray_runner.in_flight

    @property
    def optuna_storage(self) -> Backoff:
        """The back-off from Optuna's storage: its error, while it fails, for /health."""
        return self.optuna_bridge.storage_backoff

    @property
    def last_error(self) -> str | None:
        """Why the latest tick failed, while ticks fail."""
        return self.ticks.error

    # lifecycle -----------------------------------------------------------------------
    def start(self, background: bool = True) -> None:
        self.ray_runner.start()
        n = self.store.requeue_orphans(self.owner)
        if n:
            log.warning("re-queued %d trials left running by a previous coordinator", n)
        self.recovery.recover_after_restart()
        self.context.wake_mirror()
        if background:
            self._thread = threading.Thread(target=self._loop, name="hpt-dispatch", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join(timeout)
        self.ray_runner.stop()

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
            self.ray_runner.wait_for_a_result(self.poll_interval)
        else:
            self._wake.wait(self.poll_interval)
        self._wake.clear()

    # one tick ------------------------------------------------------------------------
    def run_once(self) -> bool:
        recovery = self.recovery
        self.ray_runner.cancel_stopped_sweeps()
        self.ray_runner.relay_progress()
        recovery.retract_asks()
        recovery.release_leases()
        recovery.release_unsure_leases(self.in_flight)
        self._take_stopped()
        recovery.resync_optuna_sweeps()
        recovery.settle_follow_ups()
        collected = self.ray_runner.collect()
        self.ray_runner.remove_orphaned_placement_groups()
        started = self._fill()
        return bool(collected or started)

    def _take_stopped(self) -> None:
        """The Optuna sweeps among those requests stopped go to the resync pass."""
        while not self.stopped.empty():
            sweep_id = self.stopped.get_nowait()
            try:
                sweep = self.store.get_sweep(sweep_id)
            except Exception:  # the database failed: looked at again next tick
                self.stopped.put(sweep_id)
                raise
            if sweep is not None and sweep.search == "optuna":
                self.recovery.resync_later(sweep_id)

    def _outcome_stored(self, trial: TrialRecord, status: str, result: dict | None) -> None:
        """A trial's outcome is durably stored: its follow-ups (see RecoveryLedger)."""
        self.optuna_bridge.forget(trial.id)  # no longer live: nothing left to prune
        self.context.wake_mirror()
        tell = trial.optuna_trial_number is not None and status != "pending"
        self.recovery.follow_up(trial, status, result, tell)

    # filling slots -------------------------------------------------------------------
    def _fill(self) -> int:
        """Advance studies, ask Optuna, lease and submit as many tasks as fit now."""
        started = 0
        capacity = self.ray_runner.capacity()
        active = self.store.active_sweeps()
        for gone in set(self.waiting) - {sweep.id for sweep in active}:
            self.waiting.pop(gone, None)  # cancelled or finished: it waits for nothing now
        self._note_optuna_sweeps_gone(active)
        if active:  # one call to Ray's control store per tick with work to place, none idle
            capacity.largest_node_cpus()
        for sweep in active:
            if self._past_ceiling(sweep):
                continue  # marked failed; its running trials are cancelled next tick
            try:
                spec = self.context.spec(sweep)
            except BadSweep:
                continue  # marked failed; the other sweeps go on
            if sweep.study and self.study_advancer.advance(sweep, spec):
                continue  # the study stopped or finished
            free, why = self.ray_runner.free_slots(spec, sweep.id, capacity)
            if why:
                self.waiting[sweep.id] = why
            else:
                self.waiting.pop(sweep.id, None)
            if free <= 0:
                continue
            started += self._start(sweep, spec, free, capacity)
        if started:
            self.context.wake_mirror()
        return started

    def _past_ceiling(self, sweep: SweepRecord) -> bool:
        """A sweep running longer than HPT_MAX_SWEEP_HOURS fails, saying so."""
        hours = self.context.settings.max_sweep_hours
        started = sweep.started_at
        if started is None:
            return False
        if started.tzinfo is None:  # SQLite hands naive UTC back
            started = started.replace(tzinfo=UTC)
        if datetime.now(UTC) - started <= timedelta(hours=hours):
            return False
        self.store.fail_sweep(sweep.id, f"ran past the server's HPT_MAX_SWEEP_HOURS={hours:g} "
                                        "(hours since it started); its unfinished trials "
                                        "were cancelled")
        self.context.wake_mirror()
        return True

    def _note_optuna_sweeps_gone(self, active: list[SweepRecord]) -> None:
        """An Optuna sweep no longer active was completed or stopped (by anyone): a stopped
        one's trials left RUNNING in Optuna are told by the next tick's resync pass."""
        now_optuna = {sweep.id for sweep in active if sweep.search == "optuna"}
        for gone in self._optuna_active - now_optuna:
            sweep = self.store.get_sweep(gone)
            if sweep is not None and SweepStatus(sweep.status).is_stopped():
                self.recovery.resync_later(gone)
        self._optuna_active = now_optuna

    def _start(self, sweep: SweepRecord, spec: SweepSpec, free: int,
               capacity: ClusterCapacity) -> int:
        """Ask Optuna (an Optuna sweep), then lease and submit up to `free` tasks; the
        tasks started."""
        if spec.search.method == "optuna":
            try:
                self.optuna_asker.ask(sweep, spec, free)
            except OptunaUnavailable:
                # why, for the listing; the error itself goes to /health and the log
                self.waiting[sweep.id] = ("Optuna's storage is failing; this sweep's next "
                                          "trials are asked once it answers (see /health)")
        started = 0
        leased = self._lease(sweep.id, spec, free, capacity)
        while leased:
            try:
                self.ray_runner.submit(spec, leased[0])
            except Exception:
                self.recovery.release_later(leased)
                raise
            leased.pop(0)
            started += 1
        return started

    def _lease(self, sweep_id: str, spec: SweepSpec, free: int,
               capacity: ClusterCapacity) -> list[list[TrialRecord]]:
        """Lease up to `free` tasks' worth of pending trials: single trials, or packs of
        one shape when the spec packs (planned over the pending trials, plan order); a
        sweep with trials on several workers leases those first, each alone, while the
        cluster has their workers' resources free."""
        leased: list[list[TrialRecord]] = []
        pending = None
        if spec.resources.workers > 1 or spec.resources.scale_out:
            pending = self.store.leasable(sweep_id, limit=MAX_PACK_PEEK)
            spanning = [t for t in pending if task_of(spec, t).spans]
            leased = self._lease_spanning(sweep_id, spec, spanning, free, capacity)
            free -= len(leased)
            pending = [t for t in pending if t not in spanning]
            if free <= 0 or not pending:
                return leased
        if spec.resources.pack == 1:
            if pending is None:
                return [[t] for t in self._lease_pending(free, sweep_id=sweep_id)]
            got = self._lease_pending(free, sweep_id=sweep_id,
                                      ids=[t.id for t in pending[:free]])
            return leased + [[t] for t in got]
        # every task slot this sweep may fill at once, for balancing the packs
        cluster = capacity.resources
        fits = spec.resources.base.count_in(cluster.get("CPU", 0.0), cluster.get("GPU", 0.0))
        slots = min(spec.max_concurrent, max(1, fits))
        if pending is None:
            pending = self.store.leasable(sweep_id,
                                          limit=min(MAX_PACK_PEEK, slots * MAX_PACK))
        where = measured_packs(spec)
        # a retry with a checkpoint runs alone, resuming there (a pack starts at step 0)
        alone = [t for t in pending if self.ray_runner.may_resume(spec, t)]
        planned = [[t] for t in alone] + plan_packs(
            [t for t in pending if t not in alone], slots, lambda t: pack_size(spec, t.spec),
            lambda t, n: pack_cost(n, t.spec, where))
        try:
            for pack in planned[:free]:
                got = self._lease_pending(len(pack), sweep_id=sweep_id,
                                          ids=[t.id for t in pack])
                if got:  # fewer when another coordinator leased some meanwhile
                    leased.append(got)
        except Exception:
            self.recovery.release_later(leased)  # the packs leased before it have no task
            raise
        return leased

    def _lease_pending(self, limit: int, **kwargs: Any) -> list[TrialRecord]:
        """store.lease_pending for this coordinator. When it raises, its transaction may
        have committed all the same (the database died with the answer on its way): the
        next tick releases whatever runs under this lease without a task."""
        try:
            return self.store.lease_pending(self.owner, limit, **kwargs)
        except Exception:
            self.recovery.lease_unsure()
            raise

    def _lease_spanning(self, sweep_id: str, spec: SweepSpec, spanning: list[TrialRecord],
                        free: int, capacity: ClusterCapacity) -> list[list[TrialRecord]]:
        """Lease trials on several workers, each alone, while their workers fit in what
        the cluster has free; a trial that can never fit sets the sweep's waiting reason."""
        used_cpu, used_gpu = self.ray_runner.used()
        room_cpu = capacity.resources.get("CPU", 0.0) - used_cpu
        room_gpu = capacity.resources.get("GPU", 0.0) - used_gpu
        leased: list[list[TrialRecord]] = []
        for trial in spanning:
            if len(leased) >= free:
                break
            task = task_of(spec, trial)
            why = never_fits(task, capacity)
            if why:
                self.waiting[sweep_id] = why
                continue
            if task.count_in(room_cpu, room_gpu) < 1:
                break  # plan order: the next trial waits for this one's workers
            got = self._lease_pending(1, sweep_id=sweep_id, ids=[trial.id])
            if got:
                leased.append(got)
                room_cpu -= task.cpus * task.workers
                room_gpu -= task.gpus * task.workers
        return leased
