"""Rows in and out of the app database: ORM objects to frozen records, planned trials to
insert values, worker results to the typed result columns."""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Protocol, cast

from sqlalchemy import inspect

from hptransfer.contracts.records import SweepRecord, TrialRecord
from hptransfer.contracts.status import TrialStatus

from .schema import RESULT_COLUMNS, RESULT_FLOATS, RESULT_INTS, Base, Sweep, Trial


class PlannedRow(Protocol):
    """What the store reads of one planned grid point (the planner's `PlannedTrial`)."""

    @property
    def arm(self) -> str: ...
    @property
    def trial(self) -> Any: ...  # a TrialSpec (or a plain dict of its JSON dump)
    @property
    def width(self) -> int: ...
    @property
    def depth(self) -> int: ...
    @property
    def lr(self) -> float: ...
    @property
    def sigma_base(self) -> float: ...
    @property
    def seed(self) -> int: ...
    @property
    def content_hash(self) -> str: ...


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id(n: int) -> str:
    return uuid.uuid4().hex[:n]


def _columns(obj: Base, **given: Any) -> dict[str, Any]:
    """Every column of an ORM row, by attribute name; `given` ones as given (a deferred
    column is not loaded for them)."""
    return {attr.key: given[attr.key] if attr.key in given else getattr(obj, attr.key)
            for attr in inspect(obj).mapper.column_attrs}


def sweep_record(obj: Sweep, counts: dict[str, int] | None = None,
                 **given: Any) -> SweepRecord:
    return SweepRecord(**_columns(obj, **given), counts=counts)


def trial_record(obj: Trial, **given: Any) -> TrialRecord:
    return TrialRecord(**_columns(obj, **given))


def dump_model(value: Any) -> dict[str, Any]:
    # TrialSpec / TrialResult are pydantic models; plain mappings pass through.
    if hasattr(value, "model_dump"):
        return cast(dict[str, Any], value.model_dump(mode="json"))
    return dict(value)


def _number(value: Any, kind: type[int] | type[float]) -> int | float | None:
    """A finite number of the given kind, or None (missing, NaN and inf all read as None)."""
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(number):
        return None
    return int(number) if kind is int else number


def result_columns(result: Mapping[str, Any]) -> dict[str, Any]:
    """The values of a trial's `RESULT_COLUMNS` taken from a result dump."""
    out: dict[str, Any] = {k: _number(result.get(k), float) for k in RESULT_FLOATS}
    out.update({k: _number(result.get(k), int) for k in RESULT_INTS})
    return out


def trial_row(
    sweep_id: str,
    idx: int,
    p: PlannedRow,
    data_hash: str | None,
    max_attempts: int,
    now: datetime,
    donors: Mapping[str, TrialRecord],
    optuna_trial_number: int | None = None,
) -> dict[str, Any]:
    """The insert values for one planned trial (completed from a donor when reused)."""
    row: dict[str, Any] = {
        "id": new_id(16),
        "sweep_id": sweep_id,
        "idx": idx,
        "arm": str(p.arm),
        "width": int(p.width),
        "depth": int(p.depth),
        "lr": float(p.lr),
        "sigma_base": float(p.sigma_base),
        "seed": int(p.seed),
        "spec": dump_model(p.trial),
        "content_hash": p.content_hash,
        "data_hash": data_hash,
        "status": TrialStatus.PENDING,
        "attempts": 0,
        "max_attempts": max_attempts,
        "optuna_trial_number": optuna_trial_number,
        "stage": getattr(p, "stage", None),  # set by a study's planner
        "reason": getattr(p, "reason", None),  # why a stage target added it
        "created_at": now,
        # every row carries the same keys, so the inserts batch into one executemany
        **dict.fromkeys(RESULT_COLUMNS),
        **dict.fromkeys(("result", "worker_node", "reused_from", "started_at", "finished_at")),
    }
    donor = donors.get(p.content_hash) if p.content_hash else None
    if donor is not None:
        row.update(reused_values(donor, now))
    return row


def reused_values(donor: TrialRecord, now: datetime) -> dict[str, Any]:
    """A trial's column values when it takes `donor`'s result instead of training (the donor
    completed the same content hash on the same data)."""
    return {
        **{k: getattr(donor, k) for k in RESULT_COLUMNS},
        "status": TrialStatus.COMPLETED,
        "result": donor.result,
        "worker_node": donor.worker_node,
        # point at the trial that actually ran, not at another copy of it
        "reused_from": donor.reused_from or donor.id,
        "started_at": now,
        "finished_at": now,
    }
