"""A Ray actor that carries live metrics from workers to the coordinator, and stop requests
(Optuna pruning) back. All database and MLflow writes stay in the coordinator."""

from __future__ import annotations

from typing import Any


class ProgressBoard:
    def __init__(self) -> None:
        self._pending: dict[str, list[dict[str, Any]]] = {}
        self._stop: set[str] = set()

    def report(self, trial_id: str, metrics: dict[str, Any]) -> bool:
        self._pending.setdefault(trial_id, []).append(metrics)
        return trial_id in self._stop

    def request_stop(self, trial_id: str) -> None:
        self._stop.add(trial_id)

    def drain(self) -> dict[str, list[dict[str, Any]]]:
        out, self._pending = self._pending, {}
        return out

    def forget(self, trial_id: str) -> None:
        self._stop.discard(trial_id)
        self._pending.pop(trial_id, None)
