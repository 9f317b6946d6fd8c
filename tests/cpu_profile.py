"""Opt-in per-test CPU of the whole host (`HPT_TEST_CPU_PROFILE=FILE`, tests/conftest.py).

A test's cost is mostly in processes it starts (`hpt serve`, Ray daemons and workers,
cluster_up.sh's topology), which pytest's durations do not see and which a loaded host
stretches in wall time. This reads the busy time of every CPU from /proc/stat around each
test, so it is only meaningful serially on an otherwise idle host:

    HPT_TEST_CPU_PROFILE=/tmp/cpu.jsonl HPT_TEST_WORKERS=0 bash scripts/test.sh

Each line: {"test": node id, "cpu_s": CPU-seconds of the host, "wall_s": seconds}.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Generator
from pathlib import Path

import pytest


def host_busy_seconds(stat: str = "/proc/stat") -> float:
    """CPU-seconds every CPU of the host has spent busy since boot (all but idle and
    iowait)."""
    with open(stat) as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


class CpuProfile:
    """Appends one JSON line per test to `path`."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item,
                                nextitem: pytest.Item | None) -> Generator[None, None, None]:
        busy, started = host_busy_seconds(), time.monotonic()
        yield
        line = {"test": item.nodeid, "cpu_s": round(host_busy_seconds() - busy, 2),
                "wall_s": round(time.monotonic() - started, 2)}
        with self.path.open("a") as f:
            f.write(json.dumps(line) + "\n")
