"""Dashboards outside the server: a self-contained HTML file, and artifacts for MLflow.

Both accept a Coordinator or a bare Store: `dashboard_artifacts` has the signature of a
Coordinator finished-hook, so `coordinator.finished_hooks.append(dashboard_artifacts)` logs
the dashboard with the sweep's MLflow run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hptransfer.analysis import FitReport
from hptransfer.contracts.status import TrialStatus
from hptransfer.coordinator.fits import sweep_report
from hptransfer.store.store import NotFoundError, Store

from .pages import render_sweep_html
from .pngs import frontier_png, lr_png
from .progress import FAILED_SHOWN

# Enough for the tables (running now + recent failures) without reading a huge sweep.
NOTABLE_LIMIT = 500


@dataclass
class SweepData:
    """Everything one sweep page is drawn from."""

    summary: dict[str, Any]
    trials: list[dict[str, Any]]
    report: FitReport
    coordcheck_dir: Path | None


def store_summary(store: Store, sweep_id: str) -> dict[str, Any]:
    """The Coordinator's summary, from the store alone (no ETA: that needs the spec)."""
    sweep = store.get_sweep(sweep_id)
    if sweep is None:
        raise NotFoundError(f"no sweep with id {sweep_id!r:.80}")
    counts = sweep.counts if sweep.counts is not None else store.status_counts(sweep_id)
    total = sum(counts.values())
    done = sum(n for s, n in counts.items() if TrialStatus(s).is_finished())
    summary = {k: v for k, v in sweep.to_dict().items() if k != "spec"}
    summary.update(counts=counts, total=total, done=done,
                   progress=done / total if total else 0.0, eta_s=None)
    if sweep.study is not None:  # a study: each stage's progress, as the API has it
        from hptransfer.coordinator.study import study_progress
        from hptransfer.spec import SweepSpec

        summary["stages"] = study_progress(SweepSpec.model_validate(sweep.spec),
                                           sweep.study, store.stage_counts(sweep_id),
                                           sweep.status)
    return summary


def _coordcheck_dir(source: Any) -> Path | None:
    settings = getattr(source, "settings", None)
    if settings is None:
        from hptransfer.config import get_settings

        settings = get_settings()
    return Path(settings.home) / "coordcheck"


def sweep_data(source: Any, sweep_id: str, bootstrap: int = 100,
               wait: bool = False) -> SweepData:
    """`source` is a Coordinator (summary with ETA) or a Store; LookupError if unknown.
    `wait`: for a report not cached, wait for a computation slot rather than raise FitsBusy
    (a file or an artifact being written, not a request)."""
    store: Store = getattr(source, "store", source)
    summary = source.summary(sweep_id) if hasattr(source, "summary") \
        else store_summary(store, sweep_id)
    # the pages render plain mappings: the records are serialised here, at the boundary
    # every running trial (up to NOTABLE_LIMIT), then the last failures in plan order: one
    # query for both let a sweep's first 500 failures hide whatever was running after them
    failed = int((summary.get("counts") or {}).get(TrialStatus.FAILED, 0))
    rows = (store.trials(sweep_id, status=TrialStatus.RUNNING, limit=NOTABLE_LIMIT, curves=False)
            + store.trials(sweep_id, status=TrialStatus.FAILED, limit=FAILED_SHOWN,
                           offset=max(0, failed - FAILED_SHOWN), curves=False))
    trials = [t.to_dict() for t in rows]
    report = sweep_report(store, sweep_id, bootstrap, wait=wait)  # cached per trial counts
    return SweepData(summary, trials, report, _coordcheck_dir(source))


def _offline_html(data: SweepData) -> str:
    # Inline plotly.js, no auto-refresh, no links to a server that may not be running.
    return render_sweep_html(data.summary, data.trials, data.report, plotly="inline",
                             coordcheck_dir=data.coordcheck_dir, refresh_s=0, home=None)


def write_sweep_dashboard(
    source: Any, sweep_id: str, out_dir: str | Path, bootstrap: int = 100
) -> Path:
    """Write `out_dir/index.html`, self-contained (opens offline); returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "index.html"
    path.write_text(_offline_html(sweep_data(source, sweep_id, bootstrap, wait=True)),
                    encoding="utf-8")
    return path


def dashboard_artifacts(source: Any, sweep_id: str, bootstrap: int = 100) -> dict[str, str | bytes]:
    """{"dashboards/sweep.html": ..., "dashboards/loss_vs_lr.png": ..., ...frontier.png}.

    A PNG is left out when its figure has no data (the HTML says why).
    """
    data = sweep_data(source, sweep_id, bootstrap, wait=True)
    out: dict[str, str | bytes] = {"dashboards/sweep.html": _offline_html(data)}
    for name, draw in (("loss_vs_lr", lr_png), ("frontier", frontier_png)):
        png = draw(data.report)
        if png is not None:
            out[f"dashboards/{name}.png"] = png
    return out
