"""The coordinator: store + dispatcher + MLflow mirror, and the operations the API, the CLI
and the demo share (submit, summarise, cancel). The API layer only translates HTTP to these.

Whoever assembles the application adds its sweep-finished artifact hooks (the dashboards)
to `finished_hooks`; the coordinator itself knows only the fits."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from hptransfer.config import Settings, get_settings
from hptransfer.contracts.status import TrialStatus
from hptransfer.data import DataError, load_dataset
from hptransfer.spec import SpecError, SweepSpec, load_spec, storable
from hptransfer.spec.cache import SpecCache
from hptransfer.store.changes import CommitCounter
from hptransfer.store.store import IdempotencyConflict, NotFoundError, Store, SweepRecord
from hptransfer.tracking.mirror import Mirror
from hptransfer.tracking.tracking import prepare_sqlite_store

from .admission import admit
from .dispatch import Dispatcher
from .fits import fits_artifacts, fits_payload, sweep_report
from .gate import Busy, Gate, half_the_cores
from .health import check_service
from .plan import plan_shapes, plan_sweep, spec_hash
from .pricing import cluster_now, cost_message, may_exceed, price
from .study import initial_state, study_progress

log = logging.getLogger(__name__)


class DataBusy(Busy):
    """Too many submissions are preparing their data for this one to wait its turn."""


# Preparing a submission's data (reading and hashing a corpus, training a BPE tokenizer on
# a cache miss: seconds of CPU) runs in a request thread; bounded like fit reports, so a
# flood of submissions with new tokenizer settings takes half the cores, not all of them
DATA_GATE = Gate(half_the_cores(), 4 * half_the_cores(), DataBusy,
                 "submissions are preparing their data; retry in a few seconds")


IDEMPOTENCY_HEADER = "Idempotency-Key"
MAX_IDEMPOTENCY_KEY = 255  # characters (the column's width)


def idempotency(key: str, source: SweepSpec | dict | str) -> tuple[str, str]:
    """(key, sha256 of the body) for an Idempotency-Key; SpecError naming the header when
    the key is empty, too long or not printable ASCII. The body is hashed as canonical
    JSON, so the same spec sent with its keys in another order is the same body."""
    if not key or len(key) > MAX_IDEMPOTENCY_KEY or not all(" " < c <= "~" for c in key):
        raise SpecError([{"field": IDEMPOTENCY_HEADER, "message": (
            f"must be 1 to {MAX_IDEMPOTENCY_KEY} printable ASCII characters without spaces "
            "(e.g. a UUID)")}])
    if isinstance(source, SweepSpec):
        body = source.model_dump_json()
    elif isinstance(source, str):
        body = source
    else:
        body = json.dumps(source, sort_keys=True, separators=(",", ":"), default=str)
    return key, hashlib.sha256(body.encode("utf-8", "surrogatepass")).hexdigest()


class UnknownArm(ValueError):
    """A request named an arm the sweep does not have."""

# hook(coordinator, sweep_id) -> artifacts ({"dashboards/sweep.html": ...}) for the parent run
FinishedHook = Callable[[Any, str], Mapping[str, str | bytes]]


class Coordinator:
    def __init__(self, settings: Settings | None = None, dispatch: bool = True) -> None:
        self.settings = check_service(settings or get_settings())
        self.store = Store(self.settings.database_url)
        self.store.migrate()
        self.changes = CommitCounter(self.store.engine)  # the listings' cache key
        self.finished_hooks: list[FinishedHook] = [_fit_artifacts]
        try:  # the local MLflow store exists from the start (mlflow ui and /health open it)
            prepare_sqlite_store(self.settings.mlflow_uri)
        except ConnectionError as exc:
            log.warning("MLflow store not ready: %s", exc)
        # an `mlflow server` picks the artifact location itself (proxied: mlflow-artifacts:/);
        # a local path here would bypass it and land on the coordinator's disk
        server = self.settings.mlflow_uri.startswith(("http://", "https://"))
        # only the dispatching coordinator mirrors: one writer of MLflow per app database
        self.mirror = (
            Mirror(self.store, self.settings.mlflow_uri,
                   None if server else str(self.settings.mlflow_artifacts),
                   artifacts=self._sweep_finished)
            if dispatch else None
        )
        self.dispatcher = Dispatcher(self.store, self.settings, self.mirror) if dispatch else None
        self.started_at = time.time()
        self._study_specs = SpecCache()

    def start(self, background: bool = True) -> None:
        if self.dispatcher:
            self.dispatcher.start(background=background)
        if self.mirror and background:
            self.mirror.start()

    def stop(self) -> None:
        if self.dispatcher:
            self.dispatcher.stop()
        if self.mirror:
            self.mirror.stop()  # one last pass, so MLflow shows the final state

    # operations ----------------------------------------------------------------------
    def plan(self, source: SweepSpec | dict | str, cpus: float | None = None,
             gpus: float | None = None, calibrate: bool = False) -> dict[str, Any]:
        """The sweep's price (`pricing.price`) on this cluster, or on one of `cpus` and
        `gpus`; nothing is stored. `calibrate`: measure the throughput again."""
        spec = load_spec(source, max_trials=self.settings.max_trials)
        self._data_hash(spec)  # submit's data checks: a plan refuses what a submit would
        plan = price(spec, self.settings, self.store, cluster_now(cpus, gpus), calibrate)
        plan["ceiling"] = self._ceiling(plan)
        return plan

    def _ceiling(self, plan: dict[str, Any]) -> dict[str, Any]:
        limit = self.settings.max_sweep_device_hours
        hours = plan["total"]["device_hours"]
        return {"device_hours": limit, "exceeded": hours > limit,
                "message": cost_message(plan, limit) if hours > limit else None}

    def submit(self, source: SweepSpec | dict | str,
               idempotency_key: str | None = None,
               confirm_cost: bool = False) -> dict[str, Any]:
        """Validate, admit, plan and store a sweep. Everything that can refuse it runs before
        the one transaction that stores the sweep with all its trials, so a refused (or
        failing) submission leaves nothing behind.

        With an `idempotency_key` (the Idempotency-Key header), a submit the key already
        made with the same body (within IDEMPOTENCY_WINDOW_S, across restarts and servers)
        answers that sweep's summary instead of storing another; the key used with another
        body is a SpecError naming the header. A sweep priced above
        HPT_MAX_SWEEP_DEVICE_HOURS is a SpecError naming `confirm_cost` unless it is set."""
        claim = idempotency(idempotency_key, source) if idempotency_key is not None else None
        try:
            earlier = self.store.submitted_sweep(*claim) if claim is not None else None
            if earlier is not None:
                return self.summary(earlier)  # a retry: nothing to validate or plan again
            sweep_id = self._store_sweep(source, claim, confirm_cost)
        except IdempotencyConflict as exc:
            raise SpecError([{"field": IDEMPOTENCY_HEADER, "message": str(exc)}]) from None
        if self.dispatcher:
            self.dispatcher.wake()
        if self.mirror:
            self.mirror.wake()
        return self.summary(sweep_id)

    def _store_sweep(self, source: SweepSpec | dict | str,
                     claim: tuple[str, str] | None, confirm_cost: bool = False) -> str:
        """Validate, admit, price and plan the spec, then store it: the new sweep's id (or,
        with `claim`, the id of the sweep an identical submit racing this one stored)."""
        spec = load_spec(source, max_trials=self.settings.max_trials)
        costs = admit(spec, self.settings)
        limit = self.settings.max_sweep_device_hours
        if not confirm_cost and may_exceed(spec, costs, limit):
            plan = price(spec, self.settings, self.store, cluster_now())
            if plan["total"]["device_hours"] > limit:
                raise SpecError([{"field": "confirm_cost",
                                  "message": cost_message(plan, limit)}])
        stored_spec = storable(spec)
        data_hash = self._data_hash(spec)
        optuna = spec.search.method == "optuna"
        planned = [] if optuna else plan_sweep(spec)
        return self.store.create_sweep(
            name=spec.name, spec=stored_spec, spec_hash=spec_hash(spec),
            search=spec.search.method, planned=planned, data_hash=data_hash,
            reuse=spec.reuse, max_attempts=spec.retries + 1,
            study=initial_state(spec, len(planned)) if spec.stages else None,
            max_concurrent=spec.max_concurrent,
            planned_total=len(plan_shapes(spec)) * spec.search.n_trials if optuna else None,
            idempotency=claim,
        )

    def _data_hash(self, spec: SweepSpec) -> str:
        try:
            with DATA_GATE.admit(), DATA_GATE.compute():
                ds = load_dataset(spec.data, cache_dir=self.settings.cache_dir,
                                  roots=self.settings.data_roots)
        except DataError as exc:
            field = "data" if spec.data.is_stdlib else "data.source"
            raise SpecError([{"field": field, "message": str(exc)}]) from None
        return ds.content_hash

    def summary(self, sweep_id: str) -> dict[str, Any]:
        sweep = self.store.get_sweep(sweep_id)
        if sweep is None:
            raise NotFoundError(f"no sweep with id {sweep_id!r:.80}")
        return self._summarise(sweep, self.store.mean_wall_times([sweep_id]).get(sweep_id),
                               self._stage_counts([sweep]).get(sweep_id))

    def summaries(self, limit: int = 100, offset: int = 0) -> list[dict[str, Any]]:
        """Summaries of a page of sweeps, newest first, in a constant number of queries."""
        sweeps = self.store.list_sweeps(limit=limit, offset=offset, specs=False)
        means = self.store.mean_wall_times([s.id for s in sweeps])
        stages = self._stage_counts(sweeps)
        return [self._summarise(s, means.get(s.id), stages.get(s.id)) for s in sweeps]

    def listing_version(self) -> tuple[int, tuple[tuple[str, str], ...]]:
        """Changes whenever `summaries` could: a commit to the app database through this
        process, or the dispatcher's reasons why sweeps wait (kept in memory, not stored)."""
        waiting = dict(self.dispatcher.waiting) if self.dispatcher else {}  # a copy: atomic
        return self.changes.value, tuple(sorted(waiting.items()))

    def _stage_counts(
        self, sweeps: list[SweepRecord]
    ) -> dict[str, dict[str | None, dict[str, int]]]:
        """Per-stage counts of the studies among `sweeps` (one query, none without studies)."""
        studies = [s.id for s in sweeps if s.study is not None]
        return self.store.stage_counts_of(studies) if studies else {}

    def _study_spec(self, sweep: SweepRecord) -> SweepSpec:
        """A sweep's validated spec, validated once per process (not on every summary)."""
        return self._study_specs.get(sweep.id, sweep.spec)

    def _summarise(self, sweep: SweepRecord, mean_wall_s: float | None,
                   stage_counts: dict[str | None, dict[str, int]] | None) -> dict[str, Any]:
        """Progress from the row's counts and the numbers stored at submit. The ETA:
        remaining trials x mean wall time of those that ran / max_concurrent."""
        counts = sweep.counts or {}
        total = max(sum(counts.values()), sweep.planned_total or 0)
        done = sum(n for s, n in counts.items() if TrialStatus(s).is_finished())
        stages = None
        if sweep.study is not None:  # a study: progress per stage, unplanned ones expected
            stages = study_progress(self._study_spec(sweep), sweep.study, stage_counts or {},
                                    sweep.status)
            total = max(total, sum(st["total"] for st in stages))
        return {
            **{k: v for k, v in sweep.to_dict().items() if k != "spec"},
            "counts": counts,
            "total": total,
            "done": done,
            "progress": done / total if total else 0.0,
            "eta_s": (0.0 if done >= total else None if mean_wall_s is None
                      else mean_wall_s * (total - done) / (sweep.max_concurrent or 1)),
            "waiting_for": self.dispatcher.waiting.get(sweep.id) if self.dispatcher else None,
            "stages": stages,
        }

    def cancel(self, sweep_id: str) -> dict[str, Any]:
        if self.store.get_sweep(sweep_id) is None:
            raise NotFoundError(f"no sweep with id {sweep_id!r:.80}")
        self.store.cancel_sweep(sweep_id)  # running ones are cancelled by the dispatcher
        if self.dispatcher:
            self.dispatcher.sweep_stopped(sweep_id)
        return self.summary(sweep_id)

    def fits(self, sweep_id: str, bootstrap: int = 100,
             reference_arm: str | None = None) -> dict[str, Any]:
        """The fit report; UnknownArm when `reference_arm` is not one of the sweep's arms."""
        sweep = self.store.get_sweep(sweep_id)
        if sweep is None:
            raise NotFoundError(f"no sweep with id {sweep_id!r:.80}")
        if reference_arm is not None:
            arms = [arm.name for arm in self._study_spec(sweep).arms]
            if reference_arm not in arms:
                raise UnknownArm(f"reference_arm {reference_arm[:200]!r} is not an arm of "
                                 f"sweep {sweep_id}; its arms: {', '.join(arms)}")
        return fits_payload(sweep_report(self.store, sweep_id, bootstrap, reference_arm))

    def _sweep_finished(self, sweep_id: str) -> dict[str, str | bytes]:
        """The artifacts of every hook for a finished sweep's parent run (mirror thread)."""
        artifacts: dict[str, str | bytes] = {}
        for hook in self.finished_hooks:
            try:  # one failing hook does not cost the others' artifacts
                artifacts.update(hook(self, sweep_id) or {})
            except Exception:
                log.exception("sweep-finished hook %s failed for %s",
                              getattr(hook, "__name__", hook), sweep_id)
        return artifacts


def _fit_artifacts(coordinator: Coordinator, sweep_id: str) -> dict[str, str]:
    return fits_artifacts(sweep_report(coordinator.store, sweep_id, wait=True))
