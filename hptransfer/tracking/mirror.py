"""MLflow as a mirror of the app database.

The dispatcher writes trial state only to the app database. `Mirror` copies it to MLflow:
one experiment per sweep (`hpt/{name}/{sweep_id}`) with a parent run, and one nested run per
attempt (every lease of a trial). What it has copied is recorded in the app database
(`mlflow_synced_status` of sweeps and attempts), so a pass only looks at what changed, and
every write is idempotent, which makes the mirror safe to run twice, after a kill, or after
MLflow was away for an hour:

* runs are found before they are created, by a deterministic key: the experiment by name,
  the parent run by tag `hpt.role = sweep`, an attempt's run by tags `hpt.trial_id` +
  `hpt.attempt`; so a kill between creating a run and recording its id leaves no duplicate;
* metric timestamps are derived from the attempt (start time + step in ms) and MLflow's SQL
  store drops an identical (key, timestamp, step, value) row, so a curve logged twice, or
  live points followed by the final curve from the database, adds nothing;
* params are logged with the same values again (accepted), artifacts overwritten, tags and
  run status set to the database's values.

Live metrics during training are best effort: queued in memory and logged when MLflow
answers, dropped otherwise (the final curve is copied from the database anyway). The mirror
runs in its own thread; when MLflow is away it backs off exponentially (capped) and logs one
line when the outage starts and one when it ends. Dispatch never waits on it.
"""

from __future__ import annotations

import collections
import json
import logging
import tempfile
import threading
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from hptransfer.backoff import Backoff
from hptransfer.contracts.records import AttemptRecord, SweepRecord
from hptransfer.contracts.status import ACTIVE, SweepStatus, TrialStatus
from hptransfer.spec.sweep import RESERVED_TAG_PREFIXES
from hptransfer.store.store import Store

from .params import (
    MAX_METRICS_PER_BATCH,
    flatten,
    mlflow_params,
    mlflow_tags,
    run_name,
    safe_name,
    table_params,
    to_float,
)
from .tracking import open_client

log = logging.getLogger(__name__)

ERROR_TAIL = 4000  # characters of an attempt's error kept in its hpt.error tag
CURVE_METRICS = ("train_loss", "val_loss", "lr", "tokens")
FINAL_METRICS = (
    "final_val_loss", "final_train_loss", "flops", "flops_per_token", "tokens", "tokens_per_s",
    "wall_time_s", "mfu", "params_non_embedding", "params_embedding",
)
RUN_STATUS = {TrialStatus.COMPLETED: "FINISHED", TrialStatus.PRUNED: "FINISHED",
              TrialStatus.DIVERGED: "FINISHED", TrialStatus.FAILED: "FAILED",
              TrialStatus.CANCELLED: "KILLED",
              SweepStatus.STOPPED: "FINISHED"}  # a study stopped on purpose
# The experiment's kind as MLflow names it (its API and kind selector read it). MLflow 3.17's
# UI picks its view from the workflow switch instead: links carry it (tracking.ui_url).
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
# MLflow error codes that mean "this write is wrong", not "MLflow is away": never retried
REJECTED_CODES = frozenset({
    "INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS", "RESOURCE_DOES_NOT_EXIST",
    "INVALID_STATE", "BAD_REQUEST",
})
LIVE_QUEUE = 20_000  # live metric batches kept while the mirror is busy; older ones dropped

ArtifactHook = Callable[[str], Mapping[str, str | bytes]]


def is_transient(exc: BaseException) -> bool:
    """MLflow away or busy (retry later), as opposed to a write MLflow will never take."""
    if isinstance(exc, OSError):  # requests' ConnectionError/Timeout are OSErrors too
        return True
    if type(exc).__module__.startswith(("sqlalchemy", "sqlite3")):  # e.g. database is locked
        return True
    code = getattr(exc, "error_code", None)
    return code is not None and code not in REJECTED_CODES


def _ms(when: datetime | None) -> int | None:
    return None if when is None else int(when.timestamp() * 1000)


