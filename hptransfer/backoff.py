"""Back-off for a dependency that fails (the app database, Optuna's storage): when to try it
again, with pauses doubling up to a cap, and what went wrong, for /health. One log line when
its failures start and one when they end, not one per attempt."""

from __future__ import annotations

import logging
import time


class Backoff:
    """`traceback=False`: the failure that starts an outage is logged as one line (its type
    and message) and its traceback at DEBUG, for a dependency whose outages are expected
    (MLflow away) rather than a sign of a bug here."""

    def __init__(self, what: str, log: logging.Logger, floor: float, cap: float, *,
                 traceback: bool = True) -> None:
        self.what, self.log, self.floor, self.cap = what, log, floor, cap
        self.traceback = traceback
        self.error: str | None = None  # the latest failure, while failing
        self.delay = 0.0  # the pause before the next attempt
        self._since: float | None = None
        self._retry_at = 0.0

    def ready(self) -> bool:
        """Whether the next attempt is due (always, unless failing)."""
        return time.monotonic() >= self._retry_at

    def failed(self, exc: BaseException) -> float:
        """Note a failure; returns the pause before the next attempt."""
        now = time.monotonic()
        self.error = f"{type(exc).__name__}: {str(exc)[:300]}"
        if self._since is None:
            self._since = now
            self._log_start(exc)
        self.delay = min(max(2 * self.delay, self.floor), self.cap)
        self._retry_at = now + self.delay
        return self.delay

    def _log_start(self, exc: BaseException) -> None:
        if self.traceback:
            self.log.warning("%s failing; retrying with backoff (up to %g s)", self.what,
                             self.cap, exc_info=exc)
            return
        lines = str(exc).strip().splitlines()  # MLflow's messages run to many lines
        self.log.warning("%s failing (%s: %s); retrying with backoff (up to %g s), one line "
                         "when it recovers", self.what, type(exc).__name__,
                         lines[0][:300] if lines else "", self.cap)
        self.log.debug("%s: the failure that started the outage", self.what, exc_info=exc)

    def succeeded(self) -> None:
        """Note a success: the next attempt is due at once."""
        if self._since is not None:
            self.log.warning("%s recovered after %.1f s", self.what,
                             time.monotonic() - self._since)
        self.error, self.delay, self._since, self._retry_at = None, 0.0, None, 0.0
