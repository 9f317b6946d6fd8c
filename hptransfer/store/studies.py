"""Staged studies: planning a study's next stage (with its trials) exactly once, and the
trials per stage that its progress is read from."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import func, select

from hptransfer.contracts.status import SweepStatus, TrialStatus
from hptransfer.redaction import redact

from .base import StoreBase, locked_sweep
from .query import chunks
from .reuse import insert_trials, sweep_donors
from .rows import PlannedRow, trial_row, utcnow
from .schema import STOPPED_SWEEP_STATUSES, SWEEP_STATUSES, TRIAL_STATUSES, Trial
from .sweeps import next_idx


class Studies(StoreBase):
    def plan_stage(
        self,
        sweep_id: str,
        expected_round: int,
        study: Mapping[str, Any],
        planned: Iterable[PlannedRow],
        stop: tuple[str, str | None] | None = None,
    ) -> bool:
        """Record a study's next stage and insert its trials in ONE transaction.

        Restart safety: `expected_round` is the planning round the caller planned from
        (`study["round"]` before); if another call (or an earlier coordinator) already
        recorded a newer round, nothing is written and False is returned, so a stage is never
        planned twice. A kill before commit leaves no trace; the next tick plans again.
        `stop`: (status, error) to end the sweep with instead (e.g. "stopped", reason).
        """
        items = list(planned)
        now = utcnow()
        with self._write() as s:
            sweep = locked_sweep(s, sweep_id)
            if sweep.status in STOPPED_SWEEP_STATUSES:
                return False
            if int((sweep.study or {}).get("round", 0)) != expected_round:
                return False
            start = next_idx(s, sweep_id)
            donors = sweep_donors(s, sweep, [p.content_hash for p in items])
            rows = [
                trial_row(sweep_id, start + i, p, sweep.data_hash, sweep.max_attempts, now,
                          donors)
                for i, p in enumerate(items)
            ]
            insert_trials(s, rows, now)
            sweep.n_trials += len(rows)
            sweep.study = dict(study)
            if stop is not None:
                status, reason = stop
                if status not in SWEEP_STATUSES:
                    raise ValueError(f"sweep status must be one of {SWEEP_STATUSES}")
                sweep.status, sweep.error, sweep.finished_at = status, redact(reason), now
                sweep.started_at = sweep.started_at or now
            elif any(r["status"] == TrialStatus.PENDING for r in rows):
                sweep.status, sweep.finished_at = SweepStatus.RUNNING, None
                sweep.started_at = sweep.started_at or now
            return True

    def stage_counts(self, sweep_id: str) -> dict[str | None, dict[str, int]]:
        """Trials per study stage and status (stage None: trials outside a study)."""
        return self.stage_counts_of([sweep_id])[sweep_id]

    def stage_counts_of(
        self, sweep_ids: Sequence[str]
    ) -> dict[str, dict[str | None, dict[str, int]]]:
        """`stage_counts` of several sweeps in one query (per chunk of ids)."""
        out: dict[str, dict[str | None, dict[str, int]]] = {sid: {} for sid in sweep_ids}
        with self._read() as s:
            for chunk in chunks(list(sweep_ids)):
                stmt = (select(Trial.sweep_id, Trial.stage, Trial.status, func.count())
                        .where(Trial.sweep_id.in_(list(chunk)))
                        .group_by(Trial.sweep_id, Trial.stage, Trial.status))
                for sid, stage, status, n in s.execute(stmt):
                    out[sid].setdefault(stage, dict.fromkeys(TRIAL_STATUSES, 0))[status] = int(n)
        return out
