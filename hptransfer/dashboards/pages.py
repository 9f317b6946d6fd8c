"""Whole pages: the sweep list, one sweep's dashboard, and the not-found page."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hptransfer.analysis import FitReport

from . import sections
from .html import esc, notes, page, section
from .progress import TrialRows, is_active, progress_section, sweeps_table

log = logging.getLogger(__name__)

DEFAULT_REFRESH_S = 5
_NAV = (("progress", "progress"), ("lr", "loss vs LR"), ("transfer", "transfer drift"),
        ("frontier", "frontier"), ("savings", "FLOP savings"), ("aspect", "N:L"),
        ("coordcheck", "coord checks"))
# a staged study's page: its stages in order (tune, check, transfer ladder, aspect ratio)
_STUDY_NAV = (("progress", "progress"), ("headline", "headline"), ("lr", "tune"),
              ("check", "transfer check"), ("frontier", "frontier (ladder)"),
              ("savings", "savings (ladder)"), ("aspect", "N:L"))


def _guarded(title: str, build: Callable[[], str]) -> str:
    """A bug in one section becomes a red box in that section, not a 500 for the page."""
    try:
        return build()
    except Exception as exc:
        log.exception("dashboard section %r failed", title)
        return section(title, f'<div class="error">could not render {esc(title)}: '
                              f"{esc(type(exc).__name__)}: {esc(exc)}</div>")


def _plotly_mode(body: str, plotly: str) -> str | None:
    # Pages without a figure (an empty sweep) need not load 4.6 MB of JavaScript.
    return plotly if "Plotly.newPlot" in body else None


def render_index_html(
    summaries: Sequence[Mapping[str, Any]], *, home: str = "/dashboards"
) -> str:
    active = any(is_active(s) for s in summaries)
    body = section("Sweeps", _guarded("Sweeps", lambda: sweeps_table(summaries, home)))
    return page("hptransfer sweeps", body, plotly=None,
                refresh_s=DEFAULT_REFRESH_S if active else None, home=home)


def render_sweep_html(
    summary: Mapping[str, Any],
    trials: TrialRows | None,
    report: FitReport | None,
    *,
    plotly: str = "local",
    coordcheck_dir: Path | None = None,
    refresh_s: int = DEFAULT_REFRESH_S,
    home: str | None = "/dashboards",
) -> str:
    """One sweep's dashboard. `plotly`: 'local' (served script) or 'inline' (offline file).

    `trials` may be every trial or just the running/failed ones (the tables use those).
    Refreshes itself every `refresh_s` seconds while the sweep is pending or running.
    """
    name = str(summary.get("name") or summary.get("id"))
    study = report is not None and bool(report.stages)
    nav = " · ".join(f'<a href="#{a}">{esc(t)}</a>' for a, t in (_STUDY_NAV if study else _NAV))
    parts = [f"<p><b>{esc(name)}</b> <code>{esc(summary.get('id'))}</code> · {nav}</p>"]
    parts.append(_guarded("Progress", lambda: progress_section(summary, trials)))
    if report is not None and (report.warnings or report.failures):
        failed = [f"{k} failed: {v}" for k, v in report.failures.items()]
        parts.append(section("Fit notes", notes([*failed, *report.warnings])))
    builders: list[tuple[str, Callable[[], str]]] = [
        ("Study headline", lambda: sections.headline_section(report)),
        ("Tune", lambda: sections.lr_section(report)),
        ("Transfer check", lambda: sections.check_section(report)),
        ("Loss vs compute", lambda: sections.frontier_section(report)),
        ("FLOP savings", lambda: sections.savings_section(report)),
        ("Compute-optimal N:L", lambda: sections.aspect_section(report)),
    ] if study else [
        ("Loss vs learning rate", lambda: sections.lr_section(report)),
        ("Transfer drift", lambda: sections.transfer_section(report)),
        ("Loss vs compute", lambda: sections.frontier_section(report)),
        ("FLOP savings", lambda: sections.savings_section(report)),
        ("Compute-optimal N:L", lambda: sections.aspect_section(report)),
        ("Coordinate checks", lambda: sections.coordcheck_section(coordcheck_dir)),
    ]
    parts += [_guarded(title, build) for title, build in builders]
    body = "".join(parts)
    return page(
        f"{name} · hptransfer", body, plotly=_plotly_mode(body, plotly),
        refresh_s=refresh_s if is_active(summary) and refresh_s else None, home=home,
        crumb=f"sweep {esc(name)}",
    )


def render_busy_html(why: str, home: str = "/dashboards") -> str:
    body = section("Busy", f"<p>{esc(why)}</p><p>This page reloads in a few seconds.</p>"
                           f"<p><a href=\"{esc(home)}\">Back to all sweeps</a></p>")
    return page("busy · hptransfer", body, plotly=None, home=home).replace(
        "<head>", '<head><meta http-equiv="refresh" content="5">', 1)


def render_not_found_html(what: str, home: str = "/dashboards") -> str:
    body = section("Not found", f"<p>{esc(what)}</p><p><a href=\"{esc(home)}\">"
                                "Back to all sweeps</a></p>")
    return page("not found · hptransfer", body, plotly=None, home=home)
