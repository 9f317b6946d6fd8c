"""Store tests: every test runs on SQLite, and again on PostgreSQL when
HPT_TEST_POSTGRES_URL is set (`.ci/run` starts a server; locally: scripts/postgres_up.sh)."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import FrozenInstanceError, fields, replace
from datetime import UTC
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from conftest import PlannedTrial as Planned
from sqlalchemy import func, inspect, select, update
from sqlalchemy.exc import IntegrityError

from hptransfer.config import SettingsError, get_settings
from hptransfer.spec.trial import TrialResult, TrialSpec
from hptransfer.store.store import (
    NOT_STARTED,
    RESULT_FRAME_COLUMNS,
    Base,
    NotFoundError,
    Store,
    StoreError,
    Sweep,
    Trial,
    normalize_url,
)

PRESET = {"sp": "sp", "mup": "mup", "completep": "completep"}


def plan(
    arms: tuple[str, ...] = ("sp", "completep"),
    widths: tuple[int, ...] = (64, 128),
    depths: tuple[int, ...] = (1, 2),
    lrs: tuple[float, ...] = (0.01,),
    seeds: tuple[int, ...] = (0,),
) -> list[Planned]:
    out = []
    for arm in arms:
        for width in widths:
            for depth in depths:
                for lr in lrs:
                    for seed in seeds:
                        spec = TrialSpec(
                            parameterization=PRESET[arm], width=width, depth=depth, lr=lr,
                            seed=seed, head_dim=32,
                        )
                        out.append(
                            Planned(arm, spec, width, depth, lr, spec.sigma_base, seed,
                                    spec.content_hash())
                        )
    return out


def result(loss: float, data_hash: str = "data-1", status: str = "completed") -> dict[str, Any]:
    return TrialResult(
        status=status, final_val_loss=loss, final_train_loss=loss + 0.1, steps=10,
        tokens=20480, flops=1.5e12, params_embedding=16384, params_non_embedding=98304,
        wall_time_s=3.5, data_hash=data_hash,
        curve=[{"step": 0, "train_loss": 5.5}, {"step": 10, "train_loss": loss}],
    ).model_dump(mode="json")


def new_sweep(store: Store, items: list[Planned], **kw: Any) -> str:
    args: dict[str, Any] = {
        "name": "s", "spec": {"name": "s"}, "spec_hash": "h", "search": "grid",
        "planned": items, "data_hash": "data-1", "reuse": True, "max_attempts": 3,
    }
    args.update(kw)
    return store.create_sweep(**args)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def store(migrated_store: Store) -> Store:
    return migrated_store


def trial_ids(store: Store, sweep_id: str, **filters: Any) -> list[str]:
    return [t.id for t in store.trials(sweep_id, limit=None, **filters)]


# --------------------------------------------------------------------------- schema


def test_migrate_twice_is_a_noop_and_matches_models(store: Store) -> None:
    assert store.schema_revision() == Store.head_revision() is not None
    sid = new_sweep(store, plan()[:2])
    store.migrate()
    assert store.schema_revision() == Store.head_revision()
    assert store.get_sweep(sid) is not None and store.count_trials(sid) == 2
    with store.engine.connect() as conn:
        assert {"sweeps", "trials", "alembic_version"} <= set(inspect(conn).get_table_names())
        # the hand-written revision and the ORM models describe the same schema
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []


def test_sqlite_engine_settings(tmp_path: Path) -> None:
    st = Store(f"sqlite:///{tmp_path / 'a' / 'b' / 'hpt.db'}")
    try:
        assert st.url_safe.endswith("hpt.db") and st.dialect == "sqlite"
        assert (tmp_path / "a" / "b").is_dir()
        with st.engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    finally:
        st.close()


def test_postgres_urls_get_the_psycopg_driver() -> None:
    for raw in ("postgresql://u:p@h:5432/d", "postgres://u:p@h/d"):
        assert normalize_url(raw).drivername == "postgresql+psycopg"
    assert normalize_url("postgresql+psycopg://u@h/d").drivername == "postgresql+psycopg"
    assert normalize_url("sqlite:///x.db").drivername == "sqlite"
    st = Store("postgresql://hpt:secret@127.0.0.1:1/nowhere")  # no connection until used
    assert st.url_safe == "postgresql+psycopg://hpt:***@127.0.0.1:1/nowhere"
    assert "secret" not in repr(st)
    st.close()


# --------------------------------------------------------------------------- create


def test_create_sweep_writes_sweep_and_trials(store: Store) -> None:
    items = plan()
    sid = new_sweep(store, items, name="grid-1", spec={"name": "grid-1", "k": [1, 2]})
    sweep = store.get_sweep(sid)
    assert sweep is not None
    assert sweep.name == "grid-1" and sweep.spec == {"name": "grid-1", "k": [1, 2]}
    assert sweep.status == "pending" and sweep.n_trials == len(items)
    assert sweep.search == "grid" and sweep.created_at.tzinfo is not None
    assert sweep.counts["pending"] == len(items) and sweep.counts["completed"] == 0
    rows = store.trials(sid)
    assert [t.idx for t in rows] == list(range(len(items)))
    for row, item in zip(rows, items, strict=True):
        assert (row.arm, row.width, row.depth) == (item.arm, item.width, item.depth)
        assert row.content_hash == item.content_hash and row.data_hash == "data-1"
        assert (row.attempts, row.max_attempts, row.reused) == (0, 3, False)
        # the stored spec round-trips to the same experiment
        assert TrialSpec.model_validate(row.spec).content_hash() == item.content_hash
    assert store.get_trial(rows[0].id) == rows[0]
    assert store.get_sweep("nope") is None and store.get_trial("nope") is None


def test_the_largest_seed_a_spec_takes_is_stored_on_every_backend(store: Store) -> None:
    # a seed the spec accepts but PostgreSQL's INTEGER cannot hold failed the insert (a
    # study adding seeds past it failed every dispatcher tick)
    from hptransfer.spec.trial import MAX_SEED

    items = plan(arms=("sp",), widths=(64,), depths=(1,), seeds=(0, MAX_SEED))
    sid = new_sweep(store, items)
    assert sorted(t.seed for t in store.trials(sid)) == [0, MAX_SEED]


def test_records_are_frozen_snapshots_of_every_column(store: Store) -> None:
    """The records carry every column of their table, in table order (so a new column cannot
    be forgotten), are read-only, and serialise to the same keys."""
    sid = new_sweep(store, plan())
    sweep, trial = store.get_sweep(sid), store.trials(sid)[0]
    for record, table, extra in ((sweep, Sweep, ["counts"]), (trial, Trial, [])):
        columns = [a.key for a in inspect(table).column_attrs]
        assert [f.name for f in fields(record)] == columns + extra
        with pytest.raises(FrozenInstanceError):
            record.status = "completed"  # type: ignore[misc]
    assert list(trial.to_dict()) == [*columns, "reused"] and trial.to_dict()["reused"] is False
    assert sweep.to_dict()["counts"] == sweep.counts and sweep.to_dict()["spec"] == sweep.spec


def test_create_sweep_is_atomic(store: Store) -> None:
    items = plan()
    bad = replace(items[2], content_hash=None)  # NOT NULL violation in the database
    with pytest.raises(IntegrityError):
        new_sweep(store, [*items[:2], bad, *items[3:]])
    with pytest.raises(AttributeError):  # a malformed item half-way through the plan
        new_sweep(store, [items[0], object(), items[1]])  # type: ignore[list-item]
    assert store.list_sweeps() == []
    with store.engine.connect() as conn:
        assert conn.scalar(select(func.count()).select_from(Trial)) == 0
    new_sweep(store, items)  # the database is still usable
    assert len(store.list_sweeps()) == 1


def test_reuse_copies_completed_results(store: Store) -> None:
    items = plan()[:3]
    first = new_sweep(store, items)
    leased = store.lease_pending("c", 10)
    t0, t1, _ = (t.id for t in leased)
    assert store.finish_trial(t0, "completed", result(3.25), worker_node="n1")
    assert store.finish_trial(t1, "diverged", result(float("nan"), status="diverged"))

    second = new_sweep(store, items)
    rows = store.trials(second)
    assert rows[0].status == "completed" and rows[0].reused_from == t0
    assert rows[0].reused and rows[0].final_val_loss == 3.25
    assert rows[0].result == store.get_trial(t0).result
    assert rows[0].tokens == 20480 and rows[0].worker_node == "n1"
    assert [r.status for r in rows[1:]] == ["pending", "pending"]  # only completed reuse
    assert store.get_sweep(second).status == "pending"

    # a copy of a copy points at the trial that actually ran
    third = new_sweep(store, items[:1])
    (row,) = store.trials(third)
    assert row.reused_from == t0
    assert store.get_sweep(third).status == "completed"

    # other data, or reuse off: nothing is reused
    for kw in ({"data_hash": "data-2"}, {"reuse": False}, {"data_hash": None}):
        sid = new_sweep(store, items[:1], **kw)
        assert store.trials(sid)[0].status == "pending"
    frame = store.results_frame(second)
    assert frame["reused"].tolist() == [True, False, False]
    assert first != second



def test_a_trial_planned_twice_trains_once_and_both_rows_get_the_result(store: Store) -> None:
    # a study's ladder and aspect-ratio stages can plan one shape at one budget: one trial
    # trains, its twin waits (not leased, not in a pack) and takes the result when it completes
    items = plan()[:2]
    sid = new_sweep(store, [items[0], items[1], items[0]])
    first, other, twin = trial_ids(store, sid)
    assert [t.id for t in store.leasable(sid, 10)] == [first, other]
    assert [t.id for t in store.lease_pending("c", 10)] == [first, other]
    assert store.lease_pending("c", 10) == [] and store.leasable(sid, 10) == []
    assert store.get_trial(twin).status == "pending"
    assert store.finish_trial(first, "completed", result(3.25), worker_node="n1", owner="c")
    row = store.get_trial(twin)
    assert (row.status, row.reused_from, row.worker_node) == ("completed", first, "n1")
    assert row.result == store.get_trial(first).result and row.final_val_loss == 3.25
    (attempt,) = store.attempts(twin)  # MLflow mirrors it as a run, tagged reused_from
    assert (attempt.seq, attempt.status, attempt.result is not None) == (1, "completed", True)
    assert store.finish_trial(other, "completed", result(3.5), owner="c")
    assert store.refresh_sweep_status(sid) == "completed"


def test_a_twin_trains_itself_when_its_first_fails_for_good(store: Store) -> None:
    items = plan()[:1]
    sid = new_sweep(store, [items[0], items[0]], max_attempts=2)
    first, twin = trial_ids(store, sid)
    for attempt in (1, 2):  # retried: the twin still waits
        (leased,) = store.lease_pending("c", 10)
        assert leased.id == first and leased.attempts == attempt
        store.requeue(first, "WorkerCrashedError: boom", owner="c")
    assert store.get_trial(first).status == "failed"
    (leased,) = store.lease_pending("c", 10)
    assert leased.id == twin
    # a failure or divergence is no result to hand over: nothing is copied
    assert store.finish_trial(twin, "diverged", result(float("nan"), status="diverged"))
    assert store.get_trial(first).status == "failed"


def test_twins_wait_only_where_the_sweep_reuses_results(store: Store) -> None:
    items = plan()[:1]
    for kw in ({"reuse": False}, {"data_hash": None}):
        sid = new_sweep(store, [items[0], items[0]], **kw)
        assert len(store.lease_pending("c", 10, sweep_id=sid)) == 2
    # Optuna's asks are each told their own outcome: an asked twin is leased as asked
    sid = new_sweep(store, [], search="optuna")
    for n in (0, 1):
        store.add_trial(sid, items[0], optuna_trial_number=n)
    assert len(store.lease_pending("c", 10, sweep_id=sid)) == 2


# --------------------------------------------------------------------------- leasing


def test_lease_order_and_sweep_filter(store: Store) -> None:
    a = new_sweep(store, plan()[:3])
    b = new_sweep(store, plan()[:3], data_hash="other")
    assert store.lease_pending("c", 0) == []
    got = store.lease_pending("c", 4)
    assert [(t.sweep_id, t.idx) for t in got] == [(a, 0), (a, 1), (a, 2), (b, 0)]
    for t in got:
        assert t.status == "running" and t.attempts == 1 and t.lease_owner == "c"
        assert t.started_at.tzinfo == UTC and t.lease_expires_at > t.started_at
    assert store.get_sweep(a).status == "running"
    assert store.get_sweep(a).started_at is not None
    c = new_sweep(store, plan()[:2], data_hash="third")
    assert [t.idx for t in store.lease_pending("c", 5, sweep_id=c)] == [0, 1]
    assert [(t.sweep_id, t.idx) for t in store.lease_pending("c", 9)] == [(b, 1), (b, 2)]
    assert store.lease_pending("c", 9) == []


def test_lease_is_exclusive_under_concurrency(
    store: Store, open_store: Callable[[], Store]
) -> None:
    items = plan(lrs=(0.01, 0.02, 0.04, 0.08, 0.16), seeds=(0, 1, 2))  # 120 trials
    sid = new_sweep(store, items)
    coordinators = [open_store(), open_store()]  # two processes' worth of engines
    n_threads = 4
    barrier = threading.Barrier(n_threads)
    leased: list[list[str]] = [[] for _ in range(n_threads)]
    errors: list[BaseException] = []

    def run(k: int) -> None:
        st, owner = coordinators[k % 2], f"coordinator-{k % 2}"
        try:
            barrier.wait()
            while batch := st.lease_pending(owner, 3):
                leased[k].extend(t.id for t in batch)
        except BaseException as exc:  # surfaced in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    everything = [i for ids in leased for i in ids]
    assert len(everything) == len(set(everything)) == len(items)
    assert store.count_trials(sid, status="running") == len(items)
    assert {t.attempts for t in store.trials(sid, limit=None)} == {1}
    owners = {t.lease_owner for t in store.trials(sid, limit=None)}
    assert owners <= {"coordinator-0", "coordinator-1"}


def test_finish_trial_never_overwrites(store: Store) -> None:
    sid = new_sweep(store, plan()[:3])
    t0, t1, t2 = trial_ids(store, sid)
    assert not store.finish_trial(t0, "completed", result(3.0))  # still pending
    store.lease_pending("c", 3)
    assert not store.finish_trial(t0, "completed", result(3.0), owner="someone-else")
    assert store.finish_trial(t0, "completed", TrialResult(**result(3.0)), worker_node="n")
    assert not store.finish_trial(t0, "failed", None, "late error")
    assert store.mark_cancelled(t0) is False
    row = store.get_trial(t0)
    assert row is not None and row.status == "completed" and row.error is None
    assert row.final_val_loss == 3.0 and row.result["steps"] == 10
    assert row.finished_at >= row.started_at and row.lease_expires_at is None
    assert (row.flops, row.params_non_embedding) == (1.5e12, 98304)

    # NaN / inf anywhere in a result are stored as null (PostgreSQL json rejects them)
    bad = result(float("nan"), status="diverged")
    bad["curve"].append({"step": 11, "train_loss": float("inf")})
    assert store.finish_trial(t1, "diverged", bad, owner="c")
    row = store.get_trial(t1)
    assert row is not None and row.final_val_loss is None
    assert row.result["final_val_loss"] is None
    assert row.result["curve"][-1]["train_loss"] is None

    assert store.finish_trial(t2, "failed", None, "Traceback: boom")
    assert store.get_trial(t2).error == "Traceback: boom"
    with pytest.raises(ValueError):
        store.finish_trial(t2, "running", None, None)


def test_requeue_until_max_attempts(store: Store) -> None:
    sid = new_sweep(store, plan()[:1], max_attempts=2)
    (tid,) = trial_ids(store, sid)
    assert store.requeue(tid, "not running") == "pending"  # a no-op on a pending trial
    store.lease_pending("c", 1)
    assert store.requeue(tid, "worker died") == "pending"
    row = store.get_trial(tid)
    assert row is not None and row.attempts == 1 and row.error == "worker died"
    assert row.lease_owner is None and row.started_at is None
    (again,) = store.lease_pending("c", 1)
    assert again.attempts == 2
    assert store.requeue(tid, "worker died again") == "failed"
    row = store.get_trial(tid)
    assert row is not None and row.status == "failed" and row.finished_at is not None
    assert row.error == "worker died again"
    assert store.lease_pending("c", 1) == []
    assert store.requeue(tid, "ignored") == "failed"
    with pytest.raises(NotFoundError):
        store.requeue("missing", "x")


def test_a_lost_attempt_in_a_stopped_sweep_is_cancelled_not_requeued(store: Store) -> None:
    """A worker lost after its sweep was cancelled (a force-cancel Ray reports as a crash)
    or failed: the trial ends cancelled, the attempt failed with the loss, and nothing is
    left pending where no lease would ever take it."""
    for stop in ("cancel", "fail"):
        sid = new_sweep(store, plan()[:2], max_attempts=3)
        leased = [t.id for t in store.lease_pending("c", 2, sweep_id=sid)]
        if stop == "cancel":
            assert store.cancel_sweep(sid) == leased
        else:
            store.fail_sweep(sid, "spec no longer validates")
        assert store.requeue(leased[0], "WorkerCrashedError: boom") == "cancelled"
        row = store.get_trial(leased[0])
        assert row.status == "cancelled" and row.finished_at is not None
        assert row.lease_owner is None and row.error == "WorkerCrashedError: boom"
        (attempt,) = store.attempts(leased[0])
        assert attempt.status == "failed" and attempt.error == "WorkerCrashedError: boom"
        assert store.lease_pending("c", 10, sweep_id=sid) == []
        store.mark_cancelled(leased[1])
        counts = store.status_counts(sid)
        assert counts["cancelled"] == 2 == sum(counts.values())


@pytest.mark.parametrize("outcome", ["release", "requeue"])
def test_a_lease_given_back_during_a_cancel_waits_for_it(
    store: Store, open_store: Callable[[], Store], outcome: str
) -> None:
    """A cancel holds its sweep's row from its first statement to its commit; a lease given
    back meanwhile (released unsubmitted, or requeued after a lost worker) waits for it and
    then sees the sweep stopped, rather than reading it before the commit and leaving the
    trial pending in a cancelled sweep (PostgreSQL runs each statement on what is committed
    when it starts)."""
    sid = new_sweep(store, plan()[:1])
    (tid,) = [t.id for t in store.lease_pending("me", 1, sweep_id=sid)]
    cancelling = open_store().engine.connect()
    tx = cancelling.begin()
    cancelling.execute(update(Sweep).where(Sweep.id == sid)
                       .values(status="cancelled"))  # locks the row until the commit
    done: list[object] = []

    def give_back() -> None:
        try:
            done.append(store.release([tid], "me") if outcome == "release"
                        else store.requeue(tid, "WorkerCrashedError: boom"))
        except BaseException as exc:  # surfaced below
            done.append(exc)

    worker = threading.Thread(target=give_back)
    worker.start()
    worker.join(timeout=1.0)
    waited = worker.is_alive()
    tx.commit()
    cancelling.close()
    worker.join(timeout=60)
    assert waited, f"{outcome} did not wait for the cancel in progress: {done}"
    assert done == [0 if outcome == "release" else "cancelled"]
    assert store.get_trial(tid).status == "cancelled"


def test_requeue_orphans(store: Store) -> None:
    sid = new_sweep(store, plan()[:4])
    dead = [t.id for t in store.lease_pending("dead", 2)]
    (mine,) = [t.id for t in store.lease_pending("live", 1)]
    assert store.requeue_orphans("live") == 2
    for tid in dead:
        row = store.get_trial(tid)
        # the interrupted attempt is one of its attempts (not charged to its retries)
        assert row is not None and row.status == "pending" and row.attempts == 1
        assert row.lease_owner is None and row.lease_expires_at is None
    assert store.get_trial(mine).status == "running"
    assert store.requeue_orphans("live") == 0

    # several live coordinators: only expired leases are taken over
    store.lease_pending("other", 1, lease_seconds=-1)  # already expired
    store.lease_pending("other", 1, lease_seconds=3600)
    assert store.requeue_orphans("live", expired_only=True) == 1
    assert store.count_trials(sid, status="running") == 2

    # orphans of a cancelled sweep are cancelled, not requeued
    store.cancel_sweep(sid)
    assert store.requeue_orphans("live") == 0
    assert store.count_trials(sid, status="cancelled") == 3
    assert store.get_trial(mine).status == "running"


def test_a_superseded_leases_late_outcome_touches_nothing(store: Store) -> None:
    """Coordinator B took over A's trial (A's lease looked dead) and trains it again; A's
    result, lost worker or cancel arriving late must not end B's attempt."""
    new_sweep(store, plan()[:1])
    (a,) = store.lease_pending("A", 1)
    assert store.requeue_orphans("B") == 1
    (b,) = store.lease_pending("B", 1)
    assert a.id == b.id
    late = {"final_val_loss": 3.0, "curve": [{"step": 1, "train_loss": 4.0}]}
    assert not store.finish_trial(a.id, "completed", late, owner="A")
    assert store.requeue(a.id, "WorkerCrashedError", owner="A") == "running"
    assert not store.mark_cancelled(a.id, owner="A")
    row = store.get_trial(a.id)
    assert (row.status, row.lease_owner, row.result) == ("running", "B", None)
    assert [x.status for x in store.attempts(a.id)] == ["cancelled", "running"]
    assert store.finish_trial(b.id, "completed", {"final_val_loss": 2.5}, owner="B")
    assert [x.status for x in store.attempts(a.id)] == ["cancelled", "completed"]
    assert store.get_trial(a.id).final_val_loss == 2.5

