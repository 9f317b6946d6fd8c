"""HTML dashboards of sweeps: pure rendering from plain data (summary, trials, FitReport).

Served by `hptransfer.api.dashboards` under /dashboards; `write_sweep_dashboard` writes a
self-contained file and `dashboard_artifacts` returns what is logged to MLflow.
"""

from .export import dashboard_artifacts, store_summary, sweep_data, write_sweep_dashboard
from .pages import (
    render_busy_html,
    render_index_html,
    render_not_found_html,
    render_sweep_html,
)
from .static import PLOTLY_ROUTE, plotly_js_path, plotly_js_text

__all__ = [
    "PLOTLY_ROUTE",
    "dashboard_artifacts",
    "plotly_js_path",
    "plotly_js_text",
    "render_busy_html",
    "render_index_html",
    "render_not_found_html",
    "render_sweep_html",
    "store_summary",
    "sweep_data",
    "write_sweep_dashboard",
]
