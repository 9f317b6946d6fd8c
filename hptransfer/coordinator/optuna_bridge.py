"""The dispatch loop's calls to Optuna's storage (a database of its own): a sweep's studies,
telling a trial's outcome, retracting an ask, pruning, and the trials a study still has
RUNNING.

While the storage fails, these calls wait for its back-off (`calls`): only the Optuna
sweeps' asks, tells and pruning wait; storing results and the other sweeps go on."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import optuna

from hptransfer.backoff import Backoff
from hptransfer.spec import SweepSpec
from hptransfer.store.store import TrialRecord

from .dispatch_context import MAX_BACKOFF_S, DispatchContext, log
from .optuna_search import OptunaSearch
from .plan import ShapeKey, plan_shapes


class OptunaUnavailable(Exception):
    """Optuna's storage failed, or is being backed off from: the Optuna sweeps' asks, tells
    and pruning wait; storing results and every other sweep go on."""


def shape_of(trial: TrialRecord) -> ShapeKey:
    """The shape (and so the Optuna study) a trial belongs to."""
    return ShapeKey(trial.arm, trial.width, trial.depth, trial.sigma_base, trial.seed)


class OptunaBridge:
    """Talks to Optuna's storage for the dispatch loop, backing off while it fails."""

    def __init__(self, context: DispatchContext) -> None:
        self.context = context
        self.search = OptunaSearch(context.settings.optuna_url)
        self.storage_backoff = Backoff("Optuna's storage", log, context.poll_interval,
                                       MAX_BACKOFF_S)

    @contextlib.contextmanager
    def calls(self) -> Iterator[None]:
        """Around calls to Optuna's storage. While it fails, they wait for its backoff
        (OptunaUnavailable at once); a failure starts or extends the backoff, drops the
        storage's connections (one opened during an outage can stay unusable after it) and
        is raised as OptunaUnavailable, which holds up only Optuna's own work: storing
        results and the other sweeps go on. Callers mark a success where a call surely
        reached the storage (a study may come from memory)."""
        if not self.storage_backoff.ready():
            raise OptunaUnavailable(self.storage_backoff.error)
        try:
            yield
        except OptunaUnavailable:
            raise
        except Exception as exc:
            # Optuna wraps the database's own error in a generic "error during the commit"
            cause = exc.__cause__ if isinstance(
                exc, optuna.exceptions.StorageInternalError) and exc.__cause__ else exc
            self.storage_backoff.failed(cause)
            self.search.reconnect()
            raise OptunaUnavailable(f"{type(cause).__name__}: {cause}") from exc

    @staticmethod
    def study_name(sweep_id: str, shape: ShapeKey) -> str:
        return (f"hpt-{sweep_id}-{shape.arm}-N{shape.width}-L{shape.depth}"
                f"-s{shape.sigma_base:g}-seed{shape.seed}")

    def study(self, sweep_id: str, spec: SweepSpec, shape: ShapeKey) -> optuna.Study:
        """The shape's study (call inside `calls`)."""
        low, high = spec.grid.lr_bounds()
        # the study name seeds its sampler; the shape alone places its first batch
        return self.search.study(self.study_name(sweep_id, shape), spec.search,
                                 self.study_name("", shape), low, high)

    def study_names(self) -> set[str]:
        """Every study in Optuna's storage."""
        with self.calls():
            names = set(optuna.get_all_study_names(self.search.storage))
            self.storage_backoff.succeeded()
        return names

    def running(self, sweep_id: str, spec: SweepSpec,
                shape: ShapeKey) -> tuple[optuna.Study, list[int]]:
        """The shape's study and the numbers of its trials still RUNNING."""
        with self.calls():
            study = self.study(sweep_id, spec, shape)
            return study, self.search.running_numbers(study)

    def trials_left_to_ask(self, sweep_id: str, spec: SweepSpec) -> int:
        """Trials the Optuna studies still have to ask (never negative: a study's later
        stages add trials beyond them, and a negative count would read as "some left")."""
        asked = self.context.store.count_trials(sweep_id)
        return max(0, len(plan_shapes(spec)) * spec.search.n_trials - asked)

    def tell(self, trial: TrialRecord, status: str, result: dict | None) -> None:
        """Tell the trial's study its stored outcome."""
        sweep = self.context.store.get_sweep(trial.sweep_id)
        spec = self.context.spec(sweep)
        value = (result or {}).get("final_val_loss")
        with self.calls():
            study = self.study(sweep.id, spec, shape_of(trial))
            # the diverged penalty scales with the models' vocabulary
            self.search.tell(study, trial.optuna_trial_number, status, value,
                             spec.model_vocab_size())
            self.storage_backoff.succeeded()

    def retract(self, asked: tuple[optuna.Study, int]) -> None:
        """Fail an asked Optuna trial that will never run (its LR is asked again)."""
        with self.calls():
            self.search.retract(*asked)
            self.storage_backoff.succeeded()

    def should_prune(self, trial_id: str, points: list[dict[str, Any]]) -> bool:
        """Whether Optuna's pruner stops the trial at one of its new points; not while its
        storage fails (the trial then trains on: pruning only saves time)."""
        try:
            with self.calls():
                return any(p.get("val_loss") is not None and
                           self.search.should_prune(trial_id, p["step"], p["val_loss"])
                           for p in points)
        except OptunaUnavailable:
            return False

    def verdict_step(self, trial_id: str) -> int | None:
        """Where the trial waits for the pruner's first verdict (OptunaSearch.verdict_step);
        kept in memory, so it never calls the storage."""
        return self.search.verdict_step(trial_id)

    def forget(self, trial_id: str) -> None:
        """The trial is no longer live: nothing left to prune."""
        self.search.forget(trial_id)
