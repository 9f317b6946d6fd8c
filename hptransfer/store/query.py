"""Statement building blocks shared by the Store's operations: trial filters, chunked IN-lists
and bulk UPDATEs."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from sqlalchemy import Select, Update
from sqlalchemy.engine import CursorResult
from sqlalchemy.orm import Session

from .schema import Trial

T = TypeVar("T")

CHUNK = 500  # rows / IN-list items per statement, well inside every driver's limits


def chunks(items: Sequence[T], size: int = CHUNK) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def bulk_update(s: Session, stmt: Update) -> int:
    """Run an UPDATE straight in the database (no ORM session sync); its rowcount."""
    result = s.execute(stmt.execution_options(synchronize_session=False))
    return cast(CursorResult[Any], result).rowcount


@dataclass(frozen=True)
class TrialFilters:
    status: str | Sequence[str] | None = None
    arm: str | None = None
    width: int | None = None
    depth: int | None = None
    sigma_base: float | None = None
    seed: int | None = None
    stage: str | None = None  # a study's stage (tune, transfer, check, aspect_ratio)

    def apply(self, stmt: Select[Any]) -> Select[Any]:
        if isinstance(self.status, str):
            stmt = stmt.where(Trial.status == self.status)
        elif self.status is not None:
            stmt = stmt.where(Trial.status.in_(list(self.status)))
        if self.arm is not None:
            stmt = stmt.where(Trial.arm == self.arm)
        if self.width is not None:
            stmt = stmt.where(Trial.width == int(self.width))
        if self.depth is not None:
            stmt = stmt.where(Trial.depth == int(self.depth))
        if self.sigma_base is not None:
            # exact: the value is the planner's float, stored as a double and read back as is
            stmt = stmt.where(Trial.sigma_base == float(self.sigma_base))
        if self.seed is not None:
            stmt = stmt.where(Trial.seed == int(self.seed))
        if self.stage is not None:
            stmt = stmt.where(Trial.stage == self.stage)
        return stmt
