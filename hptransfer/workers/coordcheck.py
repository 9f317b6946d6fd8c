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

Verdict. For every module and step the log2-log2 slope of mean|act| against size is fitted
(``np.polyfit``): the growth exponent per doubling of the size, 0 is flat, 1 means the
activation doubles whenever width (or depth) doubles. A module fails when the MEDIAN over the
judged steps (>= ``min_step``, 2 by default: after at least one update) of
``slope - expected`` lies outside ``+/- threshold``; ``DEFAULT_THRESHOLD = 0.4`` per doubling.

Why the median and why 0.4 (numbers from gpt, width 128, head_dim 32, L = 2..16, lr 1e-3):
- Real failures are power laws with exponent >= 1/2 (sums of L independent branches grow like
  sqrt(L), coherent updates like L or N): SP on the depth axis shows +0.65..+1.1 at every step
  >= 2 (the paper's ~40x from L=2 to 64 is ~+1.06), SP on the width axis +1.2..+2.2.
- Correct parameterizations show finite-size drift: alpha=0.5 stays within +/-0.1, but
  CompleteP's final residual stream drifts by -0.15..-0.35 over L = 2..16 (the one-update
  change |h_L(2) - h_L(1)| is 0.25, 0.21, 0.16, 0.135, 0.123, 0.122 for L = 2..64: a
  finite-depth correction that saturates, not a power law). 0.4 sits between the two.
- Training on one fixed batch gives occasional single-step loss spikes in the deeper models
  (e.g. CompleteP L=16 at step 9) whose slope can reach -0.7 for one step; the median ignores
  such spikes, and the steps beyond the threshold are still listed in ``verdict.notes``.

Expected slopes and exemptions (not failures; listed in ``verdict.notes``):
- width axis, step 1: the logits shrink with width under muP and the alpha modes (the 1/m_N
  output multiplier acts before the unembedding has learned anything);
- depth axis, alpha = 1 (CompleteP), step 1: the final residual stream falls with depth (the
  L branches are each scaled by 1/m_L, so their sum shrinks towards the embedding);
- depth axis, alpha < 1: the branch outputs ``attn_out`` / ``mlp_out`` may shrink: each layer's
  weights move like m_L^(alpha-1) (the "lazy" layers the CompleteP paper removes) while the
  residual stream stays flat; shrinking steps count as deviation 0;
- arch ngpt, width axis: representations live on the unit sphere in R^N, so a coordinate is
  ~N^(-1/2) by construction: the expected slope is -0.5 (embedding, final residual, logits at
  init); the branch outputs are normalized right after the branch, so their scale never reaches
  the residual stream: reported, not judged.

Step-1 exemptions only matter when ``min_step`` is 1; with the default the step-1 slopes are
reported (notes) but do not decide the verdict.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hptransfer.models.build import BuiltModel, build_model
from hptransfer.models.parameterization import optimizer_groups

AXES = ("width", "depth")
MODULES = ("embedding", "attn_out", "mlp_out", "final_residual", "logits")
DEFAULT_SIZES = {"width": [64, 128, 256, 512], "depth": [2, 4, 8, 16, 32]}
DEFAULT_FIXED = {"width": 2, "depth": 256}  # the depth on the width axis, the width on depth
DEFAULT_THRESHOLD = 0.4  # |median log2 growth per doubling| beyond which a module fails
FALLBACK_VOCAB = 256


class CoordCheckError(ValueError):
    """Invalid coord-check settings (axis, sizes, head_dim)."""


