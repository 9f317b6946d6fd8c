"""Coordinate check: is a parameterization's activation scale independent of width or depth?

For every size on one axis (width with depth fixed, or depth with width fixed) a model is built
with the same seed and trained ``steps`` AdamW steps on one fixed batch. At every step
t = 1..steps (t = 1 is the forward pass at init, before any update) forward hooks record the mean
|activation| of each module's output, averaged over blocks for per-block modules:

- ``embedding``: output of the input embedding table;
- ``attn_out``: each block's attention output (the branch, before the residual multiplier);
- ``mlp_out``: each block's MLP output (the branch, before the residual multiplier);
- ``final_residual``: the residual stream after the last block (input of ``ln_final`` for gpt,
  the hidden state fed to the unembedding for ngpt);
- ``logits``: the model output.

Verdict: per module, the median over steps >= ``min_step`` of the log2-log2 slope of mean|act|
against size must lie within ``+/- threshold`` (0.4 per doubling) of the expected slope; the
rules, their numbers and exemptions are in `hptransfer.workers.coordcheck_verdict`.

Layout: this module runs the check and holds its result; `coordcheck_training` trains one
model with the hooks, `coordcheck_verdict` fits slopes and judges them, `coordcheck_table` and
`coordcheck_plot` render a result. Their public names are importable from here.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hptransfer.models.build import build_model

from .coordcheck_plot import save_plot
from .coordcheck_table import format_table
from .coordcheck_training import MODULES, ordered_modules, train_and_record
from .coordcheck_verdict import (
    DEFAULT_THRESHOLD,
    Verdict,
    exemption,
    expected_slope,
    fit_slopes,
    judge,
    judged,
    parameterization_kind,
)

__all__ = [
    "AXES",
    "DEFAULT_FIXED",
    "DEFAULT_SIZES",
    "DEFAULT_THRESHOLD",
    "FALLBACK_VOCAB",
    "MODULES",
    "CoordCheckError",
    "CoordCheckResult",
    "Verdict",
    "exemption",
    "expected_slope",
    "judge",
    "judged",
    "run_coordcheck",
]

AXES = ("width", "depth")
DEFAULT_SIZES = {"width": [64, 128, 256, 512], "depth": [2, 4, 8, 16, 32]}
DEFAULT_FIXED = {"width": 2, "depth": 256}  # the depth on the width axis, the width on depth
FALLBACK_VOCAB = 256


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
        return _json_safe(
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

    def format_table(self) -> str:
        return format_table(self)

    def save_plot(self, path: str | Path) -> Path:
        """PNG: one panel per module, x = size (log2), y = mean|act| (log), a line per step."""
        return save_plot(self, path)


def run_coordcheck(
    axis: str,
    arch: str = "gpt",
    parameterization: str = "completep",
    alpha: float | None = None,
    sizes: list[int] | None = None,
    fixed: int | None = None,
    steps: int = 10,
    lr: float = 1e-3,
    batch_size: int = 8,
    seq_len: int = 64,
    seed: int = 0,
    head_dim: int = 64,
    device: str | torch.device = "cpu",
    arch_options: dict | None = None,
    base_width: int = 256,
    base_depth: int = 2,
    *,
    sigma: float = 0.02,
    eps: float = 1e-12,
    threshold: float = DEFAULT_THRESHOLD,
    min_step: int = 2,
    data: str = "auto",
    data_cache_dir: str | None = None,
) -> CoordCheckResult:
    """Train every size ``steps`` steps on one fixed batch and judge the activation scaling.

    ``lr`` is eta_base; the parameterization scales it per parameter group. ``fixed`` is the
    width on the depth axis (default 256) and the depth on the width axis (default 2).
    ``data``: "auto" uses the embedded corpus when ``hptransfer.data`` loads and falls back to
    deterministic random tokens otherwise; "corpus" requires the corpus; "random" never loads it.
    """
    started = time.perf_counter()
    if axis not in AXES:
        raise CoordCheckError(f"axis must be one of {AXES}, got {axis!r}")
    if steps < 1:
        raise CoordCheckError(f"steps must be >= 1, got {steps}")
    if data not in ("auto", "corpus", "random"):
        raise CoordCheckError(f"data must be 'auto', 'corpus' or 'random', got {data!r}")
    sizes = sorted({int(s) for s in (sizes or DEFAULT_SIZES[axis])})
    if len(sizes) < 2 or sizes[0] < 1:
        raise CoordCheckError(f"need at least two positive sizes, got {sizes}")
    fixed = int(fixed if fixed is not None else DEFAULT_FIXED[axis])
    widths = sizes if axis == "width" else [fixed]
    bad = [w for w in widths if w % head_dim]
    if bad:
        raise CoordCheckError(
            f"width(s) {bad} not divisible by head_dim {head_dim}; pass head_dim= a divisor "
            f"of every width (e.g. {math.gcd(*widths, head_dim)}) or other sizes"
        )

    x, y, vocab_size, data_source = _fixed_batch(data, batch_size, seq_len, seed, data_cache_dir)
    x, y = x.to(device), y.to(device)
    rows: list[dict] = []
    losses: list[dict] = []
    label, alpha_used = parameterization, alpha
    for size in sizes:
        width, depth = (size, fixed) if axis == "width" else (fixed, size)
        built = build_model(
            arch, width, depth, parameterization, alpha,
            head_dim=head_dim, vocab_size=vocab_size, max_seq_len=max(seq_len, 8),
            base_width=base_width, base_depth=base_depth, lr=lr, sigma=sigma,
            weight_decay=0.0, eps=eps, seed=seed, device=device, **(arch_options or {}),
        )
        label, alpha_used = built.table.parameterization, built.table.alpha
        per_step, loss_curve = train_and_record(built, x, y, steps)
        for t, means in enumerate(per_step, start=1):
            for module in MODULES:
                if module in means:
                    rows.append(
                        {"size": size, "step": t, "module": module, "mean_abs": means[module]}
                    )
        losses.extend({"size": size, "step": t, "loss": v} for t, v in enumerate(loss_curve, 1))
        del built

    slopes = fit_slopes(rows, sizes, steps)
    kind = parameterization_kind(parameterization)
    verdict = judge(slopes, axis=axis, arch=arch, kind=kind, alpha=alpha_used,
                    threshold=threshold, min_step=min_step)
    return CoordCheckResult(
        axis=axis, arch=arch, parameterization=label, alpha=alpha_used, sizes=sizes,
        fixed=fixed, steps=steps, lr=lr, batch_size=batch_size, seq_len=seq_len, seed=seed,
        head_dim=head_dim, data_source=data_source, rows=rows, slopes=slopes, verdict=verdict,
        losses=losses, seconds=round(time.perf_counter() - started, 3),
    )


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, np.generic):
        return _json_safe(obj.item())
    return obj


# ---------------------------------------------------------------------------------------------
# data


_DATASET_CACHE: dict[Any, Any] = {}


def _fixed_batch(
    data: str, batch_size: int, seq_len: int, seed: int, cache_dir: str | None
) -> tuple[torch.Tensor, torch.Tensor, int, str]:
    """(x, y, vocab_size, source): the batch reused at every step."""
    if data != "random":
        try:
            from hptransfer.data import DataSpec, load_dataset

            key = cache_dir
            if key not in _DATASET_CACHE:
                spec = DataSpec()
                _DATASET_CACHE[key] = (
                    load_dataset(spec, cache_dir) if cache_dir else load_dataset(spec)
                )
            ds = _DATASET_CACHE[key]
            x, y = ds.train_batch(0, batch_size, seq_len, seed)
            return x.long(), y.long(), int(ds.vocab_size), "corpus"
        except Exception as exc:  # ImportError, DataError, OSError: fall back, say so
            if data == "corpus":
                raise CoordCheckError(f"corpus data requested but unavailable: {exc}") from exc
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, FALLBACK_VOCAB, (batch_size, seq_len + 1), generator=g)
    return tokens[:, :-1].clone(), tokens[:, 1:].clone(), FALLBACK_VOCAB, "random"
