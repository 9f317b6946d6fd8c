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
rules, their numbers and exemptions are in `hptransfer.coordcheck.verdict`.

Layout: `check` runs the check, `result` holds what it measured, `training` trains one model
with the hooks, `verdict` fits slopes and judges them, `table` and `plot` render a result.
"""

from .check import AXES, DATA_SOURCES, DEFAULT_FIXED, DEFAULT_SIZES, RANDOM_VOCAB, run_coordcheck
from .plot import save_plot
from .result import CoordCheckError, CoordCheckResult
from .table import format_table
from .training import MODULES
from .verdict import DEFAULT_THRESHOLD, Verdict, exemption, expected_slope, judge, judged

__all__ = [
    "AXES",
    "DATA_SOURCES",
    "DEFAULT_FIXED",
    "DEFAULT_SIZES",
    "DEFAULT_THRESHOLD",
    "MODULES",
    "RANDOM_VOCAB",
    "CoordCheckError",
    "CoordCheckResult",
    "Verdict",
    "exemption",
    "expected_slope",
    "format_table",
    "judge",
    "judged",
    "run_coordcheck",
    "save_plot",
]