def test_no_password_in_a_stored_error(store: Store) -> None:
    """A worker's traceback or a lost task's error may quote a URL with its password; the
    API, dashboards and MLflow show what the store holds."""
    sid = new_sweep(store, plan()[:3])
    a, b, c = store.lease_pending("me", 3)
    leak = "OperationalError: could not connect to postgresql://hpt:S3CRET@db:5432/x"
    assert store.finish_trial(a.id, "failed", {"final_val_loss": None, "error": leak})
    assert store.finish_trial(b.id, "failed", None, error=leak)
    store.requeue(c.id, leak)
    store.fail_sweep(sid, leak)
    texts = [store.get_trial(a.id).error, store.get_trial(a.id).result["error"],
             store.get_trial(b.id).error, store.get_trial(c.id).error,
             store.get_sweep(sid).error, *(x.error for t in (a, b, c)
                                           for x in store.attempts(t.id))]
    assert all("S3CRET" not in t for t in texts if t), texts
    assert "postgresql://hpt:***@db:5432/x" in store.get_trial(b.id).error

def test_a_trial_orphaned_again_and_again_fails_rather_than_loop(store: Store) -> None:
    """A trial that takes its coordinator down (a host out of memory) would otherwise be
    re-queued, and take it down, for good."""
    from hptransfer.store.store import MAX_ORPHANED_ATTEMPTS, ORPHANED

    sid = new_sweep(store, plan()[:2])
    for n in range(1, MAX_ORPHANED_ATTEMPTS + 1):
        (trial,) = store.lease_pending(f"dead-{n}", 1)
        assert trial.attempts == n  # every attempt counts (the interrupted ones uncharged)
        requeued = store.requeue_orphans("live")
        row = store.get_trial(trial.id)
        if n < MAX_ORPHANED_ATTEMPTS:
            assert requeued == 1 and row.status == "pending" and row.attempts == n
    assert requeued == 0 and row.status == "failed" and row.finished_at is not None
    assert f"died during {MAX_ORPHANED_ATTEMPTS} of its attempts" in row.error
    assert row.lease_owner is None
    attempts = store.attempts(trial.id)
    assert [(a.status, a.error) for a in attempts] == [("cancelled", ORPHANED)] * n
    # the other trial, never orphaned, is untouched and leases next
    (other,) = store.lease_pending("live", 1)
    assert other.id != trial.id and store.count_trials(sid, status="pending") == 0


