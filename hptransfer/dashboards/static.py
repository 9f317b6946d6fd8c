"""Plotly's JavaScript from the installed plotly package: served locally, never from a CDN."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

PLOTLY_ROUTE = "/dashboards/static/plotly.min.js"


def plotly_js_path() -> Path | None:
    """The `plotly.min.js` shipped inside the plotly wheel (None if this build lacks it)."""
    import plotly

    path = Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"
    return path if path.is_file() else None


@lru_cache(maxsize=1)
def plotly_js_text() -> str:
    """The whole library as text (~4.6 MB), for self-contained HTML files."""
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def plotly_script_tag(mode: str) -> str:
    """`inline` embeds the library (offline files); `local` points at the served copy."""
    if mode == "inline":
        # A closing script tag inside the library would end the element early; escape it.
        return "<script>" + plotly_js_text().replace("</script", "<\\/script") + "</script>"
    if mode == "local":
        return f'<script src="{PLOTLY_ROUTE}"></script>'
    raise ValueError(f"plotly mode must be 'inline' or 'local', got {mode!r}")
