"""Backoff (backoff.py): the pause before retrying a failing dependency doubles from
its floor up to its cap, no attempt is due before it has passed, and an outage is logged once
when it starts and once when it ends."""

from __future__ import annotations

import logging
import time

from hptransfer.backoff import Backoff


def test_pauses_double_up_to_the_cap_and_a_success_ends_the_outage(caplog):
    log = logging.getLogger("test-backoff")
    caplog.set_level(logging.INFO, logger="test-backoff")
    backoff = Backoff("the thing", log, floor=0.05, cap=0.3)
    assert backoff.ready() and backoff.error is None
    pauses = [backoff.failed(OSError(f"down {i}")) for i in range(5)]
    assert pauses == [0.05, 0.1, 0.2, 0.3, 0.3]
    assert backoff.error == "OSError: down 4"
    assert not backoff.ready()  # the last pause has not passed
    time.sleep(0.35)
    assert backoff.ready()
    backoff.succeeded()
    assert backoff.error is None and backoff.delay == 0.0 and backoff.ready()
    assert backoff.failed(OSError("again")) == 0.05  # a new outage starts from the floor
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "the thing failing; retrying with backoff (up to 0.3 s)"
    assert lines[1].startswith("the thing recovered after ")
    assert len(lines) == 3 and lines[2] == lines[0]
