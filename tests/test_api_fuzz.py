"""Every field of a sweep spec, set to a value of the wrong kind or out of bounds, gives a
4xx whose error names that exact field path — never a 201, never a 500, never a stored row.
No dispatcher: only validation and storage are exercised."""

from __future__ import annotations

import copy
import json

import pytest
from fastapi.testclient import TestClient

from hptransfer.api import create_app
from hptransfer.config import get_settings

INF, NAN = float("inf"), float("nan")  # json.dumps writes these as Infinity / NaN
# Wrong for every field of its kind in the tiny spec: no coercion (bool, numeric strings,
# integral floats for ints), no non-finite numbers, no negatives, nothing past the bounds.
COMMON = [True, False, [], {}, [None], INF, -INF, NAN]
BAD = {
    int: [*COMMON, None, -1, 1.5, "1", 10**30],
    float: [*COMMON, None, -1.0, 0, "0.01", 1e300],
    str: [*COMMON, None, 1, 1.5, "x" * 20_000],
    list: [None, 1, "x", [], [None], INF],
    dict: [None, 1, "x", [], {"unknown": 1}],
}
# None is a valid value there (budget.steps: the budget as a whole then says what is missing)
NULLABLE = {"fixed.eval_every", "data.max_corpus_bytes", "budget.steps"}


def leaf_paths(obj, prefix=()):
    """(path, value) for every section, list and scalar of `obj`."""
    if prefix:
        yield prefix, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaf_paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from leaf_paths(v, (*prefix, i))


def dotted(path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def with_value(spec, path, value):
    spec = copy.deepcopy(spec)
    target = spec
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return spec


def cases(spec):
    for path, value in leaf_paths(spec):
        kind = type(value)
        if kind not in BAD:
            continue
        for bad in BAD[kind]:
            if bad is None and dotted(path) in NULLABLE:
                continue
            yield dotted(path), path, bad


def names(field: str, reported: list[str]) -> bool:
    # The exact path, or (for a wrong mapping such as {"unknown": 1}) a key inside it.
    return any(f == field or f.startswith((field + ".", field + "[")) for f in reported)


@pytest.fixture
def client(hpt_home):
    with TestClient(create_app(get_settings(), dispatch=False),
                    raise_server_exceptions=False) as c:
        yield c


def post(client, body) -> object:
    return client.post("/sweeps", content=json.dumps(body),
                       headers={"content-type": "application/json"})


def test_every_field_rejects_wrong_values_naming_the_field(client, tiny_spec):
    assert post(client, tiny_spec).status_code == 201  # the base spec itself is valid
    before = client.get("/sweeps").json()
    checked, failures = 0, []
    for field, path, value in cases(tiny_spec):
        r = post(client, with_value(tiny_spec, path, value))
        checked += 1
        if r.status_code != 422:
            failures.append((field, value, r.status_code, r.text[:200]))
            continue
        body = r.json()
        reported = [e["field"] for e in body["errors"]]
        if not (body["error"] and names(field, reported)):
            failures.append((field, value, reported))
    assert checked > 250  # every field of the tiny spec, each with several wrong values
    assert not failures, failures
    assert client.get("/sweeps").json() == before  # no rejected spec left anything behind


@pytest.mark.parametrize(("path", "value", "field"), [
    (("fixed", "head_dim"), True, "fixed.head_dim"),
    (("grid", "lrs"), [True], "grid.lrs[0]"),
    (("budget", "steps"), True, "budget.steps"),
    (("grid", "widths"), [32.0], "grid.widths[0]"),
    (("budget", "steps"), "10", "budget.steps"),
    (("data", "val_tokens"), 1024.0, "data.val_tokens"),
])
def test_no_coercion(client, tiny_spec, path, value, field):
    r = post(client, with_value(tiny_spec, path, value))
    assert r.status_code == 422 and [e["field"] for e in r.json()["errors"]] == [field]
    assert client.get("/sweeps").json() == []


def test_non_object_bodies(client):
    for body in (b"[]", b"42", b'"spec"', b"null", b"{", b"\xff\xfe", b"Infinity", b"NaN"):
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
