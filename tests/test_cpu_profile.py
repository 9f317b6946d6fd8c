"""The opt-in per-test CPU profile (tests/cpu_profile.py) reads /proc/stat's busy time."""

from __future__ import annotations

import os

from cpu_profile import host_busy_seconds


def test_busy_time_is_every_field_but_idle_and_iowait(tmp_path):
    # user nice system idle iowait irq softirq steal guest guest_nice, in clock ticks
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 20 30 5000 700 4 6 0 0 0\ncpu0 1 2 3 4 5 6 7 0 0 0\n")
    assert host_busy_seconds(str(stat)) == (100 + 20 + 30 + 4 + 6) / os.sysconf("SC_CLK_TCK")
