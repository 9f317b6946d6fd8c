"""The store writes and returns statuses as their plain strings, though it spells them with
the TrialStatus/SweepStatus enums: a member would compare equal, so these tests check the
types and the raw column values (a psycopg Enum dumper would write a member's NAME)."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import planned_trials as planned
from sqlalchemy import text

from hptransfer.store.store import Store


@pytest.fixture
def store(migrated_store):
    return migrated_store


def raw(store: Store, sql: str) -> list[tuple[Any, ...]]:
    with store.engine.connect() as conn:
        return [tuple(row) for row in conn.execute(text(sql))]


def test_returned_statuses_are_plain_strings(store: Store) -> None:
    sid = store.create_sweep("s", {}, "h", "grid", planned(2), data_hash="d", max_attempts=1)
    first, = store.lease_pending("me", 1, sweep_id=sid)
    refreshed = store.refresh_sweep_status(sid)
    assert (type(refreshed), refreshed) == (str, "running")
    requeued = store.requeue(first.id, "boom")  # its one attempt spent: failed
    assert (type(requeued), requeued) == (str, "failed")
    again = store.requeue(first.id, "boom")  # no longer running: the status as it is
    assert (type(again), again) == (str, "failed")
    assert store.cancel_sweep(sid) == []
    assert type(store.refresh_sweep_status(sid)) is str
    assert all(type(t.status) is str for t in store.trials(sid))


def test_statuses_are_stored_as_their_values(store: Store) -> None:
    sid = store.create_sweep("s", {}, "h", "grid", planned(3), data_hash="d")
    one, two = store.lease_pending("me", 2, sweep_id=sid)
    assert store.finish_trial(one.id, "completed", {"final_val_loss": 1.0}, owner="me")
    assert store.requeue(two.id, "retry me", owner="me") == "pending"
    store.cancel_sweep(sid)
    assert sorted(raw(store, "SELECT status FROM trials")) == [
        ("cancelled",), ("cancelled",), ("completed",)]
    assert raw(store, "SELECT status FROM sweeps") == [("cancelled",)]
    assert sorted(raw(store, "SELECT status, error FROM attempts")) == [
        ("completed", None), ("failed", "retry me")]