def test_release_returns_only_its_owners_named_leases_uncounted(store: Store) -> None:
    """A lease whose task was never submitted: back to pending, the attempt cancelled with
    the reason and not counted; another owner's lease, or a trial not named, is untouched."""
    sid = new_sweep(store, plan()[:4])
    mine = [t.id for t in store.lease_pending("me", 2)]
    (theirs,) = [t.id for t in store.lease_pending("other", 1)]
    assert store.release([*mine, theirs], "me") == 2
    for tid in mine:
        row = store.get_trial(tid)
        assert row.status == "pending" and row.attempts == 1 and row.lease_owner is None
        (attempt,) = store.attempts(tid)
        assert attempt.status == "cancelled" and attempt.error == NOT_STARTED
    assert store.get_trial(theirs).status == "running"
    assert store.release(mine, "me") == 0  # not running any more
    # leased again: its second attempt (the first was not charged to its retries)
    again = store.lease_pending("me", 1, ids=[mine[0]])
    assert [t.attempts for t in again] == [2]
    assert [a.seq for a in store.attempts(mine[0])] == [1, 2]
    # a stopped sweep's released lease ends cancelled, not pending
    store.cancel_sweep(sid)
    assert store.release([mine[0]], "me") == 0
    assert store.get_trial(mine[0]).status == "cancelled"


