"""The list endpoints answer in a constant number of SQL statements, however many sweeps there
are (no query per sweep): counted with a SQLAlchemy event listener on the real engine."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import event

from hptransfer.api.app import create_app
from hptransfer.config import get_settings


def add_sweeps(store: Any, n: int, spec: dict[str, Any]) -> None:
    for i in range(n):
        store.create_sweep(name=f"s{i}", spec=spec, spec_hash="h", search="grid", planned=[],
                           max_concurrent=2, planned_total=0)


def statements(engine: Any, call: Any) -> int:
    seen: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_a: Any) -> None:
        seen.append(statement)

    event.listen(engine, "before_cursor_execute", count)
    try:
        call()
    finally:
        event.remove(engine, "before_cursor_execute", count)
    return len(seen)


def test_listing_200_sweeps_takes_as_many_queries_as_listing_5(hpt_home, tiny_spec) -> None:
    with TestClient(create_app(get_settings(), dispatch=False)) as api:
        coordinator = api.app.state.coordinator
        engine = coordinator.store.engine

        def list_all() -> None:
            assert api.get("/sweeps", params={"limit": 1000}).status_code == 200
            assert api.get("/dashboards").status_code == 200

        add_sweeps(coordinator.store, 5, tiny_spec)
        few = statements(engine, list_all)
        add_sweeps(coordinator.store, 195, tiny_spec)
        many = statements(engine, list_all)
        assert len(api.get("/sweeps", params={"limit": 1000}).json()) == 200
    assert few == many, (few, many)
    assert many <= 10  # sweeps, their counts and mean wall times, per endpoint


def test_an_unchanged_listing_runs_no_query_and_a_commit_shows_at_once(hpt_home, tiny_spec):
    with TestClient(create_app(get_settings(), dispatch=False)) as api:
        store = api.app.state.coordinator.store
        add_sweeps(store, 3, tiny_spec)
        first = api.get("/sweeps").json()
        page = api.get("/dashboards").text

        def again() -> None:
            assert api.get("/sweeps").json() == first
            assert api.get("/dashboards").text == page

        assert statements(store.engine, again) == 0  # served from the listing cache
        add_sweeps(store, 1, tiny_spec)  # a commit: the next listing is rebuilt
        assert [s["name"] for s in api.get("/sweeps").json()] == ["s0", "s2", "s1", "s0"]
        assert api.get("/dashboards").text.count("/dashboards/sweeps/") == 4
        # other pages and offsets are their own entries, rebuilt from the same state
        assert len(api.get("/sweeps", params={"limit": 2, "offset": 3}).json()) == 1
