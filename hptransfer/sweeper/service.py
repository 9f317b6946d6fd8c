"""The coordinator: store + tracker + dispatcher, and the operations the API, the CLI and
the demo share (submit, summarise, cancel). The API layer only translates HTTP to these."""

from __future__ import annotations

import logging
import time
from typing import Any

from hptransfer.config import Settings, get_settings
from hptransfer.data import DataError, load_dataset

from .admission import admit
from .db.store import Store
from .dispatch import Dispatcher
from .fits import fits_artifacts, fits_payload, sweep_report
from .mlflow.tracking import Tracker
from .plan import plan_sweep, spec_hash
from .spec import SpecError, SweepSpec, load_spec, storable
from .study import initial_state, study_progress

log = logging.getLogger(__name__)

TERMINAL = ("completed", "diverged", "failed", "cancelled", "pruned")


class NotFound(LookupError):
    pass


class Coordinator:
    def __init__(self, settings: Settings | None = None, dispatch: bool = True) -> None:
        self.settings = (settings or get_settings()).ensure_dirs()
        self.store = Store(self.settings.database_url)
        self.store.migrate()
        # an `mlflow server` picks the artifact location itself (proxied: mlflow-artifacts:/);
        # a local path here would bypass it and land on the coordinator's disk
        server = self.settings.mlflow_uri.startswith(("http://", "https://"))
        self.tracker = Tracker(self.settings.mlflow_uri,
                               None if server else str(self.settings.mlflow_artifacts),
                               outbox_dir=str(self.settings.home / "mlflow-outbox"))
        self.dispatcher = (
            Dispatcher(self.store, self.settings, self.tracker,
                       on_sweep_finished=self._sweep_finished)
            if dispatch else None
        )
        # each hook(coordinator, sweep_id) returns artifacts for the sweep's MLflow run
        self.finished_hooks: list = [_fit_artifacts, _dashboard_artifacts]
        self.started_at = time.time()

    def start(self, background: bool = True) -> None:
        if self.dispatcher:
            self.dispatcher.start(background=background)

    def stop(self) -> None:
        if self.dispatcher:
            self.dispatcher.stop()

    # operations ----------------------------------------------------------------------
    def submit(self, source: SweepSpec | dict | str) -> dict[str, Any]:
        """Validate, admit, plan and store a sweep. Everything that can refuse it runs before
        the one transaction that stores the sweep with all its trials, so a refused (or
        failing) submission leaves nothing behind."""
        spec = load_spec(source, max_trials=self.settings.max_trials)
        admit(spec, self.settings)
        stored_spec = storable(spec)
        data_hash = self._data_hash(spec)
        planned = [] if spec.search.method == "optuna" else plan_sweep(spec)
        sweep_id = self.store.create_sweep(
            name=spec.name, spec=stored_spec, spec_hash=spec_hash(spec),
            search=spec.search.method, planned=planned, data_hash=data_hash,
            reuse=spec.reuse, max_attempts=spec.retries + 1,
            study=initial_state(spec, len(planned)) if spec.stages else None,
        )
        if self.dispatcher:
            self.dispatcher.wake()
        return self.summary(sweep_id)

    def _data_hash(self, spec: SweepSpec) -> str:
        try:
            ds = load_dataset(spec.data, cache_dir=self.settings.cache_dir,
                              roots=self.settings.data_roots)
        except DataError as exc:
            field = "data" if spec.data.is_stdlib else "data.source"
            raise SpecError([{"field": field, "message": str(exc)}]) from None
        return ds.content_hash

    def summary(self, sweep_id: str) -> dict[str, Any]:
        sweep = self.store.get_sweep(sweep_id)
        if sweep is None:
            raise NotFound(f"no sweep with id {sweep_id!r}")
        counts = self.store.status_counts(sweep_id)
        total = sum(counts.values())
        done = sum(counts.get(s, 0) for s in TERMINAL)
        spec = SweepSpec.model_validate(sweep["spec"])
        if spec.search.method == "optuna":
            total = max(total, self._optuna_total(spec))
        stages = None
        if spec.stages is not None:  # a study: progress per stage, unplanned ones expected
            stages = study_progress(spec, sweep.get("study") or {},
                                    self.store.stage_counts(sweep_id))
            total = max(total, sum(st["total"] for st in stages))
        return {
            **{k: v for k, v in sweep.items() if k != "spec"},
            "counts": counts,
            "total": total,
            "done": done,
            "progress": done / total if total else 0.0,
            "eta_s": self._eta(sweep_id, total - done, spec.max_concurrent),
            "waiting_for": self.dispatcher.waiting.get(sweep_id) if self.dispatcher else None,
            "stages": stages,
        }

    @staticmethod
    def _optuna_total(spec: SweepSpec) -> int:
        from .plan import plan_shapes

        return len(plan_shapes(spec)) * spec.search.n_trials

    def _eta(self, sweep_id: str, remaining: int, concurrency: int) -> float | None:
        if remaining <= 0:
            return 0.0
        times = [t["wall_time_s"] for t in self.store.trials(sweep_id, status="completed",
                                                              limit=200)
                 if t.get("wall_time_s") and not t.get("reused_from")]
        if not times:
            return None
        return sum(times) / len(times) * remaining / max(1, concurrency)

    def cancel(self, sweep_id: str) -> dict[str, Any]:
        if self.store.get_sweep(sweep_id) is None:
            raise NotFound(f"no sweep with id {sweep_id!r}")
        self.store.cancel_sweep(sweep_id)  # running ones are cancelled by the dispatcher
        if self.dispatcher:
            self.dispatcher.wake()
        return self.summary(sweep_id)

    def fits(self, sweep_id: str, bootstrap: int = 100,
             reference_arm: str | None = None) -> dict[str, Any]:
        if self.store.get_sweep(sweep_id) is None:
            raise NotFound(f"no sweep with id {sweep_id!r}")
        return fits_payload(sweep_report(self.store, sweep_id, bootstrap, reference_arm))

    def _sweep_finished(self, sweep_id: str) -> dict[str, str | bytes]:
        artifacts: dict[str, str | bytes] = {}
        for hook in self.finished_hooks:
            artifacts.update(hook(self, sweep_id) or {})
        return artifacts


def _fit_artifacts(coordinator: Coordinator, sweep_id: str) -> dict[str, str]:
    return fits_artifacts(sweep_report(coordinator.store, sweep_id))


def _dashboard_artifacts(coordinator: Coordinator, sweep_id: str) -> dict[str, str | bytes]:
    from hptransfer.dashboards import dashboard_artifacts  # rendering layer, loaded on use

    return dashboard_artifacts(coordinator, sweep_id)