# --------------------------------------------------------------------------- cancel, status


def test_cancel_sweep(store: Store) -> None:
    sid = new_sweep(store, plan()[:5])
    running = [t.id for t in store.lease_pending("c", 2)]
    assert store.cancel_sweep(sid) == running
    sweep = store.get_sweep(sid)
    assert sweep is not None and sweep.status == "cancelled"
    assert sweep.finished_at is not None
    assert sweep.counts["cancelled"] == 3 and sweep.counts["running"] == 2
    assert store.lease_pending("c", 10) == []
    assert store.mark_cancelled(running[0])
    assert not store.mark_cancelled(running[0])
    assert not store.finish_trial(running[0], "completed", result(3.0))
    assert store.get_trial(running[0]).status == "cancelled"
    assert store.refresh_sweep_status(sid) == "cancelled"
    with pytest.raises(StoreError):
        store.add_trial(sid, plan()[0])
    with pytest.raises(NotFoundError):
        store.cancel_sweep("missing")


def test_active_sweeps_oldest_first(store: Store) -> None:
    first = new_sweep(store, plan()[:2])
    second = new_sweep(store, plan()[:2])
    third = new_sweep(store, plan()[2:4])  # other trials: not completed by first's results
    store.cancel_sweep(second)
    assert [s.id for s in store.active_sweeps()] == [first, third]
    for t in store.lease_pending("c", 10, sweep_id=first):
        store.finish_trial(t.id, "completed", result(3.0))
    store.refresh_sweep_status(first)
    assert [s.id for s in store.active_sweeps()] == [third]


