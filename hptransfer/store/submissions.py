"""Idempotent submits: an `Idempotency-Key` names one sweep for IDEMPOTENCY_WINDOW_S.

The key is claimed in the transaction that stores the sweep (`claim`), so of two identical
submits racing, one creates the sweep and the other gets it back: on SQLite the write lock
orders them; on PostgreSQL the key's primary key refuses the second insert, and
`create_sweep` then reads the winner (`SweepLifecycle.create_sweep`).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import delete
from sqlalchemy.orm import Session

from .base import StoreBase, StoreError
from .rows import utcnow
from .schema import Submission

# How long a key names its sweep: a retry within a day is a retry; after it, a new submit.
IDEMPOTENCY_WINDOW_S = 24 * 3600


class IdempotencyConflict(StoreError):
    """The key was used, within the window, by a request with a different body."""

    def __init__(self, key: str, sweep_id: str) -> None:
        self.key, self.sweep_id = key, sweep_id
        super().__init__(
            f"Idempotency-Key {key!r} was used for a different request body (sweep "
            f"{sweep_id}) in the last {IDEMPOTENCY_WINDOW_S // 3600} h: send a new key for a "
            f"new sweep, or the same body to get sweep {sweep_id} back")


def earlier_sweep(s: Session, key: str, body_hash: str, now: datetime) -> str | None:
    """The sweep the key created within the window (IdempotencyConflict if it was for
    another body); None if the key is new or expired."""
    row = s.get(Submission, key)
    if row is None or row.created_at < now - timedelta(seconds=IDEMPOTENCY_WINDOW_S):
        return None
    if row.body_hash != body_hash:
        raise IdempotencyConflict(key, row.sweep_id)
    return row.sweep_id


def claim(s: Session, key: str, body_hash: str, sweep_id: str, now: datetime) -> None:
    """Record the key for the new sweep (`earlier_sweep` found none in the window); expired
    keys, this one's included, are deleted first."""
    s.execute(delete(Submission).where(
        Submission.created_at < now - timedelta(seconds=IDEMPOTENCY_WINDOW_S)))
    s.add(Submission(key=key, body_hash=body_hash, sweep_id=sweep_id, created_at=now))


class Submissions(StoreBase):
    def submitted_sweep(self, key: str, body_hash: str) -> str | None:
        """The sweep a submit with this key and body created within the window, or None;
        IdempotencyConflict if the key was used for another body."""
        with self._read() as s:
            return earlier_sweep(s, key, body_hash, utcnow())

