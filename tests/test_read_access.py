"""Who may read: with HPT_API_TOKEN set, reads need it too unless HPT_PUBLIC_READS=1; an
anonymous read costs no more than the defaults (fit reports at the default bootstrap only);
/health answers everyone, its details (database path, Ray address, URLs) to the token only."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from conftest import TINY_SPEC
from fastapi.testclient import TestClient

from hptransfer.api.app import create_app
from hptransfer.config import SettingsError, get_settings

TOKEN = "read-access-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def served(module_hpt_home):
    """An app with a token and one stored sweep: (client, sweep id)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HPT_API_TOKEN", TOKEN)
        mp.setenv("HPT_AUTH_FAILURES", "1000")  # these tests send many wrong tokens on purpose
        with TestClient(create_app(get_settings(), dispatch=False)) as client:
            r = client.post("/sweeps", json={**copy.deepcopy(TINY_SPEC), "name": "reads"},
                            headers=AUTH)
            assert r.status_code == 201, r.text
            yield client, r.json()["id"]


@pytest.fixture
def public(served, monkeypatch):
    """The same app with HPT_PUBLIC_READS=1."""
    client, sweep_id = served
    coordinator = client.app.state.coordinator
    monkeypatch.setattr(coordinator, "settings",
                        dataclasses.replace(coordinator.settings, public_reads=True))
    return client, sweep_id


def reads(sweep_id: str) -> list[str]:
    return ["/sweeps", f"/sweeps/{sweep_id}", f"/sweeps/{sweep_id}/trials",
            f"/sweeps/{sweep_id}/fits", "/dashboards", f"/dashboards/sweeps/{sweep_id}"]


def test_every_read_needs_the_token_when_one_is_set(served):
    client, sweep_id = served
    for path in reads(sweep_id):
        r = client.get(path)
        assert r.status_code == 401, (path, r.text)
        assert "bearer token" in r.json()["error"] and r.headers["WWW-Authenticate"] == "Bearer"
        assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get(path, headers=AUTH).status_code == 200, path


def test_public_reads_open_the_reads_to_clients_without_the_token(public):
    client, sweep_id = public
    for path in reads(sweep_id):
        assert client.get(path).status_code == 200, path
        # a wrong token is still refused, never taken for anonymous
        assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    # the mutations still need it
    assert client.post(f"/sweeps/{sweep_id}/cancel").status_code == 401


@pytest.mark.parametrize("route", ["/sweeps/{id}/fits", "/dashboards/sweeps/{id}"])
def test_an_anonymous_fit_report_comes_at_the_default_bootstrap_only(public, route):
    """Each bootstrap is its own cache entry and seconds of CPU: distinct values from
    anonymous clients kept the fit gate busy for everyone."""
    client, sweep_id = public
    path = route.format(id=sweep_id)
    assert client.get(path, params={"bootstrap": 100}).status_code == 200
    for bootstrap in (0, 99, 101, 2000):
        r = client.get(path, params={"bootstrap": bootstrap})
        assert r.status_code == 401, r.text
        assert f"bootstrap={bootstrap} needs the bearer token" in r.json()["error"]
        assert client.get(path, params={"bootstrap": bootstrap}, headers=AUTH).status_code == 200


def test_without_a_token_configured_everything_stays_open(hpt_home):
    with TestClient(create_app(get_settings(), dispatch=False)) as client:
        assert client.get("/sweeps").status_code == 200
        body = client.get("/health").json()
        assert "database" in body and "mlflow_uri" in body
        assert all("detail" in c for c in body["components"])


@pytest.mark.parametrize("public_reads", [False, True])
def test_anonymous_health_shows_each_components_state_only(served, monkeypatch, public_reads,
                                                           module_hpt_home):
    client, _ = served
    coordinator = client.app.state.coordinator
    monkeypatch.setattr(coordinator, "settings",
                        dataclasses.replace(coordinator.settings, public_reads=public_reads))
    r = client.get("/health")
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"status", "components"}, body
    assert {"database", "optuna", "mlflow", "ray", "dispatcher"} <= {
        c["name"] for c in body["components"]}
    assert all(set(c) == {"name", "ok"} for c in body["components"])
    assert str(module_hpt_home) not in r.text and "sqlite" not in r.text
    full = client.get("/health", headers=AUTH).json()
    assert full["status"] == body["status"] and "database" in full
    assert str(module_hpt_home) in full["database"]
    assert client.get("/health", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_the_client_sends_the_token_on_reads(served):
    from hptransfer.client import Client

    client, sweep_id = served
    ours = Client("http://testserver", token=TOKEN)
    sent = dict(ours._http.headers)
    assert client.get(f"/sweeps/{sweep_id}", headers=sent).status_code == 200


def test_public_reads_from_the_environment(hpt_home, monkeypatch):
    assert get_settings().public_reads is False
    monkeypatch.setenv("HPT_PUBLIC_READS", "1")
    assert get_settings().public_reads is True
    monkeypatch.setenv("HPT_PUBLIC_READS", "maybe")
    with pytest.raises(SettingsError, match="HPT_PUBLIC_READS must be 1 or 0"):
        get_settings()
