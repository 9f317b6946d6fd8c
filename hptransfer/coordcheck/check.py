"""Runs the coordinate check (see the package docstring)."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from hptransfer.models.build import build_model

from .result import CoordCheckError, CoordCheckResult
from .training import MODULES, train_and_record
from .verdict import (
    DEFAULT_THRESHOLD,
    fit_slopes,
    judge,
    parameterization_kind,
)

AXES = ("width", "depth")
DEFAULT_SIZES = {"width": [64, 128, 256, 512], "depth": [2, 4, 8, 16, 32]}
DEFAULT_FIXED = {"width": 2, "depth": 256}  # the depth on the width axis, the width on depth
DATA_SOURCES = ("corpus", "random")
RANDOM_VOCAB = 256  # vocabulary of the random-token batch


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
    data: str,
    data_cache_dir: str | None = None,
) -> CoordCheckResult:
    """Train every size ``steps`` steps on one fixed batch and judge the activation scaling.

    ``lr`` is eta_base; the parameterization scales it per parameter group. ``fixed`` is the
    width on the depth axis (default 256) and the depth on the width axis (default 2).
    ``data`` (required, so a run always says what it trains on): "corpus" is the embedded
    stdlib corpus, and a failure to load it is a `CoordCheckError`, never a silent switch;
    "random" is deterministic random tokens and never loads the corpus.
    """
    started = time.perf_counter()
    if axis not in AXES:
        raise CoordCheckError(f"axis must be one of {AXES}, got {axis!r}")
    if steps < max(1, min_step):  # a check that judges no step would pass anything
        raise CoordCheckError(f"steps must be >= {max(1, min_step)} (min_step: the first step "
                              f"judged), got {steps}")
    if data not in DATA_SOURCES:
        raise CoordCheckError(f"data must be one of {DATA_SOURCES}, got {data!r}")
    sizes = sorted({int(s) for s in (sizes or DEFAULT_SIZES[axis])})
    if len(sizes) < 2 or sizes[0] < 1:
        raise CoordCheckError(f"need at least two positive sizes, got {sizes}")
    fixed = int(fixed if fixed is not None else DEFAULT_FIXED[axis])
    widths = sizes if axis == "width" else [fixed]
    bad = [w for w in widths if w % head_dim]
    if bad:
        common = math.gcd(*widths, head_dim)
        rope = (arch_options or {}).get("position", "rope") == "rope"
        fix = ("other sizes (RoPE needs an even head_dim, and none divides every width)"
               if rope and common % 2 else f"head_dim= a divisor of every width (e.g. "
               f"{common}) or other sizes")
        raise CoordCheckError(f"width(s) {bad} not divisible by head_dim {head_dim}; pass {fix}")

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


# ---------------------------------------------------------------------------------------------
# data


_DATASET_CACHE: dict[Any, Any] = {}


def _fixed_batch(
    data: str, batch_size: int, seq_len: int, seed: int, cache_dir: str | None
) -> tuple[torch.Tensor, torch.Tensor, int, str]:
    """(x, y, vocab_size, source): the batch reused at every step, from ``data`` only."""
    if data == "random":
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, RANDOM_VOCAB, (batch_size, seq_len + 1), generator=g)
        return tokens[:, :-1].clone(), tokens[:, 1:].clone(), RANDOM_VOCAB, "random"
    try:
        from hptransfer.data import DataError, DataSpec, load_dataset
    except ImportError as exc:
        raise CoordCheckError(_corpus_unavailable(exc)) from exc
    try:
        if cache_dir not in _DATASET_CACHE:
            spec = DataSpec()
            _DATASET_CACHE[cache_dir] = (
                load_dataset(spec, cache_dir) if cache_dir else load_dataset(spec)
            )
    except (DataError, OSError) as exc:
        raise CoordCheckError(_corpus_unavailable(exc)) from exc
    ds = _DATASET_CACHE[cache_dir]
    x, y = ds.train_batch(0, batch_size, seq_len, seed)
    return x.long(), y.long(), int(ds.vocab_size), "corpus"


def _corpus_unavailable(exc: Exception) -> str:
    return (
        f"corpus data unavailable ({type(exc).__name__}: {exc}); pass data='random' "
        "(hpt coordcheck --data random) to run on random tokens instead"
    )
