"""What the service records matches what happened: a sweep whose every trial failed ends
`failed` (saying why), and a trial's `attempts` counts the attempt rows MLflow mirrors, also
after a coordinator restart. On SQLite, and on PostgreSQL when HPT_TEST_POSTGRES_URL is set."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import planned_trials as planned

from hptransfer.store.store import Store


def result(status: str = "completed") -> dict[str, Any]:
    return {"status": status, "final_val_loss": 3.0, "curve": []}


@pytest.fixture
def store(migrated_store):
    return migrated_store


def new_sweep(store: Store, n: int, max_attempts: int = 1, prefix: str = "hash") -> str:
    return store.create_sweep("s", {}, "h", "grid", planned(n, prefix), data_hash="d",
                              max_attempts=max_attempts)


def finish_all(store: Store, sid: str, *outcomes: str) -> None:
    leased = store.lease_pending("me", len(outcomes), sweep_id=sid)
    for trial, status in zip(leased, outcomes, strict=True):
        if status == "failed":
            assert store.requeue(trial.id, "RuntimeError: no such data file\n  more") == "failed"
        else:
            assert store.finish_trial(trial.id, status, result(status))


# ------------------------------------------------------------------- a sweep whose trials failed


def test_a_sweep_whose_every_trial_failed_ends_failed_saying_why(store: Store) -> None:
    sid = new_sweep(store, 3)
    finish_all(store, sid, "failed", "failed", "failed")
    assert store.refresh_sweep_status(sid) == "failed"
    sweep = store.get_sweep(sid)
    assert sweep.status == "failed" and sweep.finished_at is not None
    assert "every trial failed (3)" in sweep.error
    assert "RuntimeError: no such data file" in sweep.error and "more" not in sweep.error
    assert store.refresh_sweep_status(sid) == "failed"  # stays failed


@pytest.mark.parametrize("other", ["completed", "diverged", "pruned"])
def test_one_result_among_failures_completes_the_sweep(store: Store, other: str) -> None:
    """Diverged (an LR past the edge) and pruned trials are results of the sweep: only
    errors everywhere make it failed."""
    sid = new_sweep(store, 3)
    finish_all(store, sid, "failed", other, "failed")
    assert store.refresh_sweep_status(sid) == "completed"
    assert store.get_sweep(sid).error is None


def test_a_sweep_of_diverged_trials_is_completed(store: Store) -> None:
    sid = new_sweep(store, 2)
    finish_all(store, sid, "diverged", "diverged")
    assert store.refresh_sweep_status(sid) == "completed"


def test_a_failed_trial_still_pending_a_retry_keeps_the_sweep_running(store: Store) -> None:
    sid = new_sweep(store, 1, max_attempts=2)
    (trial,) = store.lease_pending("me", 1, sweep_id=sid)
    assert store.requeue(trial.id, "boom") == "pending"
    assert store.refresh_sweep_status(sid) == "running"


# ------------------------------------------------------------------- attempts after a restart


def attempt_rows(store: Store, trial_id: str) -> int:
    return len(store.attempts(trial_id))


def test_attempts_counts_every_attempt_row_across_a_restart(store: Store) -> None:
    """The old coordinator died mid-attempt; the new one re-queues and trains it again:
    the trial shows 2 attempts, as its attempt rows (and MLflow's runs) do."""
    sid = new_sweep(store, 1, max_attempts=2)
    (first,) = store.lease_pending("old-coordinator", 1, sweep_id=sid)
    assert first.attempts == 1 == attempt_rows(store, first.id)
    assert store.requeue_orphans("new-coordinator") == 1  # the restart
    row = store.get_trial(first.id)
    assert row.status == "pending" and row.attempts == 1 == attempt_rows(store, first.id)
    (again,) = store.lease_pending("new-coordinator", 1, sweep_id=sid)
    assert again.attempts == 2 == attempt_rows(store, first.id)
    assert store.finish_trial(again.id, "completed", result())
    row = store.get_trial(first.id)
    assert row.attempts == 2 == attempt_rows(store, first.id)
    assert [a.status for a in store.attempts(first.id)] == ["cancelled", "completed"]


def test_an_interrupted_attempt_is_not_charged_to_the_retries(store: Store) -> None:
    """`attempts` counts it, the retry budget does not: with one retry, a trial orphaned
    once and then failing once is retried, and fails for good on its second failure."""
    sid = new_sweep(store, 1, max_attempts=2)
    (trial,) = store.lease_pending("old", 1, sweep_id=sid)
    store.requeue_orphans("new")
    store.lease_pending("new", 1, sweep_id=sid)
    assert store.requeue(trial.id, "boom", owner="new") == "pending"
    store.lease_pending("new", 1, sweep_id=sid)
    assert store.requeue(trial.id, "boom", owner="new") == "failed"
    assert store.get_trial(trial.id).attempts == 3 == attempt_rows(store, trial.id)


def test_a_never_submitted_attempt_is_counted_not_charged(store: Store) -> None:
    sid = new_sweep(store, 1, max_attempts=1)
    (trial,) = store.lease_pending("me", 1, sweep_id=sid)
    assert store.release([trial.id], "me") == 1
    (again,) = store.lease_pending("me", 1, sweep_id=sid)
    assert again.attempts == 2 == attempt_rows(store, trial.id)
    assert store.requeue(trial.id, "boom", owner="me") == "failed"  # its one charged attempt


def test_a_reused_trial_counts_its_one_attempt(store: Store) -> None:
    first = new_sweep(store, 1)
    finish_all(store, first, "completed")
    second = new_sweep(store, 1)
    (reused,) = store.trials(second)
    assert reused.reused and reused.attempts == 1 == attempt_rows(store, reused.id)


# ----------------------------------------------------------- /health on a read-only database


def test_the_database_check_fails_on_a_read_only_sqlite_file(tmp_path: Path) -> None:
    from hptransfer.coordinator.health import check_database

    path = tmp_path / "hpt.db"
    with Store(f"sqlite:///{path}") as st:
        st.migrate()
    assert check_database(f"sqlite:///{path}").ok
    # read-only as a remount or a file the server may not write makes it (root ignores modes)
    check = check_database(f"sqlite:///file:{path}?mode=ro&uri=true")
    assert not check.ok and "cannot be written" in check.detail
    assert "readonly" in check.detail and "writable" in check.fix


@pytest.mark.postgres
def test_the_database_check_fails_on_a_read_only_postgresql(postgres_schema_url: str) -> None:
    from sqlalchemy.engine import make_url

    from hptransfer.coordinator.health import check_database

    with Store(postgres_schema_url) as st:
        st.migrate()
    assert check_database(postgres_schema_url).ok
    url = make_url(postgres_schema_url)
    options = f"{url.query['options']} -cdefault_transaction_read_only=on"
    read_only = url.update_query_dict({"options": options}).render_as_string(
        hide_password=False)
    check = check_database(read_only)
    assert not check.ok and "cannot be written" in check.detail
    assert "read-only transaction" in check.detail
