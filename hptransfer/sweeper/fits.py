"""Fit reports of a sweep: the analysis package applied to the store's results frame.

Cached per (sweep, finished-trial counts, options) so dashboards polling a live sweep do
not refit until a trial finishes.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from hptransfer.analysis import FitReport, fit_report
from hptransfer.analysis.serialize import json_safe
from hptransfer.analysis.staged import is_study_frame, study_fit_report

from .db.store import Store
from .optuna_search import fit_neighbours

log = logging.getLogger(__name__)
_CACHE: dict[tuple, FitReport] = {}
_LOCK = threading.Lock()
_CACHE_SIZE = 64


def sweep_report(
    store: Store, sweep_id: str, bootstrap: int = 100, reference_arm: str | None = None
) -> FitReport:
    counts = tuple(sorted(store.status_counts(sweep_id).items()))
    key = (sweep_id, counts, bootstrap, reference_arm)
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
    frame = store.results_frame(sweep_id)
    sweep = store.get_sweep(sweep_id)
    neighbours = fit_neighbours(sweep.search if sweep is not None else "grid")
    if is_study_frame(frame):  # a staged study: each fit from its own stage
        report = study_fit_report(frame, reference_arm=reference_arm, bootstrap=bootstrap,
                                  neighbours=neighbours)
    else:
        report = fit_report(frame.drop(columns=["stage"]), reference_arm=reference_arm,
                            bootstrap=bootstrap, neighbours=neighbours)
    with _LOCK:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = report
    return report


def fits_payload(report: FitReport) -> dict[str, Any]:
    """JSON for the API: the report, its tables as records, and the text rendering."""
    out = report.to_dict()
    try:
        out["tables"] = {name: json_safe(frame.to_dict(orient="records"))
                         for name, frame in report.tables().items()}
        out["text"] = report.format_text()
    except Exception as exc:  # a rendering bug must not hide the report itself
        log.exception("fit tables failed")
        out.setdefault("failures", []).append(f"tables: {type(exc).__name__}: {exc}")
        out.setdefault("tables", {})
        out.setdefault("text", f"fit tables unavailable ({type(exc).__name__}: {exc})")
    return out


def fits_artifacts(report: FitReport) -> dict[str, str]:
    """What is logged to the sweep's MLflow parent run when it finishes."""
    return {
        "fits/fits.json": json.dumps(fits_payload(report), indent=2, allow_nan=False),
        "fits/fits.txt": report.format_text(),
    }
