"""Sweep list and live progress: counts by status, running trials, recent failures, ETA."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from hptransfer.contracts.status import ACTIVE, TrialStatus

from .html import (
    esc,
    fmt,
    fmt_duration,
    fmt_time,
    nodata,
    progress_bar,
    section,
    status_chip,
    status_chips,
    table,
)

TrialRows = Sequence[Mapping[str, Any]] | pd.DataFrame


def is_active(summary: Mapping[str, Any]) -> bool:
    return summary.get("status") in ACTIVE


def as_records(trials: TrialRows | None) -> list[dict[str, Any]]:
    if trials is None:
        return []
    if isinstance(trials, pd.DataFrame):
        return trials.to_dict(orient="records")
    return [dict(t) for t in trials]


def _trial_id(trial: Mapping[str, Any]) -> Any:
    # store rows call it `id`, results frames `trial_id`
    return trial.get("id") or trial.get("trial_id")


def _lr(value: Any) -> str:
    try:
        lr = float(value)
    except (TypeError, ValueError):
        return "-"
    return f"{lr:.3g} (2^{math.log2(lr):.1f})" if lr > 0 else fmt(lr)


def _done_text(summary: Mapping[str, Any]) -> str:
    total, done = int(summary.get("total") or 0), int(summary.get("done") or 0)
    pct = 100.0 * done / total if total else 0.0
    return f"{done} / {total} ({pct:.0f}%)"


def sweeps_table(summaries: Sequence[Mapping[str, Any]], base: str = "/dashboards") -> str:
    if not summaries:
        return nodata("no sweeps yet: submit one with `hpt submit spec.yaml` or POST /sweeps",
                      "Nothing to show")
    rows = []
    for s in summaries:
        counts = s.get("counts") or {}
        link = f'<a href="{esc(base)}/sweeps/{esc(s["id"])}">{esc(s.get("name") or s["id"])}</a>'
        eta = fmt_duration(s.get("eta_s")) if is_active(s) else ""
        rows.append([
            link, f"<code>{esc(s['id'])}</code>", status_chip(str(s.get("status", "?"))),
            progress_bar(counts, int(s.get("total") or 0)), esc(_done_text(s)),
            status_chips(counts), esc(fmt_time(s.get("created_at"))), esc(eta),
        ])
    head = ["sweep", "id", "status", "progress", "done", "trials by status", "created", "ETA"]
    return table(head, rows, raw=True)


def _facts(summary: Mapping[str, Any]) -> str:
    items = [
        ("status", summary.get("status")),
        ("trials", summary.get("total")),
        ("done", _done_text(summary)),
        ("created", fmt_time(summary.get("created_at"))),
        ("started", fmt_time(summary.get("started_at"))),
        ("finished", fmt_time(summary.get("finished_at"))),
    ]
    if is_active(summary):
        eta = summary.get("eta_s")
        items.append(("ETA", fmt_duration(eta) if eta is not None
                      else "unknown until a trial completes"))
    if summary.get("mlflow_run_id"):
        items.append(("MLflow run", summary["mlflow_run_id"]))
    cells = "".join(f"<span><b>{esc(k)}</b> {esc(fmt(v))}</span>" for k, v in items)
    return f'<div class="facts">{cells}</div>'


FAILED_SHOWN = 10  # the failed trials listed (the last ones in plan order)


def _last_error_line(trial: Mapping[str, Any]) -> str:
    error = trial.get("error")
    lines = error.strip().splitlines() if isinstance(error, str) else []  # NaN in a frame
    return lines[-1][:200] if lines else "-"


def progress_section(summary: Mapping[str, Any], trials: TrialRows | None) -> str:
    counts = summary.get("counts") or {}
    parts = [_facts(summary), progress_bar(counts, int(summary.get("total") or 0)),
             f"<p>{status_chips(counts)}</p>"]
    if summary.get("error"):
        parts.append(f'<div class="error">{esc(summary["error"])}</div>')
    if summary.get("stages"):  # a study: each stage's progress, in order
        rows = [[esc(st["stage"]), esc(st["state"]), f"{st['done']}/{st['total']}",
                 status_chips(st["counts"])] for st in summary["stages"]]
        parts.append('<h3>Stages</h3><div class="stages">'
                     + table(["stage", "state", "done", "trials"], rows, raw=True) + "</div>")
    records = as_records(trials)
    running = [t for t in records if t.get("status") == TrialStatus.RUNNING]
    if running:
        rows = [[_trial_id(t), t.get("arm"), t.get("width"), t.get("depth"), _lr(t.get("lr")),
                 t.get("seed"), t.get("attempts"), fmt_time(t.get("started_at")),
                 t.get("worker_node") or "-"] for t in running]
        head = ["trial", "arm", "width", "depth", "lr", "seed", "attempt", "started", "worker"]
        parts.append(f"<h3>Running now ({len(running)})</h3>" + table(head, rows))
    elif is_active(summary):
        parts.append('<p class="muted">No trial is running at this moment.</p>')
    failed = [t for t in records if t.get("status") == TrialStatus.FAILED]
    if failed:
        rows = [[_trial_id(t), t.get("arm"), t.get("width"), t.get("depth"), _lr(t.get("lr")),
                 t.get("seed"), _last_error_line(t)] for t in failed[-FAILED_SHOWN:]]
        # the page holds the last
        n_failed = max(int(counts.get(TrialStatus.FAILED, 0)), len(failed))
        shown = f"the last {len(rows)}, " if n_failed > len(rows) else ""
        parts.append(f"<h3>Failed trials ({n_failed}; {shown}last error line)</h3>"
                     + table(["trial", "arm", "width", "depth", "lr", "seed", "error"], rows))
    return section("Progress", "".join(parts), "progress")
