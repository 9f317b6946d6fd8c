"""The REST API reference from the FastAPI app's own OpenAPI schema.

The app is built with dispatch=False and a throwaway HPT_HOME; building it starts nothing
(no database, no Ray, no MLflow: those start in its lifespan, which this never enters).
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from typing import Any

from .schema import anchor, bounds_of, cell, properties_table, type_of

_DB_VARIABLES = ("HPT_DATABASE_URL", "HPT_OPTUNA_URL", "MLFLOW_TRACKING_URI", "RAY_ADDRESS")


@functools.cache
def schema() -> dict[str, Any]:
    from hptransfer.api import create_app
    from hptransfer.config import get_settings

    saved = {k: os.environ.get(k) for k in ("HPT_HOME", *_DB_VARIABLES)}
    with tempfile.TemporaryDirectory() as home:
        try:
            os.environ["HPT_HOME"] = home
            for name in _DB_VARIABLES:
                os.environ.pop(name, None)
            return create_app(get_settings(), dispatch=False).openapi()
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def schema_json() -> str:
    return json.dumps(schema(), indent=2, ensure_ascii=False) + "\n"


def _parameters(op: dict[str, Any]) -> list[str]:
    params = op.get("parameters", [])
    if not params:
        return []
    rows = ["| parameter | in | type | required | default | bounds |", "|---|---|---|---|---|---|"]
    for p in params:
        node = p.get("schema", {})
        default = f"`{json.dumps(node['default'])}`" if "default" in node else ""
        rows.append(f"| `{p['name']}` | {p['in']} | {cell(type_of(node))} | "
                    f"{'yes' if p.get('required') else 'no'} | {cell(default)} | "
                    f"{cell(bounds_of(node))} |")
    return rows + [""]


def _body(op: dict[str, Any]) -> list[str]:
    body = op.get("requestBody")
    if not body:
        return []
    lines = []
    for media, content in body.get("content", {}).items():
        lines.append(f"Request body (`{media}`): {type_of(content.get('schema', {}))}")
    return lines + [""]


def _responses(op: dict[str, Any]) -> list[str]:
    rows = ["| status | meaning | body |", "|---|---|---|"]
    for code, resp in op.get("responses", {}).items():
        media = resp.get("content", {})
        body = ", ".join(type_of(c.get("schema", {})) for c in media.values() if c.get("schema"))
        rows.append(f"| {code} | {cell(resp.get('description', ''))} | {cell(body)} |")
    return rows + [""]


def page() -> str:
    spec = schema()
    info = spec.get("info", {})
    out = ["# REST API reference", "",
           f"Generated from the app's OpenAPI schema ({info.get('title', '')} "
           f"{info.get('version', '')}) at every docs build; a running server serves the same "
           "schema at `/openapi.json` and interactive docs at `/docs`. The raw schema: "
           "[openapi.json](openapi.json).", "",
           cell(info.get("description", "")), "",
           "Mutating calls (every POST) need `Authorization: Bearer $HPT_API_TOKEN` when the "
           "server has a token, and `Content-Type: application/json` (415 otherwise); "
           "so do reads, unless the server sets `HPT_PUBLIC_READS=1` (`/health` answers "
           "everyone, its details only with the token). "
           "`POST /sweeps` takes a sweep spec as JSON: its fields are in the "
           "[spec reference](spec.md).", ""]
    for path, methods in spec.get("paths", {}).items():
        for method, op in methods.items():
            out += [f"## {method.upper()} `{path}`", ""]
            if op.get("summary"):
                out += [f"**{op['summary']}**", ""]
            if op.get("description"):
                out += [op["description"].strip(), ""]
            out += _parameters(op) + _body(op) + _responses(op)
    out += ["## Schemas", ""]
    for name, node in spec.get("components", {}).get("schemas", {}).items():
        out += [f"### {name} {{ #{anchor(name)} }}", ""]
        if node.get("description"):
            out += [node["description"].strip(), ""]
        if node.get("properties"):
            out += [properties_table(node), ""]
        elif "type" in node or "anyOf" in node:
            out += [f"Type: {type_of(node)}", ""]
    return "\n".join(out)
