"""Every field of a sweep spec, set to wrong values, gives a 4xx naming it — never a 500,
never a half-written sweep. No dispatcher: only validation and storage are exercised."""

from __future__ import annotations

import copy
import json

import pytest
from fastapi.testclient import TestClient

from hptransfer.api import create_app
from hptransfer.config import get_settings

BAD_VALUES = [None, -1, 0, "x", [], {}, 1e309, True, [None], {"unknown": 1}]


def leaf_paths(obj, prefix=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaf_paths(v, (*prefix, k))
    elif isinstance(obj, list) and obj:
        yield from leaf_paths(obj[0], (*prefix, 0))
        yield prefix
    else:
        yield prefix


def with_value(spec, path, value):
    spec = copy.deepcopy(spec)
    target = spec
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return spec


@pytest.fixture
def client(hpt_home):
    with TestClient(create_app(get_settings(), dispatch=False),
                    raise_server_exceptions=False) as c:
        yield c


def test_every_field_rejects_bad_values_with_a_4xx(client, tiny_spec):
    accepted = 0
    for path in leaf_paths(tiny_spec):
        if not path:
            continue
        for value in BAD_VALUES:
            # json.dumps writes inf as `Infinity`, which the server's parser accepts
            r = client.post("/sweeps", content=json.dumps(with_value(tiny_spec, path, value)),
                            headers={"content-type": "application/json"})
            assert r.status_code in (201, 422), (path, value, r.status_code, r.text[:300])
            if r.status_code == 422:
                body = r.json()
                assert body["error"] and body["errors"], (path, value)
                dotted = ".".join(str(p) for p in path if not isinstance(p, int))
                fields = " ".join(e["field"] for e in body["errors"])
                assert path[0] in fields or dotted.split(".")[0] in fields or \
                    body["errors"][0]["field"] == "", (path, value, body)
            else:
                accepted += 1
    # the tiny spec itself is accepted, and so are a few coercible values (e.g. seed 0)
    stored = client.get("/sweeps").json()
    assert len(stored) == accepted  # every 422 left nothing behind
    assert all(s["total"] > 0 for s in stored)


def test_non_object_bodies(client):
    for body in (b"[]", b"42", b'"spec"', b"null", b"{", b"\xff\xfe"):
        r = client.post("/sweeps", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422, (body, r.status_code, r.text)
    assert client.get("/sweeps").json() == []


def test_fits_and_dashboard_of_an_unstarted_sweep_explain_themselves(client, tiny_spec):
    sweep = client.post("/sweeps", json=tiny_spec).json()
    r = client.get(f"/sweeps/{sweep['id']}/fits")
    assert r.status_code == 200
    body = r.json()
    assert "not enough data for" in body["text"]
    assert set(body["tables"]) >= {"optimal_lr", "transfer", "frontier", "savings"}
    page = client.get(f"/dashboards/sweeps/{sweep['id']}")
    assert page.status_code == 200 and "not enough data for" in page.text
    assert client.get("/sweeps/nope/fits").status_code == 404
    assert client.get(f"/sweeps/{sweep['id']}/fits", params={"bootstrap": -1}).status_code == 422