@dataclass
class Verdict:
    passed: bool
    reasons: list[str]
    modules: dict[str, str]  # module -> stable | grows | shrinks | diverged | not judged
    notes: list[str] = field(default_factory=list)
    threshold: float = DEFAULT_THRESHOLD
    min_step: int = 2
    median_slopes: dict[str, float | None] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        """Mapping-style access too: ``verdict["passed"]`` is ``verdict.passed``."""
        return self.to_dict()[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.to_dict().get(key, default)

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "reasons": list(self.reasons),
            "modules": dict(self.modules),
            "notes": list(self.notes),
            "threshold": self.threshold,
            "min_step": self.min_step,
            "median_slopes": dict(self.median_slopes),
        }


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
        present = {r["module"] for r in self.rows}
        return [m for m in MODULES if m in present]

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
        last = self.steps
        modules = self.modules()
        lines = [f"coord check: {self.label}, lr={self.lr:g}, data={self.data_source}"]
        lines.append(f"mean |activation| at step {last}")
        lines.append(f"{'module':<16}" + "".join(f"{self.axis[0]}={s:<9}" for s in self.sizes))
        for m in modules:
            vals = "".join(f"{_fmt(self.value(s, last, m)):<11}" for s in self.sizes)
            lines.append(f"{m:<16}{vals}")
        lines.append("")
        lines.append(
            f"log2-log2 slope per doubling of {self.axis}; fail: |median over steps >= "
            f"{self.verdict.min_step} - expected| > {self.verdict.threshold:g}"
        )
        head = "".join(f"t={t:<6}" for t in range(1, last + 1))
        lines.append(f"{'module':<16}{head}{'median':<9}verdict")
        for m in modules:
            vals = "".join(f"{self.slope(m, t):<+8.2f}" for t in range(1, last + 1))
            med = self.verdict.median_slopes.get(m)
            med_s = f"{med:+.2f}" if med is not None and math.isfinite(med) else "-"
            lines.append(f"{m:<16}{vals}{med_s:<9}{self.verdict.modules.get(m, '?')}")
        lines.append("")
        lines.append("PASSED" if self.verdict.passed else "FAILED")
        lines.extend(f"  - {r}" for r in self.verdict.reasons)
        lines.extend(f"  note: {n}" for n in self.verdict.notes)
        return "\n".join(lines)

    def save_plot(self, path: str | Path) -> Path:
        """PNG: one panel per module, x = size (log2), y = mean|act| (log), a line per step."""
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        from matplotlib import cm
        from matplotlib.colors import Normalize
        from matplotlib.ticker import NullFormatter

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        modules = self.modules()
        fig, axes = plt.subplots(
            1, len(modules), figsize=(3.0 * len(modules) + 1.2, 3.4), squeeze=False,
            layout="constrained",
        )
        norm = Normalize(vmin=1, vmax=max(self.steps, 2))
        cmap = matplotlib.colormaps["viridis"]
        for ax, m in zip(axes[0], modules, strict=True):
            finite = []
            for t in range(1, self.steps + 1):
                ys = [self.value(s, t, m) for s in self.sizes]
                finite += [v for v in ys if math.isfinite(v) and v > 0]
                ax.plot(self.sizes, ys, marker="o", ms=3, lw=1.2, color=cmap(norm(t)))
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            if finite:  # at least one decade, so a flat curve looks flat
                lo, hi = min(finite), max(finite)
                if hi / lo < 10.0:
                    mid = math.sqrt(lo * hi)
                    lo, hi = mid / math.sqrt(10.0), mid * math.sqrt(10.0)
                ax.set_ylim(lo / 1.15, hi * 1.15)
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xticks(self.sizes)
            ax.set_xticklabels([str(s) for s in self.sizes], fontsize=7)
            ax.set_xlabel(self.axis)
            med = self.verdict.median_slopes.get(m)
            med_s = f", slope {med:+.2f}" if med is not None and math.isfinite(med) else ""
            ax.set_title(f"{m} [{self.verdict.modules.get(m, '?')}{med_s}]", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
        axes[0][0].set_ylabel("mean |activation|")
        mappable = cm.ScalarMappable(norm=norm, cmap=cmap)
        fig.colorbar(mappable, ax=list(axes[0]), label="step", fraction=0.02, pad=0.01)
        status = "passed" if self.verdict.passed else "failed"
        fig.suptitle(f"coord check: {self.label}, lr={self.lr:g} ({status})", fontsize=10)
        fig.savefig(path, dpi=90)
        plt.close(fig)
        return path


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
        per_step, loss_curve = _train_and_record(built, x, y, steps)
        for t, means in enumerate(per_step, start=1):
            for module in MODULES:
                if module in means:
                    rows.append(
                        {"size": size, "step": t, "module": module, "mean_abs": means[module]}
                    )
        losses.extend({"size": size, "step": t, "loss": v} for t, v in enumerate(loss_curve, 1))
        del built

    slopes = _fit_slopes(rows, sizes, steps)
    kind = _kind(parameterization)
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


# ---------------------------------------------------------------------------------------------
# training with hooks


def _mean_abs(t: torch.Tensor) -> float:
    return float(t.detach().float().abs().mean())


class _Recorder:
    """Forward hooks collecting mean|act| per module (per-block modules: one value per block)."""

    def __init__(self, model: nn.Module) -> None:
        self.values: dict[str, list[float]] = {}
        self.handles: list[Any] = []
        self.enabled = True
        self._hook(model.embed, "embedding")
        for block in model.blocks:
            self._hook(block.attn, "attn_out")
            self._hook(block.mlp, "mlp_out")
        final = model.ln_final if hasattr(model, "ln_final") else model.unembed
        self.handles.append(final.register_forward_pre_hook(self._pre("final_residual")))
        self._hook(model, "logits")

    def _hook(self, module: nn.Module, name: str) -> None:
        def hook(_mod: nn.Module, _inp: Any, out: torch.Tensor) -> None:
            if self.enabled:
                self.values.setdefault(name, []).append(_mean_abs(out))

        self.handles.append(module.register_forward_hook(hook))

    def _pre(self, name: str) -> Callable:
        def hook(_mod: nn.Module, inp: tuple) -> None:
            if self.enabled:
                self.values.setdefault(name, []).append(_mean_abs(inp[0]))

        return hook

    def take(self) -> dict[str, float]:
        out = {k: float(np.mean(v)) for k, v in self.values.items()}
        self.values = {}
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _train_and_record(
    built: BuiltModel, x: torch.Tensor, y: torch.Tensor, steps: int
) -> tuple[list[dict[str, float]], list[float]]:
    model = built.model
    model.train()
    opt = torch.optim.AdamW(optimizer_groups(model, built.table), betas=(0.9, 0.95))
    recorder = _Recorder(model)
    per_step: list[dict[str, float]] = []
    loss_curve: list[float] = []
    try:
        for t in range(1, steps + 1):
            logits = model(x)
            per_step.append(recorder.take())
            loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
            loss_curve.append(float(loss.detach()))
            if t == steps:
                break  # the last recorded forward needs no update after it
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            built.after_step()
    finally:
        recorder.remove()
    return per_step, loss_curve


# ---------------------------------------------------------------------------------------------
# slopes and verdict


def _fit_slopes(rows: list[dict], sizes: list[int], steps: int) -> list[dict]:
    table = {(r["size"], r["step"], r["module"]): r["mean_abs"] for r in rows}
    modules = [m for m in MODULES if any(r["module"] == m for r in rows)]
    lx = np.log2(np.asarray(sizes, dtype=float))
    slopes = []
    for m in modules:
        for t in range(1, steps + 1):
            vals = np.asarray([table[(s, t, m)] for s in sizes], dtype=float)
            if np.all(np.isfinite(vals)) and np.all(vals > 0):
                slope = float(np.polyfit(lx, np.log2(vals), 1)[0])
            else:
                slope = float("nan")  # diverged (inf/nan) or exactly zero somewhere
            slopes.append({"module": m, "step": t, "slope": slope})
    return slopes


def _kind(parameterization: str) -> str:
    if parameterization in ("sp", "mup", "ngpt"):
        return parameterization
    return "alpha"


def expected_slope(arch: str, axis: str, module: str) -> float:
    """The slope a correct parameterization shows: 0, except nGPT's unit-sphere coordinates."""
    if arch == "ngpt" and axis == "width":
        return -0.5
    return 0.0


def judged(arch: str, axis: str, module: str) -> bool:
    """nGPT normalizes each branch output right after the branch (h_a = norm(attn(h))), so the
    branch's scale never reaches the residual stream: reported, not judged."""
    return not (arch == "ngpt" and module in ("attn_out", "mlp_out"))


def exemption(
    axis: str, kind: str, alpha: float | None, module: str, step: int
) -> tuple[str, str] | None:
    """(allowed direction, why) for a known, expected deviation; None otherwise."""
    if axis == "width" and module == "logits" and kind in ("mup", "alpha") and step == 1:
        return "shrinks", "output logits shrink with width at init (1/m_N output multiplier)"
    if axis == "depth" and kind == "alpha" and alpha is not None:
        if module == "final_residual" and alpha == 1.0 and step == 1:
            return "shrinks", "CompleteP's final residual stream falls with depth at init"
        if module in ("attn_out", "mlp_out") and alpha < 1.0:
            return "shrinks", (
                f"alpha={alpha:g} < 1: per-layer feature updates shrink like m_L^(alpha-1) "
                "(the lazy layers CompleteP removes), while the residual stream stays flat"
            )
    return None


def judge(
    slopes: Iterable[dict],
    *,
    axis: str,
    arch: str,
    kind: str,
    alpha: float | None,
    threshold: float = DEFAULT_THRESHOLD,
    min_step: int = 2,
) -> Verdict:
    """Per module: the median over judged steps of (slope - expected), an allowed direction
    counting as 0, must lie within +/- threshold. See the module docstring."""
    slopes = list(slopes)
    modules = [m for m in MODULES if any(s["module"] == m for s in slopes)]
    reasons: list[str] = []
    notes: list[str] = []
    verdicts: dict[str, str] = {}
    medians: dict[str, float | None] = {}
    for m in modules:
        exp = expected_slope(arch, axis, m)
        mine = sorted((s for s in slopes if s["module"] == m), key=lambda s: s["step"])
        if not judged(arch, axis, m):
            verdicts[m] = "not judged"
            medians[m] = None
            notes.append(f"{m}: not judged ({arch} normalizes it before it is used)")
            continue
        exempted: set[str] = set()
        devs: list[tuple[int, float]] = []  # (step, deviation) over judged steps
        raw: list[float] = []
        diverged: list[int] = []
        for s in mine:
            t, slope = s["step"], s["slope"]
            if not math.isfinite(slope):
                if t >= min_step:
                    diverged.append(t)
                continue
            dev = slope - exp
            if t < min_step:
                if abs(dev) > threshold:
                    ex = exemption(axis, kind, alpha, m, t)
                    why = f"expected - {ex[1]}" if ex else "init, not judged"
                    notes.append(f"{m} step {t}: slope {slope:+.2f} ({why})")
                continue
            ex = exemption(axis, kind, alpha, m, t)
            if ex is not None and (ex[0] == "shrinks") == (dev < 0) and abs(dev) > threshold:
                exempted.add(ex[1])
                dev = 0.0
            devs.append((t, dev))
            raw.append(slope)
        for why in sorted(exempted):
            notes.append(f"{m}: shrinking allowed - {why}")
        if diverged:
            verdicts[m] = "diverged"
            medians[m] = None
            reasons.append(f"{m}: non-finite or zero activations at steps {diverged}")
            continue
        if not devs:
            verdicts[m] = "stable"
            medians[m] = None
            continue
        med = float(np.median([d for _, d in devs]))
        medians[m] = float(np.median(raw))
        outliers = [(t, d) for t, d in devs if abs(d) > threshold]
        if abs(med) <= threshold:
            verdicts[m] = "stable"
            if outliers:
                worst = max(outliers, key=lambda td: abs(td[1]))
                notes.append(
                    f"{m}: median slope {medians[m]:+.2f} is within range, but steps "
                    f"{[t for t, _ in outliers]} are not (worst {worst[1] + exp:+.2f} at step "
                    f"{worst[0]})"
                )
            continue
        verdicts[m] = "grows" if med > 0 else "shrinks"
        worst = max(devs, key=lambda td: abs(td[1]))
        reasons.append(
            f"{m} {verdicts[m]} with {axis}: median slope {medians[m]:+.2f} per doubling over "
            f"steps {devs[0][0]}-{devs[-1][0]} (expected {exp:+.2f} +/- {threshold:g}; worst "
            f"{worst[1] + exp:+.2f} at step {worst[0]}; out of range at "
            f"{len(outliers)} of {len(devs)} steps)"
        )
    return Verdict(
        passed=not reasons, reasons=reasons, modules=verdicts, notes=notes,
        threshold=threshold, min_step=min_step, median_slopes=medians,
    )


# ---------------------------------------------------------------------------------------------
# helpers


def _fmt(v: float) -> str:
    return f"{v:.3e}" if math.isfinite(v) else str(v)


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
