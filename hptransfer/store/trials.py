"""Reading trials: a filtered page of a sweep's trials, their count, one trial, the next ones
the dispatcher may lease, and a trial's attempts."""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, func, select
from sqlalchemy import cast as sql_cast
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import defer

from hptransfer.contracts.filters import TrialFilters
from hptransfer.contracts.records import AttemptRecord, TrialRecord
from hptransfer.contracts.status import TrialStatus

from .attempts import ATTEMPTS, attempt_records
from .base import StoreBase
from .query import filtered
from .reuse import waits_for_twin
from .rows import trial_record
from .schema import Attempt, Sweep, Trial


class TrialReads(StoreBase):
    def trials(self, sweep_id: str, *, limit: int | None = 100, offset: int = 0,
               curves: bool = True, **filters: Any) -> list[TrialRecord]:
        """A page of a sweep's trials in plan order (idx), narrowed by `filters` (the fields
        of TrialFilters: status, arm, width, ...). With `curves=False` each result comes
        without its curve, left in the database (a curve has a point per evaluation: a page
        of them can be hundreds of MB)."""
        stmt = filtered(select(Trial).where(Trial.sweep_id == sweep_id), TrialFilters(**filters))
        stmt = stmt.order_by(Trial.idx).offset(offset)
        if limit is not None:
            stmt = stmt.limit(limit)
        with self._read() as s:
            if curves:
                return [trial_record(t) for t in s.scalars(stmt)]
            slim = stmt.add_columns(self._result_without_curve()).options(defer(Trial.result))
            return [trial_record(t, result=result) for t, result in s.execute(slim)]

    def _result_without_curve(self) -> Any:
        """The result column less its `curve`, computed by the database."""
        if self.dialect == "postgresql":
            return sql_cast(sql_cast(Trial.result, JSONB).op("-")("curve"), JSON)
        return func.json_remove(Trial.result, "$.curve", type_=JSON)

    def count_trials(self, sweep_id: str, **filters: Any) -> int:
        """How many of a sweep's trials match `filters` (the fields of TrialFilters)."""
        stmt = filtered(
            select(func.count()).select_from(Trial).where(Trial.sweep_id == sweep_id),
            TrialFilters(**filters))
        with self._read() as s:
            return int(s.scalar(stmt) or 0)

    def get_trial(self, trial_id: str) -> TrialRecord | None:
        with self._read() as s:
            trial = s.get(Trial, trial_id)
            return None if trial is None else trial_record(trial)

    def leasable(self, sweep_id: str, limit: int) -> list[TrialRecord]:
        """The first `limit` pending trials of a sweep that `lease_pending` would lease, in
        plan order (what the dispatcher plans its packs over)."""
        stmt = (select(Trial).join(Sweep, Sweep.id == Trial.sweep_id)
                .where(Trial.sweep_id == sweep_id, Trial.status == TrialStatus.PENDING,
                       ~waits_for_twin())
                .order_by(Trial.idx).limit(limit))
        with self._read() as s:
            return [trial_record(t) for t in s.scalars(stmt)]

    def attempts(self, trial_id: str) -> list[AttemptRecord]:
        """Every lease of a trial, in order."""
        with self._read() as s:
            return attempt_records(
                s, ATTEMPTS.where(Attempt.trial_id == trial_id).order_by(Attempt.seq))
