"""What the API's HTML pages need to be safe on its origin: security headers on every
response (a CSP on the pages, allowing their own inline scripts by hash), and Swagger UI at
/docs from the installed `swagger-ui-bundle-v2` package instead of a CDN (the page worked
only with internet access, and ran a third party's script on the API's origin)."""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response

from .guards import error_response

# every response: no MIME sniffing (a JSON error quoting input is never run as HTML), and
# no framing by other sites (clickjacking)
SAFE_HEADERS = [(b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY")]
# HTML pages: scripts and everything else from this origin only; inline scripts only those
# the page itself carries (their hashes, added per response). Inline styles stay allowed:
# the pages use style attributes and plotly adds its stylesheet at run time.
PAGE_POLICY = ("default-src 'self'; script-src 'self'{hashes}; style-src 'self' "
               "'unsafe-inline'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
               "form-action 'self'; frame-ancestors 'none'")
_INLINE_SCRIPT = re.compile(rb"<script(\s[^>]*)?>(.*?)</script\s*>", re.DOTALL | re.IGNORECASE)
_SRC = re.compile(rb"\ssrc\s*=", re.IGNORECASE)


def page_policy(html: bytes) -> str:
    """The CSP for `html`: its inline scripts allowed by their SHA-256."""
    hashes = sorted({base64.b64encode(hashlib.sha256(body).digest()).decode()
                     for attrs, body in _INLINE_SCRIPT.findall(html)
                     if not _SRC.search(attrs or b"")})
    return PAGE_POLICY.format(hashes="".join(f" 'sha256-{h}'" for h in hashes))


class SecurityHeaders:
    """ASGI middleware: SAFE_HEADERS on every response; an HTML response is held until its
    body is complete and sent with its CSP (page_policy)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held: dict | None = None
        body = bytearray()

        async def guarded(message: dict) -> None:
            nonlocal held
            if message["type"] == "http.response.start":
                # a new list: a response object may be sent again (the listings' cache)
                message = {**message, "headers": [*message.get("headers", []),
                                                  *SAFE_HEADERS]}
                if any(k.lower() == b"content-type" and v.startswith(b"text/html")
                       for k, v in message["headers"]):
                    held = message
                    return
            elif message["type"] == "http.response.body" and held is not None:
                body.extend(message.get("body", b""))
                if message.get("more_body", False):
                    return
                policy = page_policy(bytes(body)).encode()
                await send({**held, "headers": [*held["headers"],
                                                (b"content-security-policy", policy)]})
                message = {**message, "body": bytes(body)}
            await send(message)

        await self.app(scope, receive, guarded)


def swagger_ui_dir() -> Path:
    from swagger_ui_bundle import swagger_ui_path

    return Path(str(swagger_ui_path))


DOCS_STATIC = "/docs/static"
# the files the page loads, and their types; nothing else of the package is served
_ASSETS = {"swagger-ui-bundle.js": "application/javascript", "swagger-ui.css": "text/css",
           "favicon-32x32.png": "image/png"}
# the assets only change with the installed package: let browsers keep them for a day
_ASSET_HEADERS = {"Cache-Control": "public, max-age=86400"}


def install_docs(app: FastAPI) -> None:
    """/docs (Swagger UI from the package) and /redoc, which sends browsers there: ReDoc
    has no package to serve it from, and its CDN copy would run under the API's origin."""

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{DOCS_STATIC}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_STATIC}/swagger-ui.css",
            swagger_favicon_url=f"{DOCS_STATIC}/favicon-32x32.png")

    @app.get(DOCS_STATIC + "/{name}", include_in_schema=False)
    async def swagger_asset(name: str) -> Response:
        if name not in _ASSETS:
            return error_response(404, f"no file {name!r} here: the page uses "
                                       f"{', '.join(sorted(_ASSETS))}")
        return FileResponse(swagger_ui_dir() / name, media_type=_ASSETS[name],
                            headers=_ASSET_HEADERS)

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> RedirectResponse:
        return RedirectResponse("/docs", status_code=307)
