"""Errors and the "not enough data" reason that analyses return instead of raising."""

from __future__ import annotations

from dataclasses import dataclass


class AnalysisError(ValueError):
    """The input cannot be analysed at all (wrong type, missing columns)."""


@dataclass(frozen=True)
class NotEnoughData:
    """Why an analysis produced no estimate; returned in results, never raised."""

    what: str
    because: str

    @property
    def message(self) -> str:
        return f"not enough data for {self.what} because {self.because}"

    def __str__(self) -> str:
        return self.message

    def to_dict(self) -> dict[str, str]:
        return {"what": self.what, "because": self.because, "message": self.message}
