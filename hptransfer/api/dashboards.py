"""HTML dashboard routes under /dashboards; the rendering lives in `hptransfer.dashboards`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, Response

from hptransfer.coordinator.fits import FitsBusy
from hptransfer.dashboards import (
    plotly_js_path,
    plotly_js_text,
    render_busy_html,
    render_index_html,
    render_not_found_html,
    render_sweep_html,
    sweep_data,
)

from .reads import check_bootstrap, require_reader
from .routes import NOT_MODIFIED, coordinator
from .schemas import json_errors

router = APIRouter(prefix="/dashboards", tags=["dashboards"])
# with HPT_API_TOKEN set, a page needs the token like every read, unless HPT_PUBLIC_READS=1
# (a browser sends no bearer token: see docs/how-to/deploy.md for viewing them otherwise)
_READ = [Depends(require_reader)]
INDEX_LIMIT = 200
# plotly.js only changes with the installed package: let browsers keep it for a day.
_JS_HEADERS = {"Cache-Control": "public, max-age=86400"}
# a page's own errors are pages; the URL's (a bad query, the database down) are JSON
_HTML_ERRORS: dict[int | str, dict] = {
    **json_errors(401, 422),
    404: {"description": "No sweep with this id (a page saying so)",
          "content": {"text/html": {"schema": {"type": "string"}}}},
    503: {"description": "Too many fit reports are being computed (a page saying so; "
                         "Retry-After), or the app database is unavailable (JSON)",
          "headers": {"Retry-After": {"schema": {"type": "integer"}}},
          "content": {"text/html": {"schema": {"type": "string"}},
                      "application/json": {"schema": {
                          "$ref": "#/components/schemas/ErrorResponse"}}}},
}


@router.get("", response_class=HTMLResponse, responses={**NOT_MODIFIED, **json_errors(401)},
            dependencies=_READ)
async def dashboards_index(request: Request) -> Response:
    """Every sweep with its status, progress and a link to its dashboard (rendered once per
    change, with an ETag: see `hptransfer.api.listing`)."""
    c = coordinator(request)

    def build() -> bytes:
        return render_index_html(c.summaries(limit=INDEX_LIMIT)).encode()

    return await request.app.state.listings.respond(request, ("dashboards",), build,
                                                    "text/html")


@router.get("/sweeps/{sweep_id}", response_class=HTMLResponse, responses=_HTML_ERRORS,
            dependencies=_READ)
def sweep_dashboard(
    request: Request,
    sweep_id: str,
    bootstrap: Annotated[int, Query(ge=0, le=2000)] = 100,
) -> HTMLResponse:
    """Live progress, loss-vs-LR curves, transfer drift, frontier, savings, N:L (a visitor
    without the token, on a server with public reads: at the default bootstrap only)."""
    check_bootstrap(request, bootstrap)
    c = coordinator(request)
    try:
        data = sweep_data(c, sweep_id, bootstrap)
    except LookupError:
        return HTMLResponse(render_not_found_html(f"No sweep with id {sweep_id!r:.80}."), 404)
    except FitsBusy as exc:
        return HTMLResponse(render_busy_html(str(exc)), 503,
                            headers={"Retry-After": str(exc.retry_after_s)})
    html = render_sweep_html(data.summary, data.trials, data.report,
                             coordcheck_dir=data.coordcheck_dir)
    return HTMLResponse(html)


@router.get("/static/plotly.min.js", include_in_schema=False)
def plotly_js() -> Response:
    """The plotly.js of the installed plotly package: the pages never need the internet."""
    path = plotly_js_path()
    if path is not None:
        return FileResponse(path, media_type="application/javascript", headers=_JS_HEADERS)
    return Response(plotly_js_text(), media_type="application/javascript", headers=_JS_HEADERS)
