"""Optuna search over the LR axis: one study per (sweep, arm, shape, sigma, seed).

Ask-and-tell from the coordinator only (Optuna advises against parallel SQLite writers);
workers report intermediate validation losses through the progress board and the pruner
decides here. Heartbeats do not work with ask-and-tell, so dead trials are told FAIL by us.
"""

from __future__ import annotations

import math
from typing import Any

import optuna

optuna.logging.set_verbosity(optuna.logging.WARNING)

# a diverged trial is a real observation ("too high"); tell it a loss worse than uniform
# over the vocabulary so the sampler moves away, rather than FAIL, which TPE ignores
DIVERGED_PENALTY = 2.0


def _sampler(name: str, seed: int) -> optuna.samplers.BaseSampler:
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "qmc":
        return optuna.samplers.QMCSampler(seed=seed, scramble=True)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=3)


def _pruner(name: str) -> optuna.pruners.BasePruner:
    if name == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3)
    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1)
    return optuna.pruners.NopPruner()


class OptunaSearch:
    def __init__(self, storage_url: str) -> None:
        self.storage = optuna.storages.RDBStorage(
            storage_url, engine_kwargs={"connect_args": {"timeout": 30}}
            if storage_url.startswith("sqlite") else {},
        )
        self._studies: dict[str, optuna.Study] = {}
        self._live: dict[str, optuna.trial.Trial] = {}  # our trial id -> asked Optuna trial
        self._asked: dict[tuple[int, str], optuna.trial.Trial] = {}
        # trials the pruner stopped: the worker sees the stop late, and its later reports
        # must not reach the pruner (they would fill higher rungs with later-step values)
        self._pruned: set[str] = set()

    def study(self, name: str, sampler: str, pruner: str, seed: int) -> optuna.Study:
        if name not in self._studies:
            self._studies[name] = optuna.create_study(
                study_name=name, storage=self.storage, load_if_exists=True,
                direction="minimize", sampler=_sampler(sampler, seed), pruner=_pruner(pruner),
            )
        return self._studies[name]

    def ask(self, study: optuna.Study, lr_min: float, lr_max: float) -> tuple[int, float]:
        trial = study.ask()
        lr = trial.suggest_float("lr", lr_min, lr_max, log=True)
        self._asked[trial.number, study.study_name] = trial
        return trial.number, lr

    def bind(self, trial_id: str, study: optuna.Study, number: int) -> None:
        """Remember an asked trial under our trial id, for pruning reports."""
        trial = self._asked.pop((number, study.study_name), None)
        if trial is not None:
            self._live[trial_id] = trial

    def should_prune(self, trial_id: str, step: int, val_loss: float) -> bool:
        trial = self._live.get(trial_id)
        if trial is None or not math.isfinite(val_loss):
            return False  # after a coordinator restart the re-run is not pruned, only told
        if trial_id in self._pruned:
            return True
        trial.report(val_loss, step)
        if trial.should_prune():
            self._pruned.add(trial_id)
            return True
        return False

    def tell(
        self, study: optuna.Study, number: int, status: str, value: float | None, vocab: int
    ) -> None:
        state: Any
        if status == "completed" and value is not None and math.isfinite(value):
            study.tell(number, value)
        elif status == "diverged":
            study.tell(number, DIVERGED_PENALTY * math.log(vocab))
        else:
            state = (optuna.trial.TrialState.PRUNED if status == "pruned"
                     else optuna.trial.TrialState.FAIL)
            try:
                study.tell(number, state=state)
            except (ValueError, RuntimeError):
                pass  # already finished (e.g. told before a restart)

    def forget(self, trial_id: str) -> None:
        self._live.pop(trial_id, None)
        self._pruned.discard(trial_id)
