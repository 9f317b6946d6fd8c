"""The filters a sweep's trials can be listed by: one definition for the REST routes, the
store's queries and the Python client."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class TrialFilters:
    status: str | Sequence[str] | None = None
    arm: str | None = None
    width: int | None = None
    depth: int | None = None
    sigma_base: float | None = None
    seed: int | None = None
    stage: str | None = None  # a study's stage (tune, transfer, check, aspect_ratio)

    def as_dict(self) -> dict[str, Any]:
        """The filters as keyword arguments (the store's `trials` and `count_trials`)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


TRIAL_FILTER_NAMES: tuple[str, ...] = tuple(f.name for f in fields(TrialFilters))
