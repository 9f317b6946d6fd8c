"""Identical submits train once: an Idempotency-Key makes a retried submit answer the sweep
it made (stored, so across restarts and servers), and a trial whose identical twin is
running in another sweep waits for its result instead of training again. The store tests
run on SQLite, and on PostgreSQL when HPT_TEST_POSTGRES_URL is set."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import planned_trials as planned

from hptransfer.spec import SpecError
from hptransfer.store.store import IdempotencyConflict, Store

RESULT = {"status": "completed", "final_val_loss": 3.0, "curve": []}


@pytest.fixture
def store(migrated_store: Store) -> Store:
    return migrated_store


def new_sweep(store: Store, n: int = 2, idempotency: tuple[str, str] | None = None,
              **kw: Any) -> str:
    return store.create_sweep("s", {}, "h", "grid", planned(n), data_hash="d",
                              idempotency=idempotency, **kw)


# ------------------------------------------------------------------- the Idempotency-Key


def test_the_same_key_and_body_give_the_same_sweep(store: Store) -> None:
    first = new_sweep(store, idempotency=("key-1", "body-a"))
    assert new_sweep(store, idempotency=("key-1", "body-a")) == first
    assert [s.id for s in store.list_sweeps()] == [first]  # nothing stored twice
    assert store.submitted_sweep("key-1", "body-a") == first
    assert store.submitted_sweep("key-2", "body-a") is None
    other = new_sweep(store, idempotency=("key-2", "body-a"))  # a new key: a new sweep
    assert other != first


def test_the_same_key_with_another_body_is_refused(store: Store) -> None:
    first = new_sweep(store, idempotency=("key-1", "body-a"))
    with pytest.raises(IdempotencyConflict, match=f"different request body \\(sweep {first}"):
        new_sweep(store, idempotency=("key-1", "body-b"))
    with pytest.raises(IdempotencyConflict):
        store.submitted_sweep("key-1", "body-b")
    assert len(store.list_sweeps()) == 1


def test_a_key_past_its_window_makes_a_new_sweep(store: Store,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import hptransfer.store.submissions as submissions

    first = new_sweep(store, idempotency=("key-1", "body-a"))
    monkeypatch.setattr(submissions, "IDEMPOTENCY_WINDOW_S", -1)  # every key expired
    second = new_sweep(store, idempotency=("key-1", "body-b"))
    assert second != first
    monkeypatch.setattr(submissions, "IDEMPOTENCY_WINDOW_S", 3600)
    assert store.submitted_sweep("key-1", "body-b") == second


def test_thirty_identical_submits_at_once_store_one_sweep(
        open_store: Callable[[], Store]) -> None:
    """Two 'servers' (stores) on one database, 15 requests each, all at once."""
    stores = [open_store(), open_store()]
    stores[0].migrate()
    barrier = threading.Barrier(30)
    ids: list[str] = []
    errors: list[BaseException] = []

    def submit(st: Store) -> None:
        try:
            barrier.wait()
            ids.append(new_sweep(st, idempotency=("same-key", "same-body")))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=submit, args=(stores[i % 2],)) for i in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(ids) == 30 and len(set(ids)) == 1
    assert len(stores[0].list_sweeps()) == 1


# ------------------------------------------------------------------- twins across sweeps


def test_a_trial_whose_twin_runs_in_another_sweep_waits_and_takes_its_result(
        store: Store) -> None:
    first, second = new_sweep(store, 2), new_sweep(store, 2)
    leased = store.lease_pending("c", 10, sweep_id=first)
    assert len(leased) == 2
    assert store.lease_pending("c", 10, sweep_id=second) == []  # both wait for their twins
    assert store.finish_trial(leased[0].id, "completed", RESULT)
    twin = next(t for t in store.trials(second) if t.content_hash == leased[0].content_hash)
    assert twin.status == "completed" and twin.reused_from == leased[0].id
    assert twin.attempts == 1 == len(store.attempts(twin.id))
    assert store.get_sweep(second).status != "completed"  # its other trial still waits
    assert store.finish_trial(leased[1].id, "completed", RESULT)
    # nothing left to run: the twins' sweep is completed (no dispatcher follow-up does it)
    sweep = store.get_sweep(second)
    assert sweep.status == "completed" and sweep.finished_at is not None
    assert store.count_trials(second, status="completed") == 2


def test_one_lease_call_never_takes_two_identical_trials(store: Store) -> None:
    first, second = new_sweep(store, 2), new_sweep(store, 2)
    leased = store.lease_pending("c", 10)
    assert sorted(t.sweep_id for t in leased) == [first, first]
    assert store.count_trials(second, status="pending") == 2


def test_a_twin_that_fails_leaves_the_waiting_trial_to_train(store: Store) -> None:
    first = new_sweep(store, 1, max_attempts=1)
    second = new_sweep(store, 1)
    (a,) = store.lease_pending("c", 1, sweep_id=first)
    assert store.lease_pending("c", 1, sweep_id=second) == []
    assert store.requeue(a.id, "boom") == "failed"
    (b,) = store.lease_pending("c", 1, sweep_id=second)
    assert b.content_hash == a.content_hash and b.sweep_id == second


def test_a_twin_on_other_data_is_not_waited_for(store: Store) -> None:
    new_sweep(store, 1)
    other = store.create_sweep("s", {}, "h", "grid", planned(1), data_hash="other-data")
    assert len(store.lease_pending("c", 1)) == 1
    assert len(store.lease_pending("c", 1, sweep_id=other)) == 1


def test_without_reuse_a_sweep_trains_its_own(store: Store) -> None:
    new_sweep(store, 1)
    own = new_sweep(store, 1, reuse=False)
    assert len(store.lease_pending("c", 1)) == 1
    assert len(store.lease_pending("c", 1, sweep_id=own)) == 1


# ------------------------------------------------------------------- the coordinator's submit


@pytest.fixture
def coordinator(hpt_home: Path) -> Iterator[Any]:
    from hptransfer.config import get_settings
    from hptransfer.coordinator.service import Coordinator

    c = Coordinator(get_settings(), dispatch=False)
    yield c
    c.store.close()


def test_submit_with_a_key_answers_the_first_sweep(coordinator: Any, tiny_spec: dict) -> None:
    first = coordinator.submit(tiny_spec, idempotency_key="retry-me")
    reordered = dict(reversed(list(tiny_spec.items())))  # the same body, keys reordered
    again = coordinator.submit(reordered, idempotency_key="retry-me")
    assert again["id"] == first["id"] and again["total"] == first["total"]
    assert len(coordinator.summaries()) == 1
    assert coordinator.submit(tiny_spec)["id"] != first["id"]  # no key: a new sweep


def test_submit_with_a_key_and_another_body_names_the_header(coordinator: Any,
                                                            tiny_spec: dict) -> None:
    coordinator.submit(tiny_spec, idempotency_key="k")
    with pytest.raises(SpecError) as exc:
        coordinator.submit({**tiny_spec, "name": "other"}, idempotency_key="k")
    (error,) = exc.value.errors
    assert error["field"] == "Idempotency-Key" and "different request body" in error["message"]
    assert len(coordinator.summaries()) == 1


@pytest.mark.parametrize("key", ["", "x" * 256, "has space", "tab\there", "é"])
def test_a_malformed_key_is_refused(coordinator: Any, tiny_spec: dict, key: str) -> None:
    with pytest.raises(SpecError) as exc:
        coordinator.submit(tiny_spec, idempotency_key=key)
    assert exc.value.errors[0]["field"] == "Idempotency-Key"
    assert coordinator.summaries() == []


# ------------------------------------------------------------------- over HTTP


def test_the_header_over_http(hpt_home: Path, tiny_spec: dict) -> None:
    from fastapi.testclient import TestClient

    from hptransfer.api.app import create_app
    from hptransfer.config import get_settings

    with TestClient(create_app(get_settings(), dispatch=False),
                    raise_server_exceptions=False) as c:
        first = c.post("/sweeps", json=tiny_spec, headers={"Idempotency-Key": "abc-123"})
        assert first.status_code == 201, first.text
        again = c.post("/sweeps", json=tiny_spec, headers={"idempotency-key": "abc-123"})
        assert again.status_code == 201 and again.json()["id"] == first.json()["id"]
        other = c.post("/sweeps", json={**tiny_spec, "name": "x"},
                       headers={"Idempotency-Key": "abc-123"})
        assert other.status_code == 422
        assert other.json()["errors"][0]["field"] == "Idempotency-Key"
        assert first.json()["id"] in other.json()["error"]
        bad = c.post("/sweeps", json=tiny_spec, headers={"Idempotency-Key": ""})
        assert bad.status_code == 422 and "Idempotency-Key" in bad.json()["error"]
        assert [s["id"] for s in c.get("/sweeps").json()] == [first.json()["id"]]


class AnswerLost:
    """A TCP relay in front of the server that forwards the first `times` connections'
    requests and drops each connection instead of relaying the answer (a reply lost on the
    way back, or a keep-alive connection the server closed as it was reused); later
    connections are relayed whole."""

    def __init__(self, target_port: int, times: int = 1) -> None:
        import socket

        self.target = target_port
        self.times = times
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.dropped = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            drop = self.dropped < self.times
            self.dropped += drop
            threading.Thread(target=self._relay, args=(client, upstream, drop),
                             daemon=True).start()

    @staticmethod
    def _relay(client: Any, upstream: Any, drop: bool) -> None:
        import select

        with client, upstream:
            while True:
                ready, _, _ = select.select([client, upstream], [], [], 30)
                if not ready:
                    return
                for side in ready:
                    data = side.recv(65536)
                    if not data:
                        return
                    if side is upstream and drop:
                        return  # the answer is lost: the client sees the connection close
                    (upstream if side is client else client).sendall(data)

    def close(self) -> None:
        self.server.close()


def test_the_client_sends_a_submit_again_after_a_lost_answer_and_gets_one_sweep(
        hpt_home: Path, tiny_spec: dict) -> None:
    from urllib.parse import urlsplit

    from hptransfer.api.server import serve_in_thread
    from hptransfer.client import Client
    from hptransfer.config import get_settings

    with serve_in_thread(get_settings(), dispatch=False) as url:
        relay = AnswerLost(urlsplit(url).port)
        try:
            with Client(f"http://127.0.0.1:{relay.port}") as c:
                sweep = c.submit(tiny_spec)
                sweeps = c.list()
        finally:
            relay.close()
    assert relay.dropped == 1  # the first answer was lost, the request had been applied
    assert [s["id"] for s in sweeps] == [sweep["id"]]  # the retry got the same sweep


@pytest.mark.parametrize("times, resent", [(1, True), (2, False)])
def test_a_get_is_sent_once_more_after_its_connection_drops_and_a_post_is_not(
        hpt_home: Path, tiny_spec: dict, times: int, resent: bool) -> None:
    """`hpt status`/`wait` failed with "request ... failed (ReadError)" when the connection
    it reused had just been closed by the server; a GET changes nothing, so it is sent
    again, once. A cancel is not re-sent: the caller sees that it may not have landed."""
    from urllib.parse import urlsplit

    from hptransfer.api.server import serve_in_thread
    from hptransfer.client import ApiError, Client
    from hptransfer.config import get_settings

    with serve_in_thread(get_settings(), dispatch=False) as url:
        with Client(url) as c:
            sweep = c.submit(tiny_spec)
        port = urlsplit(url).port
        relay = AnswerLost(port, times)
        try:
            with Client(f"http://127.0.0.1:{relay.port}") as c:
                if resent:
                    assert c.get(sweep["id"])["id"] == sweep["id"]
                else:
                    with pytest.raises(ApiError, match="ReadError|RemoteProtocolError"):
                        c.get(sweep["id"])
        finally:
            relay.close()
        assert relay.dropped == times
        relay = AnswerLost(port, 1)
        try:
            with Client(f"http://127.0.0.1:{relay.port}") as c:
                with pytest.raises(ApiError, match="ReadError|RemoteProtocolError"):
                    c.cancel(sweep["id"])
        finally:
            relay.close()
        assert relay.dropped == 1
