"""The filters a sweep's trials can be listed by: one definition for the REST routes, the
store's queries and the Python client."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class TrialFilters:
    status: str | Sequence[str] | None = None
    arm: str | None = None
    width: int | None = None
    depth: int | None = None
    sigma_base: float | None = None
    seed: int | None = None
    stage: str | None = None  # a study's stage (tune, transfer, check, aspect_ratio)


TRIAL_FILTER_NAMES: tuple[str, ...] = tuple(f.name for f in fields(TrialFilters))
