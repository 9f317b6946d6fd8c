"""What every piece of the dispatch loop shares: the app database, the settings, this
coordinator's lease owner, its poll interval, the MLflow mirror to wake, and the sweeps'
validated specs (a stored spec that no longer validates fails its sweep, so it cannot block
the others)."""

from __future__ import annotations

import logging

from hptransfer.config import Settings
from hptransfer.spec import SweepSpec
from hptransfer.spec.cache import SpecCache
from hptransfer.store.store import Store, SweepRecord
from hptransfer.tracking.mirror import Mirror

# one logger for every piece of the dispatch loop: its lines keep the name they always had
log = logging.getLogger("hptransfer.coordinator.dispatch")

MAX_BACKOFF_S = 30.0  # the longest pause between tries of a failing database or Optuna storage


class BadSweep(Exception):
    """A stored sweep that cannot be dispatched (it has been marked failed)."""


class DispatchContext:
    """The store, settings and mirror the pieces of the dispatch loop work against."""

    def __init__(self, store: Store, settings: Settings, mirror: Mirror | None, owner: str,
                 poll_interval: float) -> None:
        self.store, self.settings, self.mirror = store, settings, mirror
        self.owner = owner
        self.poll_interval = poll_interval
        self._specs = SpecCache()

    def spec(self, sweep: SweepRecord) -> SweepSpec:
        """The sweep's validated spec; a stored spec that no longer validates fails the
        sweep with the reason (BadSweep), so it cannot block the others."""
        try:
            return self._specs.get(sweep.id, sweep.spec)
        except Exception as exc:
            reason = f"stored spec is invalid: {exc}"
            log.error("sweep %s failed: %s", sweep.id, reason)
            self.store.fail_sweep(sweep.id, reason[:4000])
            self.wake_mirror()
            raise BadSweep(reason) from exc

    def wake_mirror(self) -> None:
        if self.mirror:
            self.mirror.wake()
