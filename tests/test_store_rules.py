"""Store rules that "a result once trained is never dropped" and "nothing completes twice"
rest on, each pinned against values worked out here: which trials a lease may take, what
a lost or released lease gives back, and what a finished trial's twins and the MLflow
mirror see. Each runs on SQLite, and on PostgreSQL when HPT_TEST_POSTGRES_URL is set."""

from __future__ import annotations

import pytest
from conftest import planned_trials as planned
from sqlalchemy import update
from test_store import new_sweep as sweep_of
from test_store import trial_ids as ids

from hptransfer.store.leasing import MAX_ORPHANED_ATTEMPTS
from hptransfer.store.store import Store, Trial


@pytest.fixture
def store(migrated_store):
    return migrated_store


def new_sweep(store: Store, n: int, prefix: str = "hash", **kw) -> str:
    """A sweep of n distinct trials (test_store's defaults: reused results, 3 attempts)."""
    return sweep_of(store, planned(n, prefix), **kw)


# --------------------------------------------------------------------------- leasing


def test_a_stopped_sweeps_pending_trials_are_never_leased(store):
    # a sweep set stopped/failed directly (not via cancel/fail_sweep) keeps its pending
    # rows; a lease must still leave them alone, or a stopped sweep trains again
    for status in ("stopped", "failed", "cancelled"):
        sid = new_sweep(store, 2, prefix=status)
        store.set_sweep_status(sid, status)
        assert store.lease_pending("c", 10, sweep_id=sid) == []
        assert store.count_trials(sid, status="pending") == 2


def test_a_lease_by_ids_takes_only_the_named_trials(store):
    # the dispatcher leases a pack's members together: the third trial only, though the
    # first two are older in plan order and the limit would allow all three
    sid = new_sweep(store, 3)
    first, second, third = ids(store, sid)
    assert [t.id for t in store.lease_pending("c", 10, ids=[third])] == [third]
    assert store.count_trials(sid, status="pending") == 2


def test_a_later_lease_does_not_restart_a_running_sweeps_clock(store):
    sid = new_sweep(store, 2)
    store.lease_pending("c", 1)
    started = store.get_sweep(sid).started_at
    assert started is not None
    store.lease_pending("c", 1)
    assert store.get_sweep(sid).started_at == started


def test_a_running_trial_with_no_lease_owner_is_an_orphan(store):
    # a running row nobody holds (written before leases, or its owner cleared) would
    # otherwise never run again: requeue_orphans takes it back like a dead owner's
    sid = new_sweep(store, 1)
    (trial,) = store.lease_pending("dead", 1)
    with store.engine.begin() as conn:
        conn.execute(update(Trial).where(Trial.id == trial.id).values(lease_owner=None))
    assert store.requeue_orphans("live") == 1
    assert store.get_trial(trial.id).status == "pending"
    assert store.count_trials(sid, status="running") == 0


def test_expired_only_requeues_the_expired_lease_not_the_live_one(store):
    sid = new_sweep(store, 2)
    (expired,) = store.lease_pending("other", 1, lease_seconds=-1)
    (live,) = store.lease_pending("other", 1, lease_seconds=3600)
    assert store.requeue_orphans("me", expired_only=True) == 1
    assert store.get_trial(expired.id).status == "pending"
    assert store.get_trial(live.id).status == "running"
    assert store.count_trials(sid, status="running") == 1


def test_only_coordinator_deaths_count_toward_the_orphan_limit(store):
    # leases given back unsubmitted are no sign the trial takes its coordinator down:
    # MAX-1 of them and one coordinator death leave it one death short of failing
    sid = new_sweep(store, 1)
    (tid,) = ids(store, sid)
    for _ in range(MAX_ORPHANED_ATTEMPTS - 1):
        store.lease_pending("me", 1)
        assert store.release([tid], "me") == 1
    store.lease_pending("dead", 1)
    assert store.requeue_orphans("live") == 1
    row = store.get_trial(tid)
    assert (row.status, row.attempts) == ("pending", MAX_ORPHANED_ATTEMPTS)