def test_sweep_status_transitions_and_mlflow_ids(store: Store) -> None:
    sid = new_sweep(store, plan()[:2])
    assert store.refresh_sweep_status(sid) == "running"
    for t in store.lease_pending("c", 2):
        store.finish_trial(t.id, "completed", result(3.0))
    assert store.refresh_sweep_status(sid) == "completed"
    sweep = store.get_sweep(sid)
    assert sweep is not None and sweep.finished_at is not None
    store.set_sweep_status(sid, "failed", error="MLflow unreachable")
    sweep = store.get_sweep(sid)
    assert sweep is not None and sweep.status == "failed"
    assert sweep.error == "MLflow unreachable"
    assert store.refresh_sweep_status(sid) == "failed"
    with pytest.raises(ValueError):
        store.set_sweep_status(sid, "bogus")
    with pytest.raises(NotFoundError):
        store.set_sweep_status("missing", "running")

    store.set_sweep_mlflow(sid, "7", "parent-run")
    store.set_sweep_mlflow(sid, run_id="parent-run-2")  # None leaves the experiment alone
    sweep = store.get_sweep(sid)
    assert sweep is not None
    assert (sweep.mlflow_experiment_id, sweep.mlflow_run_id) == ("7", "parent-run-2")


def test_every_lease_is_an_attempt_the_mirror_tracks(store: Store) -> None:
    sid = new_sweep(store, plan()[:2], max_attempts=3)
    assert store.mirror_backlog(sid) == 1  # the sweep: no parent run yet
    store.set_sweep_mlflow(sid, "7", "parent")
    store.mark_sweep_mirrored(sid, "pending")
    assert store.mirror_backlog(sid) == 0 and store.attempts_to_mirror() == []
    a, b = store.lease_pending("c1", 2)
    assert store.mirror_backlog(sid) == 3  # the sweep is running now; two new attempts
    (first,) = store.attempts(a.id)
    assert (first.seq, first.status, first.mlflow_run_id) == (1, "running", None)
    assert first.started_at == a.started_at and first.parent_run_id == "parent"
    store.set_attempt_run(a.id, 1, "run-a1")
    store.mark_attempt_mirrored(a.id, 1, "running")
    assert store.get_trial(a.id).mlflow_run_id == "run-a1"
    # a lost worker ends the attempt failed; the next lease is attempt 2 with its own run
    assert store.requeue(a.id, "WorkerCrashedError: boom") == "pending"
    (again,) = store.lease_pending("c1", 1)
    one, two = store.attempts(a.id)
    assert (one.status, one.error, two.seq, two.status) == (
        "failed", "WorkerCrashedError: boom", 2, "running")
    store.finish_trial(a.id, "completed", result(2.0))
    two = store.attempts(a.id)[1]
    assert two.status == "completed" and two.result is not None and one.result is None
    store.set_attempt_run(a.id, 1, "run-a1")  # an older attempt's run is not the trial's
    store.set_attempt_run(a.id, 2, "run-a2")
    store.set_attempt_run(a.id, 1, "run-a1")
    assert store.get_trial(a.id).mlflow_run_id == "run-a2"
    # a dead coordinator's attempt ends cancelled with the reason; re-leasing makes attempt 2
    assert store.requeue_orphans("c2") == 1
    (lost,) = store.attempts(b.id)
    assert lost.status == "cancelled" and "coordinator died" in (lost.error or "")
    pending = {(x.trial_id, x.seq) for x in store.attempts_to_mirror()}
    assert pending == {(a.id, 1), (a.id, 2), (b.id, 1)}
    for x in store.attempts_to_mirror():
        store.mark_attempt_mirrored(x.trial_id, x.seq, x.status)
    assert store.attempts_to_mirror() == []


