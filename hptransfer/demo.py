"""`hpt demo`: a small real study on the CPU through the whole path
(spec -> REST API -> database -> Ray -> trainer -> MLflow), then the fits and dashboards.

The default is a staged study (examples/cpu_study.yaml): tune η at the base shape per
parameterization, transfer it up a ladder, check the transfer at the largest shape, vary
width:depth at fixed size, then fit: η*, transfer shift, frontier, FLOP savings, N:L."""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from hptransfer.api.server import serve_in_thread
from hptransfer.client import ApiError, Client, read_spec_file
from hptransfer.config import get_settings
from hptransfer.spec import load_spec
from hptransfer.tracking.tracking import UI_HOST, UI_PORT, ui_url

DEFAULT_SPEC = Path(__file__).resolve().parent.parent / "examples" / "cpu_study.yaml"


def best_lr_table(df) -> str:
    """Per arm and shape: the best LR on the grid and its loss (seeds averaged)."""
    done = df[df["status"] == "completed"]
    if done.empty:
        return "no completed trials"
    mean = done.groupby(["arm", "depth", "width", "lr"], as_index=False)["final_val_loss"].mean()
    best = mean.loc[mean.groupby(["arm", "depth", "width"])["final_val_loss"].idxmin()]
    diverged = (df[df["status"] == "diverged"].groupby(["arm", "depth", "width"]).size()
                .rename("n_diverged"))
    best = best.join(diverged, on=["arm", "depth", "width"]).fillna({"n_diverged": 0})
    best["log2_lr"] = best["lr"].map(lambda v: f"{math.log2(v):+.1f}")
    return best[["arm", "depth", "width", "lr", "log2_lr", "final_val_loss", "n_diverged"]] \
        .to_string(index=False)


def search_cost(df, spec_path: str) -> str:
    """What an Optuna sweep trained, against the full grid over the same LR range."""
    from hptransfer.spec import load_spec

    n_lrs = len(load_spec(spec_path).grid.lr_values())
    shape = ["arm", "width", "depth", "sigma_base", "seed"]
    full = df.groupby(shape)["tokens"].max()  # a completed trial's tokens: the full budget
    grid = float(full.sum()) * n_lrs
    trained = float(df["tokens"].sum())
    pruned = df[df["status"] == "pruned"]
    return (f"tokens trained: {trained:.4g} = {trained / grid:.3f} of the full grid "
            f"({n_lrs} LRs x {len(full)} shapes = {grid:.4g}); {len(pruned)} trials pruned")


def planned_line(plan: dict[str, Any]) -> str:
    """The plan's price of the sweep's wall time, as the demo prints it before submitting."""
    t = plan["total"]
    if t["wall_s"] is None:
        return "hpt plan: no wall time (the trials cannot run on this cluster)"
    return (f"hpt plan: {t['planned']}-{t['trials']} trials, {t['wall_s_planned']:.1f}-"
            f"{t['wall_s']:.1f} s of wall time (throughput: {plan['throughput']['detail']})")


def against_plan(seconds: float, plan: dict[str, Any] | None) -> str:
    """The sweep's measured wall time (submit to its end) over the plan's two figures."""
    t = plan["total"] if plan else {"wall_s": None, "wall_s_planned": None}
    if not t["wall_s"] or not t["wall_s_planned"]:
        return f"took {seconds:.1f} s from submit; the plan gave no wall time"
    return (f"took {seconds:.1f} s from submit: {seconds / t['wall_s_planned']:.2f}x the "
            f"plan's {t['wall_s_planned']:.1f} s without extension rounds, "
            f"{seconds / t['wall_s']:.2f}x its {t['wall_s']:.1f} s at most")


def run_demo(spec_path: str | None = None, out_dir: str | None = None) -> int:
    # the demo's output is the sweep; Ray's start-up chatter is not
    for noisy in ("ray", "mlflow", "alembic"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    # mlflow resets its loggers when first imported (later, lazily): tell it via its env var
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    settings = get_settings()
    spec_path = spec_path or str(DEFAULT_SPEC)
    # a missing, broken or invalid spec is refused before Ray starts (seconds of CPU)
    spec = read_spec_file(spec_path)
    load_spec(spec)
    out = Path(out_dir) if out_dir else settings.home / "demo"
    out.mkdir(parents=True, exist_ok=True)
    print(f"hptransfer demo: data dir {settings.home}, spec {spec_path}")
    t0 = time.time()
    with serve_in_thread(settings) as url, Client(url, token=settings.api_token) as client:
        # priced by a micro-run measured now, so the comparison below meets the host's
        # speed of this hour (a cached calibration may come from an idler or busier one)
        try:
            plan: dict[str, Any] | None = client.plan(spec, calibrate=True)
        except ApiError as exc:  # the spec is valid (checked above): unpriced, it still runs
            plan = None
            print(f"hpt plan: not priced: {exc.message}", flush=True)
        else:
            print(planned_line(plan), flush=True)
        submitted = time.time()
        sweep = client.submit(spec)
        print(f"sweep {sweep['id']}: {sweep['total']} trials, running on Ray ...")
        sweep = client.wait(sweep["id"])
        took = time.time() - submitted
        df = client.trials(sweep["id"])
        print(f"\nsweep {sweep['status']} in {time.time() - t0:.0f} s: "
              + ", ".join(f"{k} {v}" for k, v in sweep["counts"].items() if v))
        print(against_plan(took, plan))
        if sweep.get("error"):
            print(f"{sweep['status']}: {sweep['error']}")
        if sweep.get("stages"):
            print("\nstages: " + ", ".join(f"{st['stage']} {st['done']}/{st['total']}"
                                           for st in sweep["stages"]))
        else:
            print("\nbest LR per shape (lowest completed loss, seeds averaged)\n"
                  + best_lr_table(df))
        if "optuna_trial_number" in df and df["optuna_trial_number"].notna().any():
            print("\n" + search_cost(df, spec_path))
        _print_fits(client, sweep["id"], out)
    print(f"\nMLflow runs: {settings.mlflow_uri}  (browse with `hpt mlflow-ui`: "
          f"{ui_url(f'http://{UI_HOST}:{UI_PORT}', sweep.get('mlflow_experiment_id'))})")
    return 0 if sweep["status"] == "completed" else 1  # "stopped" says why above


def _print_fits(client: Client, sweep_id: str, out: Path) -> None:
    from hptransfer.dashboards import write_sweep_dashboard
    from hptransfer.store.store import Store

    print("\n" + client.fits_text(sweep_id))
    store = Store(get_settings().database_url)
    try:
        path = write_sweep_dashboard(store, sweep_id, out)
    finally:
        store.close()
    print(f"\ndashboard written to {path}; live pages: `hpt serve`, then /dashboards")