# --------------------------------------------------------------------------- outcomes


def result(loss, status="completed"):
    return {"status": status, "final_val_loss": loss, "steps": 10, "data_hash": "data-1",
            "curve": [{"step": 10, "train_loss": 4.0}]}


def test_a_diverged_result_is_not_handed_to_the_twin_waiting_for_it(store):
    # only a completed result is reused: the twin trains itself next
    sid = store.create_sweep("s", {"name": "s"}, "h", "grid", planned(1) * 2,
                             data_hash="data-1", reuse=True, max_attempts=3)
    first, twin = ids(store, sid)
    assert [t.id for t in store.lease_pending("c", 10)] == [first]
    assert store.finish_trial(first, "diverged", result(None, "diverged"), owner="c")
    row = store.get_trial(twin)
    assert (row.status, row.reused_from, row.result) == ("pending", None, None)
    assert [t.id for t in store.lease_pending("c", 10)] == [twin]


def test_a_completed_trial_without_a_result_hands_its_twin_nothing(store):
    # no result to copy: the twin must not complete empty-handed, it trains itself
    sid = store.create_sweep("s", {"name": "s"}, "h", "grid", planned(1) * 2,
                             data_hash="data-1", reuse=True, max_attempts=3)
    first, twin = ids(store, sid)
    store.lease_pending("c", 10)
    assert store.finish_trial(first, "completed", None, owner="c")
    assert store.get_trial(twin).status == "pending"
    assert store.attempts(twin) == []
    assert [t.id for t in store.lease_pending("c", 10)] == [twin]


def test_requeue_leaves_a_trial_that_is_not_running_as_it_is(store):
    # a late lost-worker report for a cancelled (or failed) trial must not queue it again
    sid = new_sweep(store, 2)
    cancelled, failed = ids(store, sid)
    store.lease_pending("c", 2)
    assert store.mark_cancelled(cancelled)
    assert store.finish_trial(failed, "failed", None, "boom")
    assert store.requeue(cancelled, "WorkerCrashedError") == "cancelled"
    assert store.requeue(failed, "WorkerCrashedError") == "failed"
    assert (store.get_trial(cancelled).status, store.get_trial(failed).error) == (
        "cancelled", "boom")
    assert store.lease_pending("c", 10) == []


def test_the_workers_data_hash_is_what_later_sweeps_reuse_by(store):
    # the sweep planned on data-1, but the worker trained on data-2: the trial is
    # recorded as data-2's, so a data-2 sweep reuses it and a data-1 sweep does not
    sid = new_sweep(store, 1)
    (tid,) = ids(store, sid)
    store.lease_pending("c", 1)
    assert store.finish_trial(tid, "completed", {**result(3.0), "data_hash": "data-2"})
    assert store.get_trial(tid).data_hash == "data-2"
    on_2 = new_sweep(store, 1, data_hash="data-2")
    on_1 = new_sweep(store, 1, data_hash="data-1")
    assert [(t.status, t.reused_from) for t in store.trials(on_2)] == [("completed", tid)]
    assert [t.status for t in store.trials(on_1)] == ["pending"]


def test_an_error_given_with_the_outcome_wins_over_the_results_own(store):
    sid = new_sweep(store, 1)
    (tid,) = ids(store, sid)
    store.lease_pending("c", 1)
    outcome = {"final_val_loss": None, "error": "from the result"}
    assert store.finish_trial(tid, "failed", outcome, error="from the dispatcher")
    row = store.get_trial(tid)
    assert (row.error, row.result["error"]) == ("from the dispatcher", "from the result")


# --------------------------------------------------------------------------- attempts, mirror


