"""The coord check's result: what was measured and the verdict, as a dataclass."""

from __future__ import annotations

from dataclasses import dataclass, field

# the package's one NaN->None scrubber (analysis/ may not import upwards, so it lives there)
from hptransfer.jsonsafe import json_safe

from .training import ordered_modules
from .verdict import Verdict


class CoordCheckError(ValueError):
    """Invalid coord-check settings (axis, sizes, head_dim)."""


@dataclass
class CoordCheckResult:
    axis: str
    arch: str
    parameterization: str
    alpha: float | None
    sizes: list[int]
    fixed: int
    steps: int
    lr: float
    batch_size: int
    seq_len: int
    seed: int
    head_dim: int
    data_source: str  # "corpus" (hptransfer.data) or "random" (deterministic random tokens)
    rows: list[dict]  # {size, step, module, mean_abs}
    slopes: list[dict]  # {module, step, slope}
    verdict: Verdict
    losses: list[dict] = field(default_factory=list)  # {size, step, loss}
    seconds: float = 0.0

    @property
    def label(self) -> str:
        fixed = f"depth={self.fixed}" if self.axis == "width" else f"width={self.fixed}"
        return f"{self.arch} / {self.parameterization} / {self.axis} axis ({fixed})"

    def value(self, size: int, step: int, module: str) -> float:
        for r in self.rows:
            if r["size"] == size and r["step"] == step and r["module"] == module:
                return r["mean_abs"]
        raise KeyError((size, step, module))

    def slope(self, module: str, step: int) -> float:
        for s in self.slopes:
            if s["module"] == module and s["step"] == step:
                return s["slope"]
        raise KeyError((module, step))

    def ratio(self, module: str, step: int) -> float:
        """mean|act| at the largest size over that at the smallest."""
        return self.value(self.sizes[-1], step, module) / self.value(self.sizes[0], step, module)

    def modules(self) -> list[str]:
        return ordered_modules(r["module"] for r in self.rows)

    def to_dict(self) -> dict:
        return json_safe(
            {
                "axis": self.axis,
                "arch": self.arch,
                "parameterization": self.parameterization,
                "alpha": self.alpha,
                "sizes": list(self.sizes),
                "fixed": self.fixed,
                "steps": self.steps,
                "lr": self.lr,
                "batch_size": self.batch_size,
                "seq_len": self.seq_len,
                "seed": self.seed,
                "head_dim": self.head_dim,
                "data_source": self.data_source,
                "rows": self.rows,
                "slopes": self.slopes,
                "losses": self.losses,
                "verdict": self.verdict.to_dict(),
                "seconds": self.seconds,
            }
        )

