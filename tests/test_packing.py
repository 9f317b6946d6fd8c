"""Pack planning (`coordinator/packing.py`) by hand: the makespan of a round and the tie
between pack sizes that finish together."""

from __future__ import annotations

from types import SimpleNamespace

from hptransfer.coordinator.packing import _makespan, plan_packs


def test_the_makespan_runs_the_longest_first():
    # 2 then 1 + 1 on two slots ends at 2 (the best there is); shortest first would start
    # the two 1s together and the 2 after one of them: 3
    assert _makespan([1.0, 1.0, 2.0], 2) == 2.0
    assert _makespan([1.0, 2.0, 3.0, 4.0], 1) == 10.0


def test_pack_sizes_that_finish_together_go_to_the_larger_packs():
    """Four trials of one shape on two slots, a pack of any size up to 4 taking one trial's
    time: two packs of 2 and one of 4 both end at 1; the fewer tasks win."""
    trials = [SimpleNamespace(spec={"width": 64, "lr": 2.0**-i}) for i in range(4)]
    packs = plan_packs(trials, 2, size_of=lambda t: 4, cost=lambda t, n: 1.0)
    assert [len(p) for p in packs] == [4]
