"""HTML building blocks: escaping, number formats, boxes, tables and the one page template."""

from __future__ import annotations

import html
import math
import numbers
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from hptransfer.contracts.status import TrialStatus

from .static import plotly_script_tag

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1d2430;
background:#f5f6f8}
header{background:#1d2430;color:#fff;padding:10px 24px;display:flex;gap:16px;align-items:baseline}
header a{color:#9cc4ff;text-decoration:none}header .title{font-size:18px;font-weight:600}
main{padding:16px 24px;max-width:1500px}
section{background:#fff;border:1px solid #dde1e7;border-radius:6px;padding:12px 16px;
margin:0 0 16px}
h2{font-size:16px;margin:0 0 8px}h3{font-size:14px;margin:12px 0 4px}
table{border-collapse:collapse;font-size:13px;margin:4px 0}
th,td{border-bottom:1px solid #e6e8ec;padding:3px 8px;text-align:left;white-space:nowrap}
th{background:#f0f2f5;font-weight:600}td.num{text-align:right;font-variant-numeric:tabular-nums}
td:last-child{white-space:normal;min-width:120px}
.facts{display:flex;flex-wrap:wrap;gap:6px 18px;margin:0 0 8px}.facts b{color:#4a5260}
.nodata{border:1px dashed #c9a227;background:#fffbea;color:#5c4a00;padding:10px 12px;
border-radius:4px;margin:6px 0}
.nodata b{display:block;margin-bottom:2px}
.error{border:1px solid #d33;background:#fdecec;color:#7a1010;padding:8px 12px;border-radius:4px}
.muted{color:#6b7380}.notes{margin:4px 0;padding-left:18px;color:#4a5260;font-size:13px}
.bar{background:#e6e8ec;border-radius:4px;height:12px;min-width:160px;overflow:hidden;
display:flex}
.bar span{display:block;height:100%}
.chip{display:inline-block;border-radius:10px;padding:1px 8px;margin:0 4px 4px 0;font-size:12px;
background:#eef0f3}
.s-completed{background:#2e9d5b;color:#fff}.s-running{background:#2f6fdb;color:#fff}
.s-pending{background:#c4c9d2}.s-diverged{background:#e08a1e;color:#fff}
.s-failed{background:#d13b3b;color:#fff}.s-cancelled{background:#8a8f98;color:#fff}
.s-pruned{background:#7a5cc2;color:#fff}
.v-transfers{color:#1d7a45;font-weight:600}.v-drifts{color:#b3261e;font-weight:600}
.v-inconclusive{color:#8a6d00;font-weight:600}
.grid2{display:grid;grid-template-columns:1fr 1fr;gap:12px}
img.cc{max-width:100%;border:1px solid #e6e8ec}
details summary{cursor:pointer;color:#2f6fdb}
"""

# Any script error becomes a visible red box, so a broken page is never silently blank.
ERROR_HOOK = """<script>
window.addEventListener("error", function (e) {
  var box = document.getElementById("hpt-js-errors");
  if (!box) {
    box = document.createElement("div");
    box.id = "hpt-js-errors"; box.className = "error";
    document.body.insertBefore(box, document.body.firstChild);
  }
  box.appendChild(document.createTextNode("script error: " + e.message + " "));
});
</script>"""

# display order and colour of every trial status (the statuses: hptransfer.contracts.status)
STATUS_COLORS: dict[TrialStatus, str] = {
    TrialStatus.COMPLETED: "#2e9d5b", TrialStatus.RUNNING: "#2f6fdb",
    TrialStatus.PENDING: "#c4c9d2", TrialStatus.DIVERGED: "#e08a1e",
    TrialStatus.FAILED: "#d13b3b", TrialStatus.CANCELLED: "#8a8f98",
    TrialStatus.PRUNED: "#7a5cc2",
}
STATUS_ORDER: tuple[TrialStatus, ...] = tuple(STATUS_COLORS)


def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and not math.isfinite(value))


def fmt(value: Any, digits: int = 3) -> str:
    """Numbers to short text; missing/NaN is '-', never 'nan'."""
    if is_missing(value):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    if hasattr(value, "item"):  # numpy scalars
        return fmt(value.item(), digits)
    return str(value)


def fmt_time(value: Any) -> str:
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return "-" if value is None else str(value)


def fmt_duration(seconds: Any) -> str:
    if is_missing(seconds):
        return "unknown"
    s = max(0, round(float(seconds)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {(s % 3600) // 60:02d} min"


def nodata(message: str, title: str | None = None) -> str:
    """The box shown instead of a figure that cannot be drawn; says what is missing and why."""
    head = f"<b>{esc(title)}</b>" if title else ""
    return f'<div class="nodata">{head}{esc(message)}</div>'


def notes(items: Iterable[str], limit: int = 12) -> str:
    items = list(dict.fromkeys(i for i in items if i))
    if not items:
        return ""
    shown = items[:limit]
    more = f"<li>... and {len(items) - limit} more</li>" if len(items) > limit else ""
    return '<ul class="notes">' + "".join(f"<li>{esc(i)}</li>" for i in shown) + more + "</ul>"


def section(title: str, body: str, anchor: str | None = None) -> str:
    ident = f' id="{esc(anchor)}"' if anchor else ""
    return f"<section{ident}><h2>{esc(title)}</h2>{body}</section>"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], raw: bool = False) -> str:
    """A plain table; cells are escaped unless `raw` (then the caller escaped them)."""
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = []
    for row in rows:
        cells = []
        for cell in row:
            numeric = isinstance(cell, numbers.Number) and not isinstance(cell, bool)
            text = cell if raw and isinstance(cell, str) else esc(fmt(cell))
            cells.append(f'<td class="num">{text}</td>' if numeric else f"<td>{text}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def status_chip(status: str, count: int | None = None) -> str:
    label = status if count is None else f"{status} {int(count)}"
    return f'<span class="chip s-{esc(status)}">{esc(label)}</span>'


def status_chips(counts: dict[str, int]) -> str:
    chips = [status_chip(s, counts[s]) for s in STATUS_ORDER if counts.get(s)]
    return "".join(chips) or '<span class="muted">no trials</span>'


def progress_bar(counts: dict[str, int], total: int) -> str:
    """A stacked bar: one coloured segment per finished/running status."""
    if total <= 0:
        return '<div class="bar" title="no trials"></div>'
    parts = []
    for s in STATUS_ORDER:
        n = int(counts.get(s, 0))
        if n and s != TrialStatus.PENDING:
            parts.append(
                f'<span style="width:{100.0 * n / total:.2f}%;background:{STATUS_COLORS[s]}" '
                f'title="{esc(s)}: {n}"></span>'
            )
    return f'<div class="bar">{"".join(parts)}</div>'


def page(
    title: str,
    body: str,
    *,
    plotly: str | None = "local",
    refresh_s: int | None = None,
    home: str | None = "/dashboards",
    crumb: str = "",
) -> str:
    """The single page template. `plotly`: 'local', 'inline' or None (no figures)."""
    refresh = f'<meta http-equiv="refresh" content="{int(refresh_s)}">' if refresh_s else ""
    script = plotly_script_tag(plotly) if plotly else ""
    link = f'<a href="{esc(home)}">all sweeps</a>' if home else ""
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width,initial-scale=1">{refresh}'
        f"<title>{esc(title)}</title><style>{CSS}</style>{ERROR_HOOK}{script}</head><body>"
        f'<header><span class="title">hptransfer</span>{link}<span>{crumb}</span></header>'
        f"<main>{body}</main>"
        f'<footer class="muted" style="padding:0 24px 16px">rendered {stamp}'
        f"{' &middot; refreshes every ' + str(int(refresh_s)) + ' s' if refresh_s else ''}"
        "</footer></body></html>"
    )
