"""The report of a staged study: every fit from the stage it belongs to (`STAGE_SOURCES`)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from hptransfer.contracts.sizes import SIZE_TOLERANCE

from .aspect_ratio import optimal_aspect_ratio
from .chinchilla import chinchilla_fit
from .frontier import loss_compute_frontier
from .noise import ETA_CI_LOG2
from .optimal_lr import optimal_lr
from .report import FitReport
from .staged import STAGE_SOURCES, by_budget, param_of, study_savings, transfer_check
from .stats import single_threaded_blas
from .trials import CORE_COLUMNS, prepare_trials


def study_fit_report(
    df: pd.DataFrame,
    reference_arm: str | None = None,
    *,
    bootstrap: int = 200,
    seed: int | None = 0,
    ci: float = 0.95,
    size_tolerance: float = SIZE_TOLERANCE,
    within: float = 0.01,
    n_grid: int = 20,
    neighbours: int = 2,
    max_ci_log2: float = ETA_CI_LOG2,
) -> FitReport:
    """A `FitReport` whose every analysis comes from its stage (see `STAGE_SOURCES`);
    `neighbours`: LRs each side of the best that the tune stage's η* is fitted on;
    `max_ci_log2`: the widest η* or shift CI (half-width, octaves) that is reliable."""
    report = FitReport(bootstrap=bootstrap, seed=seed)
    report.stages = dict(STAGE_SOURCES)
    try:
        trials = prepare_trials(df, CORE_COLUMNS)
    except Exception as exc:
        report.error = str(exc)
        report.n_trials = len(df) if isinstance(df, pd.DataFrame) else 0
        return report
    report.n_trials = trials.n_input
    report.status_counts = trials.status_counts

    def part(*stages: str) -> pd.DataFrame:
        return df[df["stage"].isin(stages)].drop(columns=["stage"])

    def run(name: str, fn: Any) -> Any:
        try:
            return fn()
        except Exception as exc:  # one analysis' bug must not take the report down
            report.failures[name] = f"{type(exc).__name__}: {exc}"
            return None

    with single_threaded_blas():
        tune = part("tune")
        report.optimal_lr = run("optimal_lr", lambda: optimal_lr(
            tune, bootstrap=bootstrap, seed=seed, ci=ci, neighbours=neighbours,
            max_ci_log2=max_ci_log2))
        report.transfer_check = run("transfer_check", lambda: transfer_check(
            df, bootstrap=bootstrap, seed=seed, ci=ci, base_fit=report.optimal_lr,
            neighbours=neighbours, max_ci_log2=max_ci_log2))
        # a ladder shape may run at two token budgets: each (shape, tokens) is its own point,
        # so the frontier takes the lower envelope and L(N, D) sees D vary at fixed N
        ladder = run("frontier", lambda: by_budget(part("transfer"), "flops"))
        # one E for all arms: a study's arms share corpus, tokenizer and validation tokens
        if ladder is not None:
            report.frontier = run("frontier", lambda: loss_compute_frontier(
                ladder, bootstrap=bootstrap, seed=seed, ci=ci, shared_asymptote=True))
        if report.frontier is not None:
            report.warnings.extend(report.frontier.left_out)
            report.savings = run("savings", lambda: study_savings(
                report.frontier, reference_arm, param_of(df), n_grid, ci))
            if report.savings is not None:
                report.reference_arm = report.savings.reference
        report.aspect_ratio = run("aspect_ratio", lambda: optimal_aspect_ratio(
            part("aspect_ratio"), tolerance=size_tolerance, within=within,
            bootstrap=bootstrap, seed=seed, ci=ci))
        if report.aspect_ratio is not None:  # in the text too, not only the JSON
            report.warnings.extend(report.aspect_ratio.set_aside)
        report.chinchilla = run("chinchilla", lambda: chinchilla_fit(
            by_budget(part("transfer", "aspect_ratio"), "params_non_embedding"),
            bootstrap=bootstrap, seed=seed, ci=ci))
    return report
