"""SIGTERM as a preemption notice (workers/preemption.py), without a training run: within
`preemption()` the signal only raises a flag; a Preempted raised within ends the process as
the handler before it would have (Ray's worker: its own exit; the default: death by the
signal; an ignored SIGTERM: not at all); off the main thread nothing changes."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

from hptransfer.workers.preemption import Preempted, preemption

CHILD = """
import os, signal, sys
from hptransfer.workers.preemption import Preempted, preemption
{before}
with preemption() as preempted:
    os.kill(os.getpid(), signal.SIGTERM)
    print("flag", preempted(), flush=True)
    raise Preempted("checkpointed")
"""


def child(before: str) -> subprocess.CompletedProcess:
    """A process that gets SIGTERM within preemption(), then raises Preempted, with the
    handler `before` installed first."""
    script = CHILD.format(before=before)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)


def test_preempted_ends_the_process_by_the_signal_by_default():
    done = child("")
    assert "flag True" in done.stdout  # the signal did not end it: it raised the flag
    assert done.returncode == -signal.SIGTERM


def test_preempted_calls_the_handler_that_was_there_before():
    """Ray's worker installs a SIGTERM handler that exits: that exit ends the process."""
    done = child("def ray_worker(signum, frame):\n"
                 "    print('ray handler', signum, flush=True)\n"
                 "    sys.exit(7)\n"
                 "signal.signal(signal.SIGTERM, ray_worker)")
    assert "flag True" in done.stdout
    assert f"ray handler {int(signal.SIGTERM)}" in done.stdout
    assert done.returncode == 7


def test_an_ignored_sigterm_stays_ignored_and_preempted_goes_on_up():
    done = child("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                 "def end(kind, exc, tb):\n"
                 "    print('raised', kind.__name__,\n"
                 "          signal.getsignal(signal.SIGTERM) is signal.SIG_IGN, flush=True)\n"
                 "    os._exit(3)\n"
                 "sys.excepthook = end")
    assert "flag True" in done.stdout
    assert "raised Preempted True" in done.stdout
    assert done.returncode == 3


def test_off_the_main_thread_the_flag_stays_down_and_the_handler_unchanged():
    before = signal.getsignal(signal.SIGTERM)
    seen = []

    def worker() -> None:
        with preemption() as preempted:
            seen.append((preempted(), signal.getsignal(signal.SIGTERM)))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [(False, before)]
    assert signal.getsignal(signal.SIGTERM) is before
    assert issubclass(Preempted, BaseException) and not issubclass(Preempted, Exception)