def test_add_trial_for_optuna(store: Store) -> None:
    sid = new_sweep(store, [], search="optuna")
    sweep = store.get_sweep(sid)
    assert sweep is not None and sweep.n_trials == 0 and sweep.status == "pending"
    items = plan()[:3]
    ids = [store.add_trial(sid, item, optuna_trial_number=n) for n, item in enumerate(items)]
    rows = store.trials(sid)
    assert [r.id for r in rows] == ids and [r.idx for r in rows] == [0, 1, 2]
    assert [r.optuna_trial_number for r in rows] == [0, 1, 2]
    assert store.get_sweep(sid).n_trials == 3
    for t in store.lease_pending("c", 3):
        store.finish_trial(t.id, "completed", result(3.0))
    assert store.refresh_sweep_status(sid) == "completed"
    # the same point asked again is answered from the store; a new one reopens the sweep
    reused = store.get_trial(store.add_trial(sid, items[0], optuna_trial_number=3))
    assert reused is not None and reused.status == "completed" and reused.reused
    assert store.get_sweep(sid).status == "completed"
    store.add_trial(sid, plan(widths=(256,))[0], optuna_trial_number=4)
    assert store.get_sweep(sid).status == "running"
    with pytest.raises(NotFoundError):
        store.add_trial("missing", items[0])


