"""SIGTERM as a preemption notice: the trainer finishes its step, checkpoints, then the process
ends as the signal's previous handler would have ended it (Ray's worker exits, and the
coordinator retries the trial, which resumes from that checkpoint)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class Preempted(BaseException):  # noqa: N818 - not an error: the trial goes on elsewhere
    """Raised by the loop once it has checkpointed after a SIGTERM (a BaseException, so the
    trainer's `except Exception` does not turn it into a failed trial)."""


@contextmanager
def preemption() -> Iterator[Callable[[], bool]]:
    """Within: SIGTERM only sets a flag the loop reads (`preempted()`); a Preempted raised
    within is passed on to the handler that was there before. Off the main thread signals
    cannot be caught: the flag then stays down and SIGTERM does what it did."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    received = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.set())
    try:
        yield received.is_set
    except Preempted:
        signal.signal(signal.SIGTERM, previous)
        if callable(previous):
            previous(signal.SIGTERM, None)  # Ray's worker: raises SystemExit
        if previous != signal.SIG_IGN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
