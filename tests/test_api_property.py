"""Property-based fuzz of the API from its own OpenAPI schema (Hypothesis): for any generated
request — path ids, query values in and far out of range, JSON bodies with any shape,
non-finite numbers and odd content types — the answer is never a 5xx, and a rejected request
stores nothing. Bounded examples, so it runs in seconds."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hptransfer.api import create_app
from hptransfer.config import get_settings

MAX_EXAMPLES = 150

scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20))
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                 max_size=5),
    max_leaves=20,
)


def operations(app) -> list[tuple[str, str, dict]]:
    schema = app.openapi()
    return [(method.upper(), path, op) for path, item in schema["paths"].items()
            for method, op in item.items()]


def query_value(param: dict) -> st.SearchStrategy:
    kind = (param.get("schema") or {}).get("anyOf", [param.get("schema") or {}])[0].get("type")
    if kind == "integer":
        return st.integers(min_value=-(2**80), max_value=2**80).map(str)
    return st.text(max_size=30)


@st.composite
def requests(draw, ops, tiny_spec):
    method, path, op = draw(st.sampled_from(ops))
    for name in [p["name"] for p in op.get("parameters", []) if p["in"] == "path"]:
        value = draw(st.text(alphabet=st.characters(blacklist_categories=("Cs", "Cc", "Zs"),
                                                    blacklist_characters="/?#%"),
                             min_size=1, max_size=20))
        path = path.replace("{" + name + "}", value)
    params = {p["name"]: draw(query_value(p)) for p in op.get("parameters", [])
              if p["in"] == "query" and draw(st.booleans())}
    body, headers = None, {}
    if method == "POST":
        # A mutated valid spec half the time (deep validation), any JSON otherwise.
        if draw(st.booleans()):
            spec = json.loads(json.dumps(tiny_spec))
            section = draw(st.sampled_from(sorted(spec)))
            if isinstance(spec[section], dict) and spec[section] and draw(st.booleans()):
                key = draw(st.sampled_from(sorted(spec[section])))
                spec[section][key] = draw(json_values)
            else:
                spec[section] = draw(json_values)
            body = json.dumps(spec)
        else:
            body = json.dumps(draw(json_values))
        headers["content-type"] = draw(st.sampled_from(
            ["application/json", "application/json; charset=utf-8", "text/plain", ""]))
    return method, path, params, body, headers


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("HPT_HOME", str(tmp_path_factory.mktemp("hpt")))
    for var in ("HPT_DATABASE_URL", "HPT_OPTUNA_URL", "MLFLOW_TRACKING_URI", "HPT_API_TOKEN",
                "RAY_ADDRESS"):
        mp.delenv(var, raising=False)
    with TestClient(create_app(get_settings(), dispatch=False),
                    raise_server_exceptions=False) as c:
        yield c
    mp.undo()


def test_no_5xx_and_rejections_store_nothing(client):
    from conftest import TINY_SPEC

    ops = operations(client.app)
    assert {path for _, path, _ in ops} >= {"/sweeps", "/sweeps/{sweep_id}/cancel"}

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(requests(ops, TINY_SPEC))
    def check(request):
        method, path, params, body, headers = request
        before = len(client.get("/sweeps", params={"limit": 1000}).json())
        r = client.request(method, path, params=params, content=body, headers=headers)
        assert r.status_code < 500, (method, path, params, body, r.status_code, r.text[:300])
        after = len(client.get("/sweeps", params={"limit": 1000}).json())
        if r.status_code >= 400 or method != "POST" or path != "/sweeps":
            assert after == before, (method, path, body, r.status_code)

    check()