# --------------------------------------------------------------------------- reading


def test_a_filter_that_is_not_a_trial_filter_is_refused_not_ignored(store: Store) -> None:
    """The store takes TrialFilters' fields and nothing else: a misspelt filter that was
    dropped would list every trial."""
    sid = new_sweep(store, plan())
    for read in (store.trials, store.count_trials):
        with pytest.raises(TypeError, match="widht"):
            read(sid, widht=64)


def test_filters_and_pagination(store: Store) -> None:
    items = plan(lrs=(0.01, 0.02, 0.04))  # 2 arms x 2 widths x 2 depths x 3 lrs = 24
    sid = new_sweep(store, items)
    store.lease_pending("c", 5)
    assert store.count_trials(sid) == 24
    cases: list[dict[str, Any]] = [
        {"arm": "sp"}, {"width": 64}, {"depth": 2}, {"arm": "sp", "depth": 2, "width": 128},
        {"status": "running"}, {"status": ["pending", "running"]}, {"status": "completed"},
        {"seed": 0, "sigma_base": items[0].sigma_base, "arm": "sp"}, {"seed": 1},
    ]
    expected = [12, 12, 12, 3, 5, 24, 0, 12, 0]
    for filters, n in zip(cases, expected, strict=True):
        rows = store.trials(sid, limit=None, **filters)
        assert len(rows) == n == store.count_trials(sid, **filters), filters
        for key in ("arm", "width", "depth", "seed", "sigma_base"):
            if key in filters and rows:
                assert {getattr(r, key) for r in rows} == {filters[key]}
    pages = [store.trials(sid, arm="completep", limit=5, offset=o) for o in range(0, 15, 5)]
    assert [len(p) for p in pages] == [5, 5, 2]
    flat = [r.idx for p in pages for r in p]
    assert flat == sorted(flat) and len(set(flat)) == 12
    assert flat == [r.idx for r in store.trials(sid, arm="completep")]
    assert store.trials("missing") == [] and store.count_trials("missing") == 0

    others = [new_sweep(store, items[:1], data_hash=f"d{k}") for k in range(3)]
    listed = store.list_sweeps(limit=2) + store.list_sweeps(limit=2, offset=2)
    assert {s.id for s in listed} == {sid, *others} and len(listed) == 4
    created = [s.created_at for s in listed]
    assert created == sorted(created, reverse=True)  # newest first
    assert listed[-1].id == sid and listed[-1].counts["running"] == 5
    assert [s.id for s in store.list_sweeps(status="running")] == [sid]
    counts = store.status_counts(sid)
    assert counts["running"] == 5 and counts["pending"] == 19 and sum(counts.values()) == 24


