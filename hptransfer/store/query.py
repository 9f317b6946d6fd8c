"""Statement building blocks shared by the Store's operations: trial filters as SQL, chunked
IN-lists and bulk UPDATEs."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, TypeVar, cast

from sqlalchemy import Select, Update
from sqlalchemy.engine import CursorResult
from sqlalchemy.orm import Session

from hptransfer.contracts.filters import TrialFilters

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


def filtered(stmt: Select[Any], filters: TrialFilters) -> Select[Any]:
    """`stmt` narrowed to the trials that match every filter that is set."""
    if isinstance(filters.status, str):
        stmt = stmt.where(Trial.status == filters.status)
    elif filters.status is not None:
        stmt = stmt.where(Trial.status.in_(list(filters.status)))
    if filters.arm is not None:
        stmt = stmt.where(Trial.arm == filters.arm)
    if filters.width is not None:
        stmt = stmt.where(Trial.width == int(filters.width))
    if filters.depth is not None:
        stmt = stmt.where(Trial.depth == int(filters.depth))
    if filters.sigma_base is not None:
        # exact: the value is the planner's float, stored as a double and read back as is
        stmt = stmt.where(Trial.sigma_base == float(filters.sigma_base))
    if filters.seed is not None:
        stmt = stmt.where(Trial.seed == int(filters.seed))
    if filters.stage is not None:
        stmt = stmt.where(Trial.stage == filters.stage)
    return stmt
