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
from hptransfer.analysis.noise import ETA_CI_LOG2
from hptransfer.analysis.staged import is_study_frame
from hptransfer.analysis.study_report import study_fit_report
from hptransfer.jsonsafe import json_safe
from hptransfer.spec.stages import STAGE_ORDER
from hptransfer.store.store import Store

from .gate import Busy, Gate, half_the_cores
from .optuna_search import fit_neighbours

log = logging.getLogger(__name__)
_CACHE: dict[tuple, FitReport] = {}
_LOCK = threading.Lock()
_CACHE_SIZE = 64
# A report not in the cache can take seconds of CPU and hundreds of MB (bootstrap 2000 on
# 5000 trials: ~5 s, ~0.6 GB), each in one of the server's request threads: at most
# MAX_COMPUTING are computed at once, identical requests share one computation, and past
# MAX_ADMITTED requests waiting for reports a request is refused (FitsBusy: 503).
MAX_COMPUTING = half_the_cores()
MAX_ADMITTED = 4 * MAX_COMPUTING
_KEY_LOCKS: dict[tuple, threading.Lock] = {}  # one computation per key at a time


class FitsBusy(Busy):
    """Too many fit reports are being computed for this request to wait its turn."""


GATE = Gate(MAX_COMPUTING, MAX_ADMITTED, FitsBusy, "fit reports are being computed or "
            "waited for; retry in a few seconds (a lower bootstrap is faster)")


def sweep_report(
    store: Store, sweep_id: str, bootstrap: int = 100, reference_arm: str | None = None,
    wait: bool = False,
) -> FitReport:
    """The sweep's fit report, from the cache when its finished trials have not changed.
    A miss waits for a computation slot; with `wait=False` (a request) FitsBusy is raised
    at once when MAX_ADMITTED requests are already waiting or computing."""
    counts = tuple(sorted(store.status_counts(sweep_id).items()))
    key = (sweep_id, counts, bootstrap, reference_arm)
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
    with GATE.admit(wait):
        with _LOCK:
            lock = _KEY_LOCKS.setdefault(key, threading.Lock())
        with lock:  # identical requests queue behind one computation and reuse it
            with _LOCK:
                if key in _CACHE:
                    return _CACHE[key]
            try:
                with GATE.compute():
                    report = _compute(store, sweep_id, bootstrap, reference_arm)
            except BaseException:
                with _LOCK:  # nothing cached under it: its lock goes too
                    _KEY_LOCKS.pop(key, None)
                raise
            with _LOCK:
                if len(_CACHE) >= _CACHE_SIZE:
                    _KEY_LOCKS.pop(next(iter(_CACHE)), None)
                    _CACHE.pop(next(iter(_CACHE)))
                _CACHE[key] = report
            return report


def _compute(store: Store, sweep_id: str, bootstrap: int,
             reference_arm: str | None) -> FitReport:
    frame = store.results_frame(sweep_id)
    sweep = store.get_sweep(sweep_id)
    neighbours = fit_neighbours(sweep.search if sweep is not None else "grid")
    # the spec's reliability width (analysis.eta_ci_log2); older stored specs lack it
    analysis = ((sweep.spec or {}).get("analysis") or {}) if sweep is not None else {}
    width = float(analysis.get("eta_ci_log2", ETA_CI_LOG2))
    if is_study_frame(frame):  # a staged study: each fit from its own stage
        report = study_fit_report(frame, reference_arm=reference_arm, bootstrap=bootstrap,
                                  neighbours=neighbours, max_ci_log2=width)
        report.targets = study_targets(sweep.study if sweep is not None else None)
        return report
    return fit_report(frame.drop(columns=["stage"]), reference_arm=reference_arm,
                      bootstrap=bootstrap, neighbours=neighbours, max_ci_log2=width)


def study_targets(study: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The study's stage targets as its planner recorded them (coordinator/targets.py:
    each with its items met or not, and the extra trials spent), in stage order."""
    recorded = (study or {}).get("targets") or {}
    return [recorded[s] for s in STAGE_ORDER if s in recorded]


def fits_payload(report: FitReport) -> dict[str, Any]:
    """JSON for the API: the report, its tables as records, and the text rendering."""
    out = report.to_dict()
    try:
        tables = report.tables()
        out["tables"] = {name: json_safe(frame.to_dict(orient="records"))
                         for name, frame in tables.items()}
        # records of an empty table lose its columns: the client rebuilds frames with them
        out["table_columns"] = {name: [str(c) for c in frame.columns]
                                for name, frame in tables.items()}
        out["text"] = report.format_text()
    except Exception as exc:  # a rendering bug must not hide the report itself
        log.exception("fit tables failed")
        out["failures"] = {**out.get("failures", {}), "tables": f"{type(exc).__name__}: {exc}"}
        out.setdefault("tables", {})
        out.setdefault("text", f"fit tables unavailable ({type(exc).__name__}: {exc})")
    return out


def fits_artifacts(report: FitReport) -> dict[str, str]:
    """What is logged to the sweep's MLflow parent run when it finishes."""
    return {
        "fits/fits.json": json.dumps(fits_payload(report), indent=2, allow_nan=False),
        "fits/fits.txt": report.format_text(),
    }
