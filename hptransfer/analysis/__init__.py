"""Analysis of hyperparameter-transfer sweeps: η* per shape, transfer drift, compute fits.

Pure pandas + numpy + scipy, usable from a notebook without the service. Input is a frame of
trial results (one row per trial); see `trials.CORE_COLUMNS`. Every function returns a result
with `.to_frame()` and a JSON-safe `.to_dict()`; when data are insufficient the result carries a
`NotEnoughData` reason instead of raising. Only unusable input raises `AnalysisError`.
"""

from .aspect_ratio import AspectRatioResult, fit_cubic_optimum, group_by_size, optimal_aspect_ratio
from .chinchilla import (
    ChinchillaFit,
    ChinchillaResult,
    chinchilla_fit,
    compute_optimal_allocation,
    fit_chinchilla,
)
from .errors import AnalysisError, NotEnoughData
from .frontier import FrontierResult, frontier_mask, loss_compute_frontier
from .optimal_lr import OptimalLRResult, optimal_lr
from .parabola import fit_lr_parabola
from .powerlaw import PowerLawFit, fit_power_law
from .report import TABLE_NAMES, FitReport, fit_report
from .savings import SavingsComparison, SavingsResult, compare_fits, flop_savings
from .transfer import SlopeFit, TransferResult, fit_slope, transfer_drift
from .trials import CORE_COLUMNS, Trials, prepare_trials

__all__ = [
    "CORE_COLUMNS",
    "TABLE_NAMES",
    "AnalysisError",
    "AspectRatioResult",
    "ChinchillaFit",
    "ChinchillaResult",
    "FitReport",
    "FrontierResult",
    "NotEnoughData",
    "OptimalLRResult",
    "PowerLawFit",
    "SavingsComparison",
    "SavingsResult",
    "SlopeFit",
    "TransferResult",
    "Trials",
    "chinchilla_fit",
    "compare_fits",
    "compute_optimal_allocation",
    "fit_chinchilla",
    "fit_cubic_optimum",
    "fit_lr_parabola",
    "fit_power_law",
    "fit_report",
    "fit_slope",
    "flop_savings",
    "frontier_mask",
    "group_by_size",
    "loss_compute_frontier",
    "optimal_aspect_ratio",
    "optimal_lr",
    "prepare_trials",
    "transfer_drift",
]
