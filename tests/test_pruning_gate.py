"""The pruning gate: a trial waits at the first step Optuna's pruner may stop it until the
coordinator has judged that point, so whether a trial is pruned does not depend on how fast
the coordinator (or the host) is compared with the trial."""

from __future__ import annotations

import copy
import logging
import threading
import time

import pytest
from conftest import TINY_SPEC
from waiting import wait_for

from hptransfer.config import get_settings
from hptransfer.coordinator.progress import ProgressBoard
from hptransfer.coordinator.service import Coordinator
from hptransfer.workers import remote


def _point(step: int, val_loss: float | None = None) -> dict:
    return {"step": step, "train_loss": 3.0, **({"val_loss": val_loss} if val_loss else {})}


def test_the_board_holds_a_gated_point_until_the_drain_after_the_one_that_took_it():
    board = ProgressBoard()
    board.gate("a", 20)
    board.gate("b", 20)
    # before the gate, and at it without an evaluation: the worker trains on
    assert board.report("a", _point(10, 3.5)) is False
    assert board.report("a", _point(20)) is False
    # the first evaluation at or past the gate: the worker asks for the verdict
    assert board.report("a", _point(25, 3.4)) is None
    assert board.verdict("a") is None  # not drained yet
    board.drain()  # the coordinator takes the point...
    assert board.verdict("a") is None  # ...and has not answered yet
    board.request_stop("a")  # its verdict: stop, sent before its next drain
    board.drain()
    assert board.verdict("a") is True

    assert board.report("b", _point(20, 3.0)) is None
    board.drain()
    board.drain()  # judged, and not stopped
    assert board.verdict("b") is False
    # only the first decision waits: later evaluations are judged as they come
    assert board.report("b", _point(30, 2.9)) is False
    # a trial the board never gated (or forgot) is never held
    assert board.report("c", _point(30, 2.9)) is False
    assert board.verdict("c") is False
    board.gate("d", 5)
    assert board.report("d", _point(5, 2.0)) is None
    board.forget("d")
    assert board.verdict("d") is False


class _Remote:
    """A local object with Ray's `.remote` calling convention (the channel calls
    `progress.report.remote(...)` and `ray.get`s the result)."""

    def __init__(self, board: ProgressBoard) -> None:
        self._board = board

    def __getattr__(self, name: str):
        method = getattr(self._board, name)
        return type("M", (), {"remote": staticmethod(lambda *a: method(*a))})


@pytest.fixture
def local_ray_get(monkeypatch):
    """ray.get of a plain value: the channel's calls answered in this process."""
    import ray

    monkeypatch.setattr(ray, "get", lambda value, timeout=None: value)


def test_a_gated_report_waits_for_a_slow_coordinators_verdict(local_ray_get):
    board = ProgressBoard()
    board.gate("t", 50)
    report = remote.progress_channel(_Remote(board))
    judged = threading.Event()

    def slow_coordinator() -> None:
        """Drains, takes 0.5 s to judge (a loaded host), asks the trial to stop, drains."""
        while not board._awaiting:
            time.sleep(0.01)
        board.drain()
        time.sleep(0.5)
        board.request_stop("t")
        board.drain()
        judged.set()

    thread = threading.Thread(target=slow_coordinator)
    thread.start()
    assert report("t", _point(10, 3.0)) is False  # before the gate: no wait
    started = time.monotonic()
    assert report("t", _point(50, 3.2)) is True  # stopped at the gated step itself
    waited = time.monotonic() - started
    thread.join()
    assert judged.is_set() and waited >= 0.5, waited


def test_a_verdict_that_never_comes_holds_the_trial_only_a_bounded_while(local_ray_get,
                                                                          monkeypatch,
                                                                          caplog):
    monkeypatch.setattr(remote, "_VERDICT_WAIT_S", 0.3)
    board = ProgressBoard()  # no coordinator drains it: stalled, or restarting
    board.gate("t", 1)
    report = remote.progress_channel(_Remote(board))
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=remote.__name__):
        assert report("t", _point(1, 3.0)) is False
    assert 0.3 <= time.monotonic() - started < 2.0
    assert "no pruning verdict for trial t" in caplog.text
    assert report("t", _point(2, 3.0)) is False  # reporting goes on
    assert len(board.drain()[0]["t"]) == 2


def test_a_trial_shorter_than_the_coordinators_reaction_is_still_pruned(hpt_home,
                                                                        ray_cluster):
    """An Optuna search, one trial at a time, with a coordinator that takes 1.5 s to judge a
    trial's first point past its decision step (a loaded host): a trial trains its last half
    in well under that, so without the gate the first batch's lowest LR, asked after three
    full runs that beat it, trained to the end whatever the pruner said."""
    spec = {**copy.deepcopy(TINY_SPEC), "name": "gated", "max_concurrent": 1,
            "resources": {"pack": 1}}
    spec["grid"]["lrs"] = {"log2_min": -13, "log2_max": -3, "step": 1}
    spec["budget"]["steps"] = 40
    spec["search"] = {"method": "optuna", "n_trials": 4, "pruner": "rank", "keep_top": 3}
    coordinator = Coordinator(get_settings())
    bridge = coordinator.dispatcher.optuna_bridge
    judge, judged = bridge.should_prune, set()

    def slow_judge(trial_id: str, points: list[dict]) -> bool:
        if trial_id not in judged and any(p.get("val_loss") is not None
                                          and p["step"] >= 20 for p in points):
            judged.add(trial_id)
            time.sleep(1.5)
        return judge(trial_id, points)

    bridge.should_prune = slow_judge
    coordinator.start()
    try:
        sweep_id = coordinator.submit(spec)["id"]
        wait_for(lambda: coordinator.store.get_sweep(sweep_id).status == "completed", 180,
                 "the search to end")
    finally:
        coordinator.stop()
    rows = sorted(coordinator.store.trials(sweep_id, limit=None),
                  key=lambda r: r.optuna_trial_number)
    assert [r.status for r in rows[:3]] == ["completed"] * 3
    lowest = rows[3]  # the first batch's 4th ask: its lowest LR, worst at step 20
    assert lowest.lr == min(r.lr for r in rows), [r.lr for r in rows]
    assert lowest.status == "pruned", (lowest.status, [r.status for r in rows])
    assert lowest.result["steps"] < 40
