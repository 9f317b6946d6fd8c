"""Status and uncertainty fields shared by the curve fits (power law, Chinchilla)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import NotEnoughData


# kw_only: these defaulted fields sit after each fit's own required, positional fields.
@dataclass(kw_only=True)
class FitResult:
    """What every fit carries besides its parameters; `reason` is set when no fit was possible."""

    trial_ids: list[list[str]] = field(default_factory=list)
    ci: dict[str, tuple[float, float]] = field(default_factory=dict)
    ci_level: float = 0.95
    reliable: bool = False
    warnings: list[str] = field(default_factory=list)
    reason: NotEnoughData | None = None

    @property
    def ok(self) -> bool:
        return self.reason is None

    def ci_dict(self) -> dict[str, Any]:
        """The `ci` and `ci_level` entries of `to_dict`."""
        return {"ci": {k: list(v) for k, v in self.ci.items()}, "ci_level": self.ci_level}

    def status_dict(self) -> dict[str, Any]:
        """The closing `reliable`, `warnings` and `reason` entries of `to_dict`."""
        return {"reliable": self.reliable, "warnings": self.warnings, "reason": self.reason}

    def status_row(self) -> dict[str, Any]:
        """The `reliable`, `reason` and `warnings` cells of a `to_frame` row."""
        return {
            "reliable": self.reliable,
            "reason": str(self.reason) if self.reason else None,
            "warnings": list(self.warnings),
        }
