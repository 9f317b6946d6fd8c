"""Faults around the dispatcher with real components: an app database that cannot be written
while trials finish (`chattr +i` on the SQLite files), and a stored sweep whose spec no
longer validates. Nothing is dropped, the loop backs off and logs once per outage, and one bad
sweep never blocks the others."""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

import pytest
import ray
from waiting import run_sweep, wait_for

from hptransfer.config import get_settings
from hptransfer.sweeper.plan import plan_sweep
from hptransfer.sweeper.service import Coordinator
from hptransfer.sweeper.spec import load_spec


def chattr(flag: str, files: list[Path]) -> bool:
    done = subprocess.run(["chattr", flag, *map(str, files)], capture_output=True)
    return done.returncode == 0


def immutable_supported(tmp_path: Path) -> bool:
    probe = tmp_path / "probe"
    probe.write_text("x")
    if shutil.which("chattr") is None or not chattr("+i", [probe]):
        return False
    try:
        try:
            probe.write_text("y")
        except OSError:
            return True
        return False
    finally:
        chattr("-i", [probe])


def test_results_survive_an_unwritable_database_and_the_loop_backs_off(
        hpt_home, ray_cluster, tiny_spec, tmp_path, caplog, monkeypatch):
    if not immutable_supported(tmp_path):
        pytest.skip("needs chattr +i (root on ext4/xfs) to make the database unwritable")
    tiny_spec.update(name="db-outage", max_concurrent=2, reuse=False)
    tiny_spec["grid"]["lrs"] = [2.0**-8, 2.0**-6]
    tiny_spec["budget"] = {"steps": 400, "batch_size": 4}  # seconds: outlives the chattr
    settings = get_settings()
    coordinator = Coordinator(settings)
    dispatcher = coordinator.dispatcher
    ticks = {"n": 0}
    real_tick = dispatcher.run_once

    def counted_tick() -> bool:
        ticks["n"] += 1
        return real_tick()

    monkeypatch.setattr(dispatcher, "run_once", counted_tick)
    caplog.set_level(logging.INFO, logger="hptransfer.sweeper.dispatch")
    # the database and its write-ahead log, where every write lands; not the -shm index, the
    # one file SQLite memory-maps: with it immutable too, a CI run's pytest once died of
    # SIGBUS inside SQLite
    db_files = [Path(settings.home) / name for name in ("hpt.db", "hpt.db-wal")]
    coordinator.start()
    locked = False
    try:
        sweep = coordinator.submit(tiny_spec)
        wait_for(lambda: len(dispatcher.in_flight) == 2 and all(
            f.last_step > 0 for f in dispatcher.in_flight.values()), 120,
            "both trials to be training")
        refs = [f.ref for f in dispatcher.in_flight.values()]
        caplog.clear()
        assert chattr("+i", [f for f in db_files if f.exists()])
        locked = True
        ticks_before = ticks["n"]
        ray.wait(refs, num_returns=2, timeout=120)  # both trials finish during the outage
        wait_for(lambda: dispatcher.last_error, 60, "a failed database write")
        wait_for(lambda: ticks["n"] >= ticks_before + 4, 60, "retries during the outage")
        outage_ticks = ticks["n"] - ticks_before
        # the outcomes are kept, not dropped: both trials are still in flight
        assert len(dispatcher.in_flight) == 2
        assert all(f.outcome is None or f.outcome.status == "completed"
                   for f in dispatcher.in_flight.values())
        assert chattr("-i", [f for f in db_files if f.exists()])
        locked = False
        wait_for(lambda: coordinator.store.get_sweep(sweep["id"]).status == "completed",
                 120, "the sweep to complete once the database is writable")
    finally:
        if locked:
            chattr("-i", [f for f in db_files if f.exists()])
        coordinator.stop()
    rows = coordinator.store.trials(sweep["id"], limit=None)
    assert [r.status for r in rows] == ["completed", "completed"]
    assert all(r.result and r.final_val_loss is not None and r.attempts == 1
               for r in rows)
    # one log line when the outage starts, one when it ends; not one per tick
    lines = [r.getMessage() for r in caplog.records if r.name == "hptransfer.sweeper.dispatch"]
    assert outage_ticks >= 4
    assert sum("dispatch failing" in m for m in lines) == 1, lines
    assert sum("dispatch recovered" in m for m in lines) == 1, lines
    assert len(lines) == 2, lines


def test_a_stored_sweep_that_no_longer_validates_fails_and_others_go_on(
        hpt_home, ray_cluster, tiny_spec):
    coordinator = Coordinator(get_settings())
    good = dict(tiny_spec, name="good")
    # stored as an older version (or a direct write) left it: trials planned, spec invalid now
    bad_spec = load_spec(dict(tiny_spec, name="bad"))
    stored = bad_spec.model_dump(mode="json")
    stored["grid"]["widths"] = [48]  # not a multiple of head_dim 32
    bad_id = coordinator.store.create_sweep(
        name="bad", spec=stored, spec_hash="x", search="grid", planned=plan_sweep(bad_spec),
        reuse=False, max_concurrent=2)
    run_sweep(coordinator, good, 180)
    bad = coordinator.store.get_sweep(bad_id)
    assert bad.status == "failed"
    assert "stored spec is invalid" in bad.error and "grid.widths" in bad.error
    assert set(coordinator.store.status_counts(bad_id).items()) >= {("cancelled", 3)}
    summary = coordinator.summary(bad_id)  # the listing still answers for it
    assert summary["done"] == summary["total"] == 3


def test_a_progress_board_that_does_not_answer_holds_up_no_tick_and_is_heard_later(
        hpt_home, ray_cluster):
    """The live-metrics board is a Ray actor; one being restarted (its node lost, or killed by
    Ray's OOM monitor) answers late. Dispatch ticks go on without it meanwhile (they used to
    block 10 s each, and the late answer was dropped), and its answer is used when it comes."""
    import threading
    from types import SimpleNamespace

    from hptransfer.sweeper.dispatch import InFlight
    from hptransfer.sweeper.progress import ProgressBoard

    class GatedBoard(ProgressBoard):  # the real board, answering drains only once opened
        def __init__(self) -> None:
            super().__init__()
            self._gate = threading.Event()

        def open(self) -> None:
            self._gate.set()

        def drain(self):  # noqa: ANN202
            self._gate.wait()
            return super().drain()

    dispatcher = Coordinator(get_settings()).dispatcher
    dispatcher.start(background=False)
    dispatcher.mirror = None
    board = ray.remote(num_cpus=0, max_concurrency=4)(GatedBoard).remote()
    dispatcher._board = board
    try:
        ray.get(board.report.remote("t1", {"step": 7}))  # a worker's report
        dispatcher.in_flight["t1"] = InFlight(
            trial=SimpleNamespace(optuna_trial_number=None), ref=None, cpus=1, gpus=0)
        for _ in range(3):  # unanswered: each tick goes on
            dispatcher._relay_progress()
        assert dispatcher.in_flight["t1"].last_step == 0
        ray.get(board.open.remote())
        wait_for(lambda: dispatcher._relay_progress() or
                 dispatcher.in_flight["t1"].last_step == 7, 30, "the late answer to be used")
    finally:
        ray.kill(board)
