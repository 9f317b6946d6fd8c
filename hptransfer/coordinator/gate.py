"""A bound on costly work done inside request threads: at most `computing` at once, at most
`admitted` computing or waiting; past that a request is refused at once (`Busy`: a 503 with
Retry-After) instead of filling the server's threadpool with waiters."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator


class Busy(RuntimeError):
    """Too much of this work is under way for a request to wait its turn."""

    retry_after_s = 5


def half_the_cores() -> int:
    """The default share of the machine for work done in request threads."""
    return max(1, (os.cpu_count() or 2) // 2)


class Gate:
    def __init__(self, computing: int, admitted: int, busy: type[Busy], why: str) -> None:
        self.computing = threading.BoundedSemaphore(computing)
        self.admitted = threading.BoundedSemaphore(admitted)
        self.busy, self.why, self.limit = busy, why, admitted

    @contextlib.contextmanager
    def admit(self, wait: bool = False) -> Iterator[None]:
        """Admission: with `wait=False` (a request) `busy` is raised at once when `limit`
        callers are already admitted; an internal caller waits."""
        if not self.admitted.acquire(blocking=wait):
            raise self.busy(f"{self.limit} {self.why}")
        try:
            yield
        finally:
            self.admitted.release()

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """A computation slot, once admitted (waits for one)."""
        with self.computing:
            yield