def test_only_the_attempt_that_produced_the_result_carries_it(store):
    # MLflow logs each attempt as a run: the lost first attempt must not show the
    # second's metrics, read back after the trial completed
    sid = new_sweep(store, 1)
    (tid,) = ids(store, sid)
    store.lease_pending("c", 1)
    assert store.requeue(tid, "WorkerCrashedError: boom") == "pending"
    store.lease_pending("c", 1)
    assert store.finish_trial(tid, "completed", result(2.0))
    lost, won = store.attempts(tid)
    assert (lost.seq, lost.status, lost.result) == (1, "failed", None)
    assert (won.seq, won.status, won.result["final_val_loss"]) == (2, "completed", 2.0)


def test_attempts_wait_for_their_sweeps_parent_run_before_the_mirror_sees_them(store):
    # an attempt's MLflow run is created under its sweep's parent run: none exists yet
    sid = new_sweep(store, 1)
    (trial,) = store.lease_pending("c", 1)
    assert store.attempts_to_mirror() == []
    store.set_sweep_mlflow(sid, "7", "parent")
    assert [(a.trial_id, a.seq) for a in store.attempts_to_mirror()] == [(trial.id, 1)]


def test_each_attempt_keeps_its_own_mlflow_run(store):
    sid = new_sweep(store, 1)
    (tid,) = ids(store, sid)
    store.set_sweep_mlflow(sid, "7", "parent")
    store.lease_pending("c", 1)
    store.requeue(tid, "WorkerCrashedError: boom")
    store.lease_pending("c", 1)
    store.set_attempt_run(tid, 1, "run-1")
    store.set_attempt_run(tid, 2, "run-2")
    assert [a.mlflow_run_id for a in store.attempts(tid)] == ["run-1", "run-2"]
    assert store.get_trial(tid).mlflow_run_id == "run-2"  # the latest attempt's


def test_a_sweeps_mirror_backlog_counts_only_its_own_attempts(store):
    quiet = new_sweep(store, 1, prefix="quiet")
    busy = new_sweep(store, 1, prefix="busy")
    for sid in (quiet, busy):
        store.set_sweep_mlflow(sid, "7", f"parent-{sid}")
        store.mark_sweep_mirrored(sid, "pending")
    store.lease_pending("c", 1, sweep_id=busy)
    # busy: its status (now running) and its new attempt; quiet: nothing
    assert (store.mirror_backlog(quiet), store.mirror_backlog(busy)) == (0, 2)
    assert store.mirror_backlog() == 2


# --------------------------------------------------------------------------- reuse


def test_a_completed_trial_without_a_result_is_no_donor(store):
    # a later sweep would otherwise "complete" the same work with nothing to show for it
    first = new_sweep(store, 1)
    (tid,) = ids(store, first)
    store.lease_pending("c", 1)
    assert store.finish_trial(tid, "completed", None)
    later = new_sweep(store, 1)
    assert [(t.status, t.reused_from) for t in store.trials(later)] == [("pending", None)]


def test_a_pending_twin_in_another_sweep_is_not_waited_for(store):
    # that sweep may be held back by its own limits: this one trains its copy itself
    held = new_sweep(store, 1, prefix="x")
    mine = store.create_sweep("s", {"name": "s"}, "h", "grid",
                              planned(1, "y") + planned(1, "x"), data_hash="data-1",
                              reuse=True, max_attempts=3)
    assert [t.idx for t in store.lease_pending("c", 10, sweep_id=mine)] == [0, 1]
    assert store.count_trials(held, status="pending") == 1


def test_a_result_settles_only_twins_on_the_same_data(store):
    on_1 = new_sweep(store, 1, data_hash="data-1")
    on_2 = new_sweep(store, 1, data_hash="data-2")
    (tid,) = ids(store, on_1)
    (other,) = ids(store, on_2)
    assert [t.id for t in store.lease_pending("c", 1, sweep_id=on_1)] == [tid]
    assert store.finish_trial(tid, "completed", result(3.0))
    row = store.get_trial(other)
    assert (row.status, row.reused_from, row.result) == ("pending", None, None)
