"""create_app: the FastAPI application with its coordinator and error handlers."""

from __future__ import annotations

import gc
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from hptransfer.config import Settings, get_settings
from hptransfer.coordinator.gate import Busy
from hptransfer.coordinator.service import Coordinator
from hptransfer.dashboards import dashboard_artifacts
from hptransfer.spec import SpecError
from hptransfer.store.store import NotFoundError

from .auth import AuthThrottle
from .dashboards import router as dashboards_router
from .guards import (
    BodyLimit,
    HeadAsGet,
    RefuseNulInURL,
    RefuseRepeatedQuery,
    TrailingSlashServed,
    allowed_methods,
    error_response,
)
from .health import remember_mlflow_store
from .listing import ListingCache
from .pages import SecurityHeaders, install_docs
from .routes import router
from .schemas import sweep_spec_components

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None, dispatch: bool = True,
               freeze_gc: bool = False) -> FastAPI:
    """`freeze_gc`: for a process that serves this app alone (`hpt serve`): once started,
    move every object then alive out of the garbage collector's reach (gc.freeze)."""
    settings = settings or get_settings()
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.coordinator = Coordinator(settings, dispatch=dispatch)
        # assembled here: the dashboards land on each finished sweep's MLflow parent run
        app.state.coordinator.finished_hooks.append(dashboard_artifacts)
        if freeze_gc:
            _import_what_threads_import_later()
        app.state.coordinator.start()
        app.state.listings = ListingCache(app.state.coordinator.listing_version)
        remember_mlflow_store(app)
        if freeze_gc:
            _freeze_long_lived()
        try:
            yield
        finally:
            app.state.coordinator.stop()
            app.state.mlflow_store.close()

    app = FastAPI(
        title="hptransfer",
        version="0.1.0",
        description="Hyper-parameter transfer sweeps: submit, watch, cancel; fits and dashboards.",
        lifespan=lifespan,
        redirect_slashes=False,  # a trailing slash is served, not redirected (guards.py)
        docs_url=None, redoc_url=None,  # served from the package instead (pages.py)
    )
    app.state.auth_throttle = AuthThrottle(settings.auth_failures)
    app.include_router(router)
    app.include_router(dashboards_router)
    install_docs(app)
    app.add_middleware(RefuseRepeatedQuery)
    app.add_middleware(RefuseNulInURL)
    app.add_middleware(HeadAsGet)
    app.add_middleware(TrailingSlashServed)
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_bytes)
    app.add_middleware(SecurityHeaders)  # outermost: every answer carries its headers
    _install_error_handlers(app)
    _publish_sweep_spec(app)
    return app


def _publish_sweep_spec(app: FastAPI) -> None:
    """/openapi.json with the sweep spec's schema among its components (POST /sweeps' body)."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            spec = sweep_spec_components()
            if clash := sorted(set(spec) & set(components)):  # one name, two schemas
                raise RuntimeError(f"sweep spec schema names taken in the API's: {clash}")
            components.update(spec)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _import_what_threads_import_later() -> None:
    """The MLflow client the mirror thread opens on its first pass: imported (and its ORM
    mappers configured) here, before that thread starts, so it is frozen with the rest.
    Never while the thread runs: two threads importing mlflow at once deadlock."""
    import mlflow.tracking  # noqa: F401
    from mlflow.store.tracking import sqlalchemy_store  # noqa: F401
    from sqlalchemy.orm import configure_mappers

    configure_mappers()


def _freeze_long_lived() -> None:
    """Torch, Ray, MLflow and pandas leave ~0.5 M objects that live as long as the process;
    every full collection walked them all, holding the GIL for 0.1-0.4 s (seen every few
    seconds under load: the listings' p99). Frozen (gc.freeze), collections skip them."""
    gc.collect()
    gc.freeze()


# FastAPI's words when json.loads fails other than by syntax (JSON's syntax errors come as a
# RequestValidationError with their position)
_FASTAPI_UNPARSED_BODY = "There was an error parsing the body"
_UNPARSED_BODY = ("the body is JSON this server cannot read: nested too deeply, or an integer "
                  "of more than 4300 digits; a sweep spec needs neither")
_NOT_UTF8_BODY = "the body is not UTF-8 text; send the JSON encoded as UTF-8"


def _detail(err: dict) -> str:
    # A JSON syntax error carries its reason in ctx and its character offset in loc
    # ("body", 1): "JSON decode error" alone says little, and "body.1" reads as a field
    cause = (err.get("ctx") or {}).get("error")
    if err.get("type") == "json_invalid" and len(err["loc"]) == 2:
        return f"invalid JSON at character {err['loc'][1]}: {cause}"
    return f"{err['msg']}: {cause}" if isinstance(cause, str) else err["msg"]


def _field(err: dict) -> str:
    if err.get("type") == "json_invalid":
        return "body"
    return ".".join(str(p) for p in err["loc"])


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(SpecError)
    async def spec_error(_: Request, exc: SpecError) -> JSONResponse:
        return error_response(422, "invalid sweep spec: " + "; ".join(
            f"{e['field']}: {e['message']}" for e in exc.errors), exc.errors)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        allowed = (allowed_methods(request.app.router.routes, request.scope)
                   if exc.status_code == 405 else [])
        if allowed:
            use = " or ".join([", ".join(allowed[:-1]), allowed[-1]] if len(allowed) > 1
                              else allowed)
            response = error_response(405, f"{request.method} is not served at "
                                           f"{request.url.path}: use {use}")
            response.headers["Allow"] = ", ".join(allowed)
            return response
        detail = str(exc.detail)
        if exc.status_code == 400 and detail == _FASTAPI_UNPARSED_BODY:
            # its cause (exc.__cause__) is not shown: say what it is, or what it can be
            detail = (_NOT_UTF8_BODY if isinstance(exc.__cause__, UnicodeDecodeError)
                      else _UNPARSED_BODY)
        response = error_response(exc.status_code, detail)
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(Busy)
    async def busy(_: Request, exc: Busy) -> JSONResponse:
        response = error_response(503, str(exc))
        response.headers["Retry-After"] = str(exc.retry_after_s)
        return response

    @app.exception_handler(NotFoundError)
    async def not_found(_: Request, exc: NotFoundError) -> JSONResponse:
        return error_response(404, str(exc))

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"field": _field(e), "message": _detail(e)} for e in exc.errors()]
        return error_response(422, "invalid request: " + "; ".join(
            f"{e['field']}: {e['message']}" for e in errors), errors)

    @app.exception_handler(DataError)
    async def unstorable_value(_: Request, exc: DataError) -> JSONResponse:
        # a value from the request the database cannot take (the spec and URL checks
        # should have refused it first: logged as the gap it is)
        log.error("database refused a value: %s", exc)
        return error_response(400, "the database cannot store a value in this request (e.g. a "
                           "control character or a number out of range): remove or fix it")

    @app.exception_handler(OperationalError)
    async def database_down(_: Request, exc: OperationalError) -> JSONResponse:
        log.error("database error: %s", exc)
        return error_response(503, "the database is unavailable; retry shortly")

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return error_response(500, f"internal error ({type(exc).__name__}); see the server log")
