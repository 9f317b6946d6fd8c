"""Reading sweeps: one, a page, the active ones, and what their trials add up to (counts per
status, mean wall time)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session, defer

from hptransfer.contracts.records import SweepRecord
from hptransfer.contracts.status import TrialStatus

from .base import StoreBase
from .query import chunks
from .rows import sweep_record
from .schema import ACTIVE_STATUSES, STOPPED_SWEEP_STATUSES, TRIAL_STATUSES, Sweep, Trial


class SweepReads(StoreBase):
    def get_sweep(self, sweep_id: str) -> SweepRecord | None:
        """The sweep with its `counts` (trials per status)."""
        with self._read() as s:
            sweep = s.get(Sweep, sweep_id)
            if sweep is None:
                return None
            return sweep_record(sweep, status_counts(s, [sweep_id])[sweep_id])

    def list_sweeps(
        self, limit: int = 50, offset: int = 0, status: str | None = None,
        specs: bool = True,
    ) -> list[SweepRecord]:
        """Sweeps, newest first, each with `counts`. `specs=False`: only a study's spec is
        read (a listing drops them; the largest spec a submit takes is ~86 kB, and a page
        of 1000 such was ~190 MB in memory)."""
        with self._read() as s:
            stmt = select(Sweep).order_by(Sweep.created_at.desc(), Sweep.id.desc())
            if status is not None:
                stmt = stmt.where(Sweep.status == status)
            if not specs:
                stmt = stmt.options(defer(Sweep.spec))
            sweeps = list(s.scalars(stmt.limit(limit).offset(offset)))
            counts = status_counts(s, [x.id for x in sweeps])
            if specs:
                return [sweep_record(x, counts[x.id]) for x in sweeps]
            studies = [x.id for x in sweeps if x.study is not None]
            spec_of = {sweep_id: spec for chunk in chunks(studies)
                       for sweep_id, spec in s.execute(select(Sweep.id, Sweep.spec)
                                                       .where(Sweep.id.in_(list(chunk))))}
            return [sweep_record(x, counts[x.id], spec=spec_of.get(x.id, {}))
                    for x in sweeps]

    def active_sweeps(self) -> list[SweepRecord]:
        """Pending or running sweeps, oldest first, without counts (the dispatcher's tick)."""
        with self._read() as s:
            stmt = (select(Sweep).where(Sweep.status.in_(ACTIVE_STATUSES))
                    .order_by(Sweep.created_at, Sweep.id))
            return [sweep_record(x) for x in s.scalars(stmt)]

    def stopped_sweep_ids(self, search: str, since: datetime) -> list[str]:
        """Sweeps of that search method that stopped (cancelled, failed, stopped) since."""
        with self._read() as s:
            stmt = (select(Sweep.id)
                    .where(Sweep.status.in_(STOPPED_SWEEP_STATUSES), Sweep.search == search,
                           Sweep.finished_at >= since)
                    .order_by(Sweep.created_at, Sweep.id))
            return list(s.scalars(stmt))

    def status_counts(self, sweep_id: str) -> dict[str, int]:
        """Number of trials in every status (zeros included)."""
        with self._read() as s:
            return status_counts(s, [sweep_id])[sweep_id]

    def mean_wall_times(self, sweep_ids: Sequence[str]) -> dict[str, float]:
        """Mean wall time of the completed trials that ran (not reused), per sweep."""
        out: dict[str, float] = {}
        with self._read() as s:
            for chunk in chunks(list(sweep_ids)):
                stmt = (select(Trial.sweep_id, func.avg(Trial.wall_time_s))
                        .where(Trial.sweep_id.in_(list(chunk)),
                               Trial.status == TrialStatus.COMPLETED,
                               Trial.reused_from.is_(None), Trial.wall_time_s > 0)
                        .group_by(Trial.sweep_id))
                out.update({sid: float(v) for sid, v in s.execute(stmt) if v is not None})
        return out


def status_counts(s: Session, sweep_ids: Sequence[str]) -> dict[str, dict[str, int]]:
    """Trials per status (zeros included) of each sweep, one query per chunk of ids."""
    out = {sid: dict.fromkeys(TRIAL_STATUSES, 0) for sid in sweep_ids}
    for chunk in chunks(list(sweep_ids)):
        stmt = (
            select(Trial.sweep_id, Trial.status, func.count())
            .where(Trial.sweep_id.in_(list(chunk)))
            .group_by(Trial.sweep_id, Trial.status)
        )
        for sid, status, n in s.execute(stmt):
            out[sid][status] = int(n)
    return out
