"""The list endpoints answer in a constant number of SQL statements, however many sweeps there
are (no query per sweep): counted with a SQLAlchemy event listener on the real engine."""

from __future__ import annotations

import gc
import sys
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


def test_a_listing_the_client_has_is_a_bodiless_304_until_it_changes(hpt_home, tiny_spec):
    with TestClient(create_app(get_settings(), dispatch=False)) as api:
        store = api.app.state.coordinator.store
        add_sweeps(store, 2, tiny_spec)
        for path, media in (("/sweeps", "application/json"), ("/dashboards", "text/html")):
            first = api.get(path)
            assert first.status_code == 200
            assert first.headers["content-type"].startswith(media)
            assert first.headers["cache-control"] == "no-cache"  # browsers revalidate
            etag = first.headers["etag"]
            same = api.get(path, headers={"If-None-Match": etag})
            assert same.status_code == 304 and same.content == b""
            assert same.headers["etag"] == etag
            # a list of tags, weak or not, matches; another tag does not
            listed = api.get(path, headers={"If-None-Match": f'"nope", W/{etag}'})
            assert listed.status_code == 304
            assert api.get(path, headers={"If-None-Match": '"nope"'}).content == first.content
        # another page of the same listing is another body with its own tag
        page = api.get("/sweeps", params={"limit": 1})
        assert page.headers["etag"] != api.get("/sweeps").headers["etag"]
        tags = {p: api.get(p).headers["etag"] for p in ("/sweeps", "/dashboards")}
        add_sweeps(store, 1, tiny_spec)  # a commit: the listings change, and their tags
        for path, etag in tags.items():
            fresh = api.get(path, headers={"If-None-Match": etag})
            assert fresh.status_code == 200
            assert fresh.headers["etag"] != etag
            marker = b'"id":' if path == "/sweeps" else b"/dashboards/sweeps/"
            assert fresh.content.count(marker) == 3  # the new sweep is in it


def test_only_a_server_process_freezes_its_long_lived_objects(hpt_home):
    """`hpt serve` (freeze_gc) moves what start-up left alive out of the collector's reach,
    so full collections stop walking it; an app built for tests or embedding leaves the
    process's collector alone."""
    gc.unfreeze()
    try:
        with TestClient(create_app(get_settings(), dispatch=False)) as api:
            assert api.get("/sweeps").status_code == 200
            assert gc.get_freeze_count() == 0
        with TestClient(create_app(get_settings(), dispatch=False, freeze_gc=True)) as api:
            assert api.get("/sweeps").status_code == 200
            assert gc.get_freeze_count() > 100_000  # torch, MLflow, SQLAlchemy, ...
            assert "mlflow.tracking" in sys.modules  # the mirror's client, imported first
    finally:
        gc.unfreeze()
