"""The API answers as /openapi.json says: schemathesis generates requests from the schema
(query parameters, bodies, path ids) and checks each answer against it: no 5xx, every
status and content type documented, every body valid against its documented model.

Against a real server (its dispatcher off), with a bearer token configured: the mutations
get the token, so they reach their handlers (and, for bodies the spec refuses, the spec's
own 422s). Requires schemathesis (the dev dependency `schemathesis>=4.32`)."""

from __future__ import annotations

import copy

import pytest
from conftest import TINY_SPEC

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis import checks  # noqa: E402
from schemathesis.specs.openapi import checks as openapi_checks  # noqa: E402

TOKEN = "schema-test-token-0123456789"
CHECKS = [checks.not_a_server_error, openapi_checks.status_code_conformance,
          openapi_checks.content_type_conformance, openapi_checks.response_schema_conformance]
EXAMPLES = 12  # per operation (and per its phases): ~ a minute for the whole file on one core


@pytest.fixture(scope="module")
def server(module_hpt_home):
    """A served app with a token and one real sweep, so some generated ids are found."""
    import httpx

    from hptransfer.api.server import serve_in_thread
    from hptransfer.config import get_settings

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HPT_API_TOKEN", TOKEN)
        with serve_in_thread(get_settings(), dispatch=False) as url:
            r = httpx.post(f"{url}/sweeps", json={**copy.deepcopy(TINY_SPEC), "name": "schema"},
                           headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
            assert r.status_code == 201, r.text
            yield url


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server}/openapi.json")


def operations(api_schema) -> list:
    return [result.ok() for result in api_schema.get_all_operations()]


def test_every_answer_is_the_documented_one(api_schema):
    """Each operation in turn (schemathesis' pytest plugin does not run under this pytest),
    its failures collected: one run names every operation that does not conform."""
    failures = []
    for operation in operations(api_schema):

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit,
                                                                   Phase.generate])
        def conforms(case) -> None:
            case.call_and_validate(headers={"Authorization": f"Bearer {TOKEN}"},
                                   checks=CHECKS, timeout=120)

        try:
            conforms()
        except Exception as exc:  # noqa: BLE001 - each operation's failure is reported
            failures.append(f"{operation.label}: {exc}")
    assert not failures, "\n\n".join(failures)


def test_the_sweep_body_is_the_spec_schema(api_schema, server):
    """POST /sweeps publishes the spec's own schema (its fields and bounds), not 'any
    object', while the route still reads the body itself."""
    import httpx

    from hptransfer.spec import SweepSpec

    doc = httpx.get(f"{server}/openapi.json").json()
    body = doc["paths"]["/sweeps"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/SweepSpec"}
    published = doc["components"]["schemas"]["SweepSpec"]
    assert set(published["properties"]) == set(SweepSpec.model_fields)
    assert published["additionalProperties"] is False
    # every error status a route can answer names the one error body
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            for status in ("400", "500", "503"):
                assert status in op["responses"], (method, path, status)
            assert "HTTPValidationError" not in str(op["responses"]), (method, path)
