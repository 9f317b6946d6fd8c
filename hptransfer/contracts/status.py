"""Trial and sweep statuses: the one definition every layer imports.

A stdlib-only leaf module (no import of the rest of the package), so the pure `analysis/`
package may import it too.
"""

from __future__ import annotations

from enum import StrEnum


class TrialStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    DIVERGED = "diverged"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PRUNED = "pruned"

    def is_finished(self) -> bool:
        """Final: the trial will never run (again)."""
        return self not in ACTIVE

    def is_result(self) -> bool:
        """A status a worker's TrialResult can carry (training ran to an outcome)."""
        return self in RESULT_STATUSES


class SweepStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"
    STOPPED = "stopped"  # a study that ended early on purpose (no η* to transfer); `error` says why

    def is_stopped(self) -> bool:
        """Stopped for good: no trial is added, leased or refreshed back to running."""
        return self in (SweepStatus.CANCELLED, SweepStatus.FAILED, SweepStatus.STOPPED)


# pending/running mean the same for trials and sweeps (StrEnum members compare as strings)
ACTIVE: frozenset[str] = frozenset({"pending", "running"})
RESULT_STATUSES: frozenset[TrialStatus] = frozenset(
    {TrialStatus.COMPLETED, TrialStatus.DIVERGED, TrialStatus.FAILED, TrialStatus.PRUNED})

# An attempt whose worker died (its Ray task or node lost): the dispatcher retries the trial
# or fails it. A dispatcher outcome, never a trial's stored status.
LOST = "lost"


class StageState(StrEnum):
    """A staged study's stage as a sweep summary shows it (`stages[].state`)."""

    WAITING = "waiting"  # not planned yet: an earlier stage is still running
    RUNNING = "running"
    DONE = "done"
    STOPPED = "stopped"  # the study stopped in this stage (no η* to transfer)
    SKIPPED = "skipped"  # the study ended before planning it
    CANCELLED = "cancelled"


class HealthState(StrEnum):
    """GET /health's overall `status`."""

    OK = "ok"
    DEGRADED = "degraded"  # a component failed; the API still works
    DOWN = "down"  # the app database is unreachable (a 503)