def test_results_frame(store: Store) -> None:
    items = plan(arms=("sp", "mup"), widths=(64,), depths=(1, 2))
    sid = new_sweep(store, items)
    a, b, c, _ = store.lease_pending("c", 4)
    store.finish_trial(a.id, "completed", result(3.5))
    store.finish_trial(b.id, "diverged", result(float("inf"), status="diverged"))
    store.requeue(c.id, "retry")
    reused_sid = new_sweep(store, items[:1])

    frame = store.results_frame(sid)
    assert list(frame.columns) == [
        "trial_id", "arm", "arch", "parameterization", "width", "depth", "lr", "sigma_base",
        "seed", "status", "final_val_loss", "flops", "tokens", "params_non_embedding",
        "params_embedding", "wall_time_s", "reused", "stage", "steps", "tokens_per_param",
    ] == list(RESULT_FRAME_COLUMNS)
    assert len(frame) == 4 and frame["trial_id"].tolist() == trial_ids(store, sid)
    for col in ("trial_id", "arm", "arch", "parameterization", "status"):
        assert pd.api.types.is_string_dtype(frame[col]) or frame[col].dtype == object, col
    for col in ("width", "depth", "seed"):
        assert frame[col].dtype == np.int64, col
    for col in ("lr", "sigma_base", "final_val_loss", "flops", "tokens",
                "params_non_embedding", "params_embedding", "wall_time_s", "steps",
                "tokens_per_param"):
        assert frame[col].dtype == np.float64, col
    assert frame["reused"].dtype == bool
    assert frame["status"].tolist() == ["completed", "diverged", "pending", "running"]
    assert frame["arm"].tolist() == ["sp", "sp", "mup", "mup"]
    assert frame["parameterization"].tolist() == ["sp", "sp", "mup", "mup"]
    assert set(frame["arch"]) == {"gpt"}
    assert frame.loc[0, "final_val_loss"] == 3.5 and frame.loc[0, "tokens"] == 20480
    # steps trained (where a pruned trial stopped): tokens over the spec's tokens per step
    per_step = items[0].trial.batch_size * items[0].trial.seq_len
    assert frame.loc[0, "steps"] == 20480 // per_step and math.isnan(frame.loc[2, "steps"])
    assert math.isnan(frame.loc[1, "final_val_loss"]) and math.isnan(frame.loc[2, "flops"])
    # the planned budget per parameter: none here (TrialSpec's default budget is in steps)
    assert items[0].trial.budget.tokens_per_param is None
    assert frame["tokens_per_param"].isna().all()
    assert not frame["reused"].any()
    assert store.results_frame(reused_sid)["reused"].tolist() == [True]

    empty = store.results_frame("missing")
    assert list(empty.columns) == list(RESULT_FRAME_COLUMNS) and len(empty) == 0
    assert empty["width"].dtype == np.int64 and empty["reused"].dtype == bool


# --------------------------------------------------------------------------- settings


def test_a_read_only_home_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    """A read-only HPT_HOME (a read-only mount: tests run as root, where permissions do not
    bind, so os.access's answer is stood in): `hpt serve` gave an OSError traceback after
    Ray started, `hpt mlflow-ui` retried for ~100 s."""
    import os
    from types import SimpleNamespace

    monkeypatch.setenv("HPT_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_flag=os.ST_RDONLY))
    with pytest.raises(SettingsError, match=(
            f"HPT_HOME cannot be used: {tmp_path / 'home'} is on a read-only file system; "
            "set HPT_HOME to a writable directory")):
        get_settings().ensure_dirs()
    assert not (tmp_path / "home" / "cache").exists()


@pytest.mark.parametrize("url,memory", [
    ("sqlite:///", True), ("sqlite://", True), ("sqlite+pysqlite:///:memory:", True),
    ("sqlite:///file:x?mode=memory&uri=true", True), ("sqlite:////abs/hpt.db", False),
    ("sqlite:///rel.db", False), ("postgresql://u@h/db", False)])
def test_in_memory_sqlite_urls_are_told_from_files(url: str, memory: bool) -> None:
    from hptransfer.config import sqlite_in_memory

    assert sqlite_in_memory(url) is memory


def test_settings_defaults_and_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("HPT_DATABASE_URL", "HPT_OPTUNA_URL", "MLFLOW_TRACKING_URI", "RAY_ADDRESS",
                 "HPT_API_TOKEN", "HPT_HOST", "HPT_PORT", "HPT_MAX_TRIALS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HPT_HOME", str(tmp_path / "home"))
    s = get_settings()
    home = (tmp_path / "home").resolve()
    assert s.home == home and not home.exists()  # created on demand only
    assert s.database_url == f"sqlite:///{home}/hpt.db"
    assert s.optuna_url == f"sqlite:///{home}/optuna.db"
    assert s.mlflow_uri == f"sqlite:///{home}/mlflow.db"
    assert len({s.database_url, s.optuna_url, s.mlflow_uri}) == 3  # never one database
    assert (s.ray_address, s.api_token, s.host, s.port, s.max_trials) == (
        None, None, "127.0.0.1", 8600, 5000,
    )
    s.ensure_dirs()
    assert s.cache_dir.is_dir() and s.mlflow_artifacts.is_dir()

    monkeypatch.setenv("HPT_DATABASE_URL", "postgresql://u:p@db/hpt")
    monkeypatch.setenv("HPT_API_TOKEN", "secret")
    monkeypatch.setenv("HPT_PORT", "9000")
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    s = get_settings()  # re-read: no caching
    assert s.database_url == "postgresql://u:p@db/hpt" and s.port == 9000
    assert s.ray_address == "ray://head:10001" and s.redacted()["api_token"] == "***"
    monkeypatch.setenv("HPT_PORT", "eighty")
    with pytest.raises(SettingsError, match="HPT_PORT"):
        get_settings()
