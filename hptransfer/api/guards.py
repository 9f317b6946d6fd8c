"""Request guards: strict JSON bodies and a JSON content type on every mutation.

A browser page on another site can send a "simple" cross-site request (form encodings,
text/plain, or no body) without asking first; requiring `application/json` on every POST
means such a request never reaches a mutating endpoint, even when no token is configured.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any
from urllib.parse import parse_qsl

from fastapi import HTTPException, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from hptransfer.spec.loading import strict_json_loads
from hptransfer.spec.text import DuplicateKey

from .auth import require_token


class StrictJSONRequest(Request):
    """A request whose JSON body may not hold Infinity/NaN (Python's json accepts them) nor
    name a key twice (it would keep the last silently)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = strict_json_loads(await self.body())
            except DuplicateKey as exc:
                raise HTTPException(status_code=422, detail=f"invalid JSON body: {exc}") from None
        return self._json


class StrictJSONRoute(APIRoute):
    """A route whose token and content-type checks (when it has them as dependencies) run
    before its body is read: FastAPI reads and parses a body before any dependency, so an
    unauthenticated 1 MB spec was parsed (83 ms) only to be answered 401. They still run
    again as dependencies, where the OpenAPI document sees them."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        early = [d.dependency for d in self.dependencies
                 if d.dependency in (require_token, require_json)]

        async def strict_handler(request: Request) -> Response:
            for check in early:
                check(request)
            return await handler(StrictJSONRequest(request.scope, request.receive))

        return strict_handler


def require_json(request: Request) -> None:
    """Refuse a mutation whose Content-Type is not application/json (415)."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        raise HTTPException(
            status_code=415,
            detail="send mutations with 'Content-Type: application/json' (an empty JSON "
                   "object {} for calls without a body)",
        )
    encoding = request.headers.get("content-encoding", "").strip().lower()
    # a transfer coding other than chunked (gzip, deflate) reaches us still compressed
    codings = {c.strip() for c in request.headers.get("transfer-encoding", "").lower()
               .split(",")} - {"", "chunked", "identity"}
    if codings:
        raise HTTPException(
            status_code=415,
            detail=f"Transfer-Encoding {', '.join(sorted(codings))!r:.60} is not supported: "
                   "send the body uncompressed (chunked is fine)",
        )
    if encoding not in ("", "identity"):
        raise HTTPException(
            status_code=415,
            detail=f"Content-Encoding {encoding!r} is not supported: send the body "
                   "uncompressed (no Content-Encoding header)",
        )


def error_response(status: int, message: str, errors: list[dict] | None = None) -> JSONResponse:
    """Every API error's body: a message saying what to fix, and per-field errors."""
    return JSONResponse(status_code=status, content={"error": message, "errors": errors or []})


class RefuseNulInURL:
    """ASGI middleware: a path or query string holding a NUL character (%00) gets a 400
    naming it. Nothing can look one up (PostgreSQL refuses NUL in text: a 500 before)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and ("\x00" in scope.get("path", "") or
                                        b"%00" in scope.get("query_string", b"")):
            await error_response(400, "the URL holds a NUL character (%00) in its path or "
                                      "query: remove it")(scope, receive, send)
            return
        await self.app(scope, receive, send)


class RefuseRepeatedQuery:
    """ASGI middleware: a query parameter given twice gets a 422 naming it. FastAPI keeps the
    last value, so `?status=completed&status=failed` listed only failed trials, silently."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("query_string"):
            names = [name for name, _ in parse_qsl(scope["query_string"].decode("latin-1"),
                                                   keep_blank_values=True)]
            repeated = sorted(name for name, n in Counter(names).items() if n > 1)
            if repeated:
                message = (f"query parameter {repeated[0]!r:.60} is given more than once; "
                           "each takes one value: give it once (list again for another)")
                await error_response(422, message, [
                    {"field": f"query.{name:.60}", "message": "given more than once"}
                    for name in repeated[:10]])(scope, receive, send)
                return
        await self.app(scope, receive, send)


class TrailingSlashServed:
    """ASGI middleware: /sweeps/ is served as /sweeps, not redirected to it. Starlette's
    redirect named the URL from the request it saw, so behind a proxy that ends TLS it sent
    clients to http:// (and a client that does not follow a 307 lost its POST). Only "/"
    itself keeps its slash."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            raw = scope.get("raw_path")
            scope = {**scope, "path": path.rstrip("/") or "/"}
            if raw:
                scope["raw_path"] = raw.rstrip(b"/") or b"/"
        await self.app(scope, receive, send)

class HeadAsGet:
    """ASGI middleware: HEAD is answered as GET without its body (RFC 9110 9.3.2: a
    general-purpose server supports it; an uptime check by HEAD /health saw a 405)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: dict) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)



class _BodyTooLarge(Exception):
    """Raised from a request's receive once its body passed the limit."""


def _is_too_large(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(_is_too_large(e) for e in exc.exceptions)
    return isinstance(exc, _BodyTooLarge)


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is refused with a JSON 413 that says
    the limit and its setting, before a handler sees it (a 50 MB description or 200k tags
    never reach the parser): by its Content-Length at once, else as it streams in.
    (FastAPI's own limit answered in plain text, "Content Too Large", from outside every
    middleware that could have said more.)"""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def _refuse(self, scope: dict, receive: Any, send: Any) -> None:
        await error_response(413, (
            f"the request body is over the server's limit of {self.max_bytes} bytes "
            "(HPT_MAX_REQUEST_BYTES): send a smaller spec, or raise the limit where the "
            "server runs"))(scope, receive, send)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        seen, started, over = 0, False, False

        async def counted() -> dict:
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    over = True
                    raise _BodyTooLarge
            return message

        async def tracked(message: dict) -> None:
            nonlocal started
            if over:  # the handler's answer to a body it could not read: ours instead
                if not started:
                    started = True
                    await self._refuse(scope, receive, send)
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except BaseException as exc:
            if started or not _is_too_large(exc):
                raise
            await self._refuse(scope, receive, send)

def allowed_methods(routes: Any, scope: dict) -> list[str]:
    """Every method some route serves at this request's path (the 405's Allow: Starlette's
    names only the first route that matched the path)."""
    from starlette.routing import Match

    served = [method for method in ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")
              if any(route.matches({**scope, "method": method})[0] == Match.FULL
                     for route in routes)]
    if "GET" in served and "HEAD" not in served:  # HeadAsGet answers it
        served.insert(1, "HEAD")
    return served