class Mirror:
    """Copies sweeps and attempts from the app database to MLflow; see the module doc."""

    def __init__(
        self, store: Store, tracking_uri: str, artifact_root: str | None = None, *,
        artifacts: ArtifactHook | None = None, interval: float = 1.0, max_backoff: float = 60.0,
        batch: int = 200,
    ) -> None:
        self.store, self.tracking_uri = store, tracking_uri
        self.artifact_root = artifact_root
        self.artifacts = artifacts
        self.interval, self.batch = interval, batch
        # MLflow away is routine (a restart, a network blip): one line, not a traceback
        self.outage = Backoff("MLflow mirror", log, 2 * interval, max_backoff, traceback=False)
        self._client: Any = None
        self._runs: dict[str, tuple[str, int]] = {}  # running trial -> (run, start ms)
        self._live: collections.deque = collections.deque(maxlen=LIVE_QUEUE)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # thread ---------------------------------------------------------------------------
    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="hpt-mlflow-mirror",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """One last pass (bounded by `timeout`), then the thread ends."""
        self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join(timeout)

    def wake(self) -> None:
        """Something changed in the app database: mirror it soon."""
        self._wake.set()

    def live(self, trial_id: str, started_at: datetime, points: list[dict[str, Any]]) -> None:
        """Live curve points of the attempt started at `started_at`: logged if MLflow
        answers and the attempt's run exists, else dropped."""
        self._live.append((trial_id, _ms(started_at), list(points)))

    def _loop(self) -> None:
        while True:
            stopping = self._stop.is_set()
            try:
                n = self.sync()
                self.outage.succeeded()
            except Exception as exc:
                self._live.clear()  # best effort: the final curves come from the database
                self.outage.failed(exc)
                n = 0
            if stopping:
                return
            if n >= self.batch:
                continue  # a backlog: go on at once
            if self.outage.error:  # wakes are ignored: back-off, not one retry per dispatch tick
                self._stop.wait(self.outage.delay)
            else:
                self._wake.wait(self.interval)
            self._wake.clear()

    # one pass -------------------------------------------------------------------------
    def sync(self) -> int:
        """Copy what changed; returns the number of rows mirrored. Raises when MLflow is
        away (nothing is lost: what was not marked mirrored is copied by a later pass)."""
        self._log_live()
        n = 0
        ends = []
        for sweep in self.store.sweeps_to_mirror():
            if sweep.mlflow_run_id is None:
                self._guard(f"sweep {sweep.id}", lambda s=sweep: self._create_sweep(s))
                n += 1
            if sweep.status in ACTIVE:
                self._guard(f"sweep {sweep.id}", lambda s=sweep: self._reopen_sweep(s),
                            skip=lambda s=sweep: self._skip_sweep(s))
            else:
                ends.append(sweep.id)
        for attempt in self.store.attempts_to_mirror(self.batch):
            self._guard(f"trial {attempt.trial_id}", lambda a=attempt: self._sync_attempt(a),
                        skip=lambda a=attempt: self.store.mark_attempt_mirrored(
                            a.trial_id, a.seq, a.status))
            n += 1
        # a parent run ends once all its attempts are mirrored (their runs end first)
        for sweep in self.store.sweeps_to_mirror():
            if sweep.id in ends and sweep.mlflow_run_id and \
                    self.store.mirror_backlog(sweep.id) == 1:
                self._guard(f"sweep {sweep.id}", lambda s=sweep: self._end_sweep(s),
                            skip=lambda s=sweep: self._skip_sweep(s))
                n += 1
        return n

    def _guard(self, what: str, step: Callable[[], None],
               skip: Callable[[], None] | None = None) -> None:
        """Run one row's copy; a transient error aborts the pass (raised). A rejection (a run
        deleted in MLflow's UI, say) is logged and, with `skip`, that row is marked mirrored
        as it is: retried, it would be rejected on every pass, keep its sweep's parent run
        open for good, and a batch of them would crowd out every newer row."""
        try:
            step()
        except Exception as exc:
            if is_transient(exc):
                raise
            log.warning("MLflow rejected %s: %s: %s%s", what, type(exc).__name__,
                        str(exc)[:300], "; not copied again" if skip else "")
            if skip is not None:
                skip()

    def _skip_sweep(self, sweep: SweepRecord) -> None:
        self.store.mark_sweep_mirrored(sweep.id, sweep.status)

    def _tolerant(self, what: str, step: Callable[[], Any]) -> None:
        """One step of a row's copy that may be rejected without spoiling the others."""
        try:
            step()
        except Exception as exc:
            if is_transient(exc) or getattr(exc, "error_code", None) == \
                    "RESOURCE_DOES_NOT_EXIST":
                raise
            log.warning("MLflow rejected %s: %s", what, str(exc)[:300])

    def client(self) -> Any:
        if self._client is None:
            self._client = open_client(self.tracking_uri)
        return self._client

    # sweeps ---------------------------------------------------------------------------
    def _experiment(self, sweep: SweepRecord) -> str:
        from mlflow.exceptions import MlflowException

        c = self.client()
        name = f"hpt/{sweep.name}/{sweep.id}"
        exp = c.get_experiment_by_name(name)
        if exp is None:
            tags = mlflow_tags({**self._sweep_tags(sweep), **EXPERIMENT_KIND})
            try:
                return str(c.create_experiment(name, self._artifact_location(sweep), tags))
            except MlflowException as exc:  # created meanwhile
                if getattr(exc, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
                    raise
                exp = c.get_experiment_by_name(name)
        if exp.lifecycle_stage == "deleted":
            c.restore_experiment(exp.experiment_id)
        for key, value in EXPERIMENT_KIND.items():
            c.set_experiment_tag(exp.experiment_id, key, value)
        return str(exp.experiment_id)

    def _artifact_location(self, sweep: SweepRecord) -> str | None:
        root = self.artifact_root
        if not root:
            return None
        if "://" in root:
            return f"{root.rstrip('/')}/{safe_name(sweep.name)}/{safe_name(sweep.id)}"
        return str(Path(root).expanduser().resolve() / safe_name(sweep.name) / safe_name(sweep.id))

    @staticmethod
    def _sweep_tags(sweep: SweepRecord) -> dict[str, str]:
        tags = sweep.spec.get("tags") if isinstance(sweep.spec, dict) else None
        # a spec stored before reserved keys were refused: such a tag would steer the run
        own = {str(k): str(v) for k, v in (tags or {}).items()
               if not str(k).lower().startswith(RESERVED_TAG_PREFIXES)}
        return {**own, "hpt.sweep_id": sweep.id, "hpt.name": sweep.name}

    def _create_sweep(self, sweep: SweepRecord) -> None:
        c = self.client()
        experiment_id = self._experiment(sweep)
        found = c.search_runs([experiment_id], "tags.`hpt.role` = 'sweep'", max_results=1)
        if found:
            parent = found[0].info.run_id
        else:
            tags = mlflow_tags({**self._sweep_tags(sweep), "hpt.role": "sweep",
                                "hpt.status": sweep.status})
            parent = c.create_run(experiment_id, start_time=_ms(sweep.created_at),
                                  run_name=sweep.name, tags=tags).info.run_id
        # again when found: a kill may have come between creating the run and these
        self._tolerant("sweep params", lambda: self._log_batch(
            parent, params=mlflow_params(flatten(sweep.spec or {}))))
        text = json.dumps(sweep.spec or {}, indent=2, sort_keys=True, default=str)
        self._tolerant("sweep spec", lambda: c.log_text(parent, text, "sweep_spec.json"))
        self.store.set_sweep_mlflow(sweep.id, experiment_id, parent)

    def _reopen_sweep(self, sweep: SweepRecord) -> None:
        parent = sweep.mlflow_run_id or self._parent_of(sweep.id)
        if parent is None:
            return
        if sweep.mlflow_synced_status is not None and sweep.mlflow_synced_status not in ACTIVE:
            self.client().update_run(parent, status="RUNNING")  # more trials arrived
        self._log_batch(parent, tags={"hpt.status": sweep.status})
        self.store.mark_sweep_mirrored(sweep.id, sweep.status)

    def _parent_of(self, sweep_id: str) -> str | None:
        row = self.store.get_sweep(sweep_id)
        return row.mlflow_run_id if row else None

    def _end_sweep(self, sweep: SweepRecord) -> None:
        c = self.client()
        parent = sweep.mlflow_run_id
        files: Mapping[str, str | bytes] = {}
        if self.artifacts is not None:
            try:  # fits and dashboards; a failing hook never blocks the status
                files = self.artifacts(sweep.id) or {}
            except Exception:
                log.exception("sweep-finished hook failed for %s", sweep.id)
        if files:
            with tempfile.TemporaryDirectory(prefix="hpt-mlflow-") as tmp:
                for name, content in files.items():
                    rel = Path(name)
                    if not name or rel.is_absolute() or ".." in rel.parts:
                        log.warning("artifact %r skipped: not a relative path", name)
                        continue
                    dest = Path(tmp) / rel
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    if isinstance(content, bytes | bytearray):
                        dest.write_bytes(content)
                    else:
                        dest.write_text(str(content), encoding="utf-8")
                # one upload for all of them; a rejection must not keep the run open
                self._tolerant("sweep artifacts", lambda: c.log_artifacts(parent, tmp))
        self._log_batch(parent, tags={"hpt.status": sweep.status})
        c.set_terminated(parent, RUN_STATUS.get(sweep.status, "FINISHED"),
                         end_time=_ms(sweep.finished_at))
        self.store.mark_sweep_mirrored(sweep.id, sweep.status)

    # attempts -------------------------------------------------------------------------
    def _sync_attempt(self, a: AttemptRecord) -> None:
        run_id = a.mlflow_run_id or self._attempt_run(a)
        if a.status == TrialStatus.RUNNING:
            self._runs[a.trial_id] = (run_id, _ms(a.started_at) or 0)
        else:
            if self._runs.get(a.trial_id, ("", None))[1] == _ms(a.started_at):
                del self._runs[a.trial_id]
            self._finish_run(run_id, a)
        self.store.mark_attempt_mirrored(a.trial_id, a.seq, a.status)

    def _attempt_run(self, a: AttemptRecord) -> str:
        """The attempt's run, found by its key or created; its id recorded in the app DB."""
        c = self.client()
        found = c.search_runs(
            [a.experiment_id],
            f"tags.`hpt.trial_id` = '{a.trial_id}' and tags.`hpt.attempt` = '{a.seq}'",
            max_results=1)
        if found:
            run_id = found[0].info.run_id
        else:
            tags = {"mlflow.parentRunId": a.parent_run_id, "hpt.trial_id": a.trial_id,
                    "hpt.attempt": str(a.seq), "hpt.sweep_id": a.sweep_id, "hpt.arm": a.arm,
                    "hpt.role": "trial", "hpt.status": TrialStatus.RUNNING.value}
            if a.reused_from:  # not trained here: the result of an identical earlier trial
                tags["hpt.reused_from"] = a.reused_from
            run_id = c.create_run(a.experiment_id, start_time=_ms(a.started_at), tags=tags,
                                  run_name=run_name(a.arm, a.spec)).info.run_id
        self._tolerant("trial params", lambda: self._log_batch(
            run_id, params=mlflow_params(flatten(a.spec))))
        self.store.set_attempt_run(a.trial_id, a.seq, run_id)
        return run_id

    def _finish_run(self, run_id: str, a: AttemptRecord) -> None:
        from mlflow.entities import Metric

        c = self.client()
        result = a.result or {}
        table = result.get("param_table") or {}
        tags = {"hpt.status": a.status}
        if result.get("resumed_from_step"):  # its curve's first part came from a checkpoint
            tags["hpt.resumed_from_step"] = str(result["resumed_from_step"])
        if a.error:
            tags["hpt.error"] = str(a.error)[-ERROR_TAIL:]
        self._tolerant("trial table params", lambda: self._log_batch(
            run_id, params=table_params(table)))
        start = _ms(a.started_at) or 0
        curve = list(result.get("curve") or [])
        metrics = _curve_metrics(curve, start)
        in_curve = {(m.key, m.step): m.value for m in metrics}
        last = max((int(p["step"]) for p in curve if p.get("step") is not None), default=0)
        # the run's value of a key is MLflow's latest (highest step, then timestamp): the
        # final numbers go at the curve's last step or later, a millisecond after its point
        # there (a diverged trial's curve ends one step past its `steps`, with more tokens)
        final_step = max(int(result.get("steps") or last), last)
        for key in FINAL_METRICS:
            value = to_float(result.get(key))
            if value is not None and in_curve.get((key, final_step)) != value:
                metrics.append(Metric(key, value, start + final_step + 1, final_step))
        self._log_metrics(run_id, metrics, tags=tags)  # one call where the curve fits in one
        if table:
            text = json.dumps(table, indent=2, sort_keys=True, default=str)
            self._tolerant("param table", lambda: c.log_text(run_id, text, "param_table.json"))
        c.set_terminated(run_id, RUN_STATUS.get(a.status, "FINISHED"),
                         end_time=_ms(a.finished_at))

    def _log_live(self) -> None:
        # every batch queued since the last pass, one write per run: each write is a round
        # trip and a transaction, whatever it carries
        queued: dict[tuple[str, int | None], list[dict[str, Any]]] = {}
        while self._live:
            trial_id, start, points = self._live.popleft()
            queued.setdefault((trial_id, start), []).extend(points)
        for (trial_id, start), points in queued.items():
            known = self._runs.get(trial_id)
            if known is None or known[1] != start:  # no run yet: points dropped
                continue
            try:
                self._log_metrics(known[0], _curve_metrics(points, known[1]))
            except Exception as exc:
                if is_transient(exc):
                    raise
                # its run was deleted in MLflow's UI, say: it would refuse every later point
                # too, and failing the pass would hold up every other row's copy
                del self._runs[trial_id]
                log.warning("MLflow rejected trial %s's live metrics: %s: %s; its later live "
                            "points are dropped", trial_id, type(exc).__name__, str(exc)[:300])

    # writes ---------------------------------------------------------------------------
    def _log_metrics(self, run_id: str, metrics: list[Any],
                     tags: Mapping[str, str] | None = None) -> None:
        """`metrics` in batches MLflow takes (its limit counts every entity of a call);
        `tags` with the first."""
        pending = _run_tags(tags)
        start = 0
        while pending or start < len(metrics):
            end = start + MAX_METRICS_PER_BATCH - len(pending)
            self.client().log_batch(run_id, metrics=metrics[start:end], tags=pending,
                                    synchronous=True)
            pending, start = [], end

    def _log_batch(self, run_id: str, params: Mapping[str, str] | None = None,
                   tags: Mapping[str, str] | None = None) -> None:
        from mlflow.entities import Param

        p = [Param(k, v) for k, v in (params or {}).items()]
        t = _run_tags(tags)
        if p or t:
            self.client().log_batch(run_id, params=p, tags=t, synchronous=True)


def _run_tags(tags: Mapping[str, str] | None) -> list[Any]:
    from mlflow.entities import RunTag

    return [RunTag(k, v) for k, v in mlflow_tags(tags or {}).items()]


def _curve_metrics(points: list[dict[str, Any]], start_ms: int) -> list[Any]:
    """Curve points as metrics with derived timestamps (start + step ms): logging the same
    point twice writes the same row, which MLflow's SQL store drops."""
    from mlflow.entities import Metric

    out = []
    for point in points:
        if point.get("step") is None:
            continue
        step = int(point["step"])
        for key in CURVE_METRICS:
            value = to_float(point.get(key))
            if value is not None:
                out.append(Metric(key, value, start_ms + step, step))
    return out
