"""A Ray actor that carries live metrics from workers to the coordinator, stop requests
(Optuna pruning) back, and the final results of a split pack's members as each group of it
finishes (kept if the task dies before it returns). All database and MLflow writes stay in
the coordinator."""

from __future__ import annotations

from typing import Any

# what one drain hands over: live points per trial, and results delivered ahead of the task
Drained = tuple[dict[str, list[dict[str, Any]]], dict[str, dict[str, Any]]]


class ProgressBoard:
    def __init__(self) -> None:
        self._pending: dict[str, list[dict[str, Any]]] = {}
        self._results: dict[str, dict[str, Any]] = {}
        self._stop: set[str] = set()

    def report(self, trial_id: str, metrics: dict[str, Any]) -> bool:
        self._pending.setdefault(trial_id, []).append(metrics)
        return trial_id in self._stop

    def deliver(self, trial_id: str, result: dict[str, Any]) -> None:
        """A pack member's final result, before its task returns."""
        self._results[trial_id] = result

    def request_stop(self, trial_id: str) -> None:
        self._stop.add(trial_id)

    def drain(self) -> Drained:
        out, self._pending = self._pending, {}
        results, self._results = self._results, {}
        return out, results

    def forget(self, trial_id: str) -> None:
        self._stop.discard(trial_id)
        self._pending.pop(trial_id, None)
        self._results.pop(trial_id, None)
