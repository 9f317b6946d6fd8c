"""A Ray actor that carries live metrics from workers to the coordinator, stop requests
(Optuna pruning) back, and the final results of a split pack's members as each group of it
finishes (kept if the task dies before it returns). All database and MLflow writes stay in
the coordinator.

A trial gated at a step (`gate`: the first step Optuna's pruner may stop it) waits there for
the pruner's verdict: the board answers that report with `None` and the worker asks
`verdict` until the coordinator has judged the point. Without the wait a trial shorter than
the coordinator's reaction time (a loaded host, a slow tick) trains to the end whatever the
pruner says, so which trials are pruned would depend on the host's load."""

from __future__ import annotations

from typing import Any

# what one drain hands over: live points per trial, and results delivered ahead of the task
Drained = tuple[dict[str, list[dict[str, Any]]], dict[str, dict[str, Any]]]
_NOT_TAKEN = -1  # a gated point the coordinator has not drained yet


class ProgressBoard:
    def __init__(self) -> None:
        self._pending: dict[str, list[dict[str, Any]]] = {}
        self._results: dict[str, dict[str, Any]] = {}
        self._stop: set[str] = set()
        self._gates: dict[str, int] = {}  # trial -> the step whose verdict it waits for
        # trial -> the drain that took its gated point; the drain after it settles the
        # verdict: the coordinator sends the next drain only after judging the points of the
        # last one, and a caller's actor calls run in the order sent (its request_stop first)
        self._awaiting: dict[str, int] = {}
        self._drains = 0

    def gate(self, trial_id: str, step: int) -> None:
        """The trial's first evaluation at or after `step` waits for the pruner's verdict."""
        self._gates[trial_id] = step

    def report(self, trial_id: str, metrics: dict[str, Any]) -> bool | None:
        """Whether the trial was asked to stop; None: the worker waits for `verdict`."""
        self._pending.setdefault(trial_id, []).append(metrics)
        if trial_id in self._stop:
            return True
        gate = self._gates.get(trial_id)
        if gate is not None and metrics.get("val_loss") is not None \
                and int(metrics.get("step") or 0) >= gate:
            del self._gates[trial_id]
            self._awaiting[trial_id] = _NOT_TAKEN
            return None
        return False

    def verdict(self, trial_id: str) -> bool | None:
        """For a report answered None: whether the trial stops, None while not yet judged."""
        if trial_id in self._stop:
            self._awaiting.pop(trial_id, None)
            return True
        taken = self._awaiting.get(trial_id)
        if taken is None:  # forgotten, or this board restarted: nothing to wait for
            return False
        if taken == _NOT_TAKEN or self._drains <= taken:
            return None
        del self._awaiting[trial_id]
        return False

    def deliver(self, trial_id: str, result: dict[str, Any]) -> None:
        """A pack member's final result, before its task returns."""
        self._results[trial_id] = result

    def request_stop(self, trial_id: str) -> None:
        self._stop.add(trial_id)

    def drain(self) -> Drained:
        self._drains += 1
        for trial_id in self._pending:
            if self._awaiting.get(trial_id) == _NOT_TAKEN:
                self._awaiting[trial_id] = self._drains
        out, self._pending = self._pending, {}
        results, self._results = self._results, {}
        return out, results

    def forget(self, trial_id: str) -> None:
        self._stop.discard(trial_id)
        self._pending.pop(trial_id, None)
        self._results.pop(trial_id, None)
        self._gates.pop(trial_id, None)
        self._awaiting.pop(trial_id, None)
