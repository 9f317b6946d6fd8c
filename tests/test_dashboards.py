"""Dashboards: rendering on synthetic fit reports (edge cases included), and the real service
in headless Chromium while a sweep runs and after it completes."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pandas as pd
import pytest

from hptransfer.analysis import fit_report
from hptransfer.dashboards import (
    dashboard_artifacts,
    render_index_html,
    render_not_found_html,
    render_sweep_html,
    write_sweep_dashboard,
)
from hptransfer.dashboards.pngs import frontier_png, lr_png
from hptransfer.store.store import RESULT_FRAME_COLUMNS

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = Path(__file__).resolve().parents[1] / "benchmarks" / "out" / "screenshots"
NO_DATA = "not enough data for"
BAD = ("Traceback", "could not render", "nan%", ">nan<")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- synthetic data


def synthetic_frame(
    arms: tuple[str, ...] = ("gpt-completep", "gpt-sp"),
    widths: tuple[int, ...] = (64, 128, 256),
    depths: tuple[int, ...] = (2, 4, 8),
    log2_lrs: tuple[int, ...] = tuple(range(-11, -3)),
    seeds: tuple[int, ...] = (0, 1),
    iso: bool = True,
) -> pd.DataFrame:
    """A frame like `store.results_frame`: η* transfers for CompleteP and halves per width
    doubling for SP; LRs 2.5 octaves above η* diverge; `iso` adds 5 shapes of ~equal size."""
    rng = np.random.default_rng(0)
    shapes = {(w, d) for w in widths for d in depths}
    if iso:
        shapes |= {(64, 64), (128, 16), (256, 4), (512, 1), (96, 28)}
    rows = []
    for arm in arms:
        sp = arm.endswith("sp")
        for w, d in sorted(shapes):
            n = 12 * w * w * d
            base = 2.0 + 40 * n**-0.3 + 0.04 * np.log(w / d / 16) ** 2 + (0.05 if sp else 0.0)
            opt = -7.0 - (np.log2(w / 64) if sp else 0.0)
            for x in log2_lrs:
                for s in seeds:
                    diverged = x > opt + 2.5
                    loss = base + 0.06 * (x - opt) ** 2 + rng.normal(0, 0.004)
                    rows.append({
                        "trial_id": f"{arm}-{w}-{d}-{x}-{s}", "arm": arm, "arch": "gpt",
                        "parameterization": "sp" if sp else "completep", "width": w,
                        "depth": d, "lr": 2.0**x, "sigma_base": 0.02, "seed": s,
                        "status": "diverged" if diverged else "completed",
                        "final_val_loss": np.nan if diverged else loss, "flops": 6.0 * n * 1e6,
                        "tokens": 1e6, "params_non_embedding": float(n),
                        "params_embedding": 1e4, "wall_time_s": 1.0, "reused": False,
                    })
    return pd.DataFrame(rows, columns=list(RESULT_FRAME_COLUMNS))


def summary_of(frame: pd.DataFrame, status: str = "completed") -> dict:
    counts = frame["status"].value_counts().to_dict() if len(frame) else {}
    done = sum(v for k, v in counts.items() if k not in ("pending", "running"))
    return {"id": "s1", "name": "synthetic", "status": status, "counts": counts,
            "total": len(frame), "done": done, "progress": done / max(len(frame), 1),
            "eta_s": 42.0}


def render(frame: pd.DataFrame, status: str = "completed", **kw) -> str:
    report = fit_report(frame, bootstrap=20)
    return render_sweep_html(summary_of(frame, status), frame, report, **kw)


def n_figures(html: str) -> int:
    return html.count("Plotly.newPlot(")


def assert_clean(html: str) -> None:
    for bad in BAD:
        assert bad not in html, bad


# ---------------------------------------------------------------- rendering


def test_full_sweep_draws_every_figure():
    frame = synthetic_frame()
    html = render(frame)
    assert_clean(html)
    # two LR rows (one per arm) + frontier + savings + N:L
    assert n_figures(html) == 5
    assert NO_DATA not in html
    assert '<script src="/dashboards/static/plotly.min.js"></script>' in html
    assert 'http-equiv="refresh"' not in html  # a finished sweep does not reload itself
    # transfer verdicts: CompleteP transfers across width, SP drifts
    rows = re.findall(r"<tr><td>(gpt-[a-z]+)</td><td>[^<]*</td><td>(width|depth)</td>"
                      r".*?class=\"v-(\w+)\"", html)
    verdicts = {(arm, axis): v for arm, axis, v in rows}
    assert verdicts[("gpt-completep", "width")] == "transfers"
    assert verdicts[("gpt-sp", "width")] == "drifts"
    assert "L = " in html and "optimum N:L" in html  # power-law legend, cubic optimum


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("empty", "not enough data for the optimal LR because there are no trials"),
        ("all_diverged", "finished trials diverged"),
        ("pending_only", "no trial has finished as completed or diverged"),
        ("single_width", "only one width"),
        ("single_lr", "the quadratic fit needs at least 3"),
        ("nan_flops", "no shape has a completed run with a recorded flops value"),
        ("missing_column", "the trial table is unusable"),
    ],
)
def test_not_enough_data_is_explained(case, expected):
    frame = synthetic_frame()
    if case == "empty":
        frame = frame.iloc[:0]
    elif case == "all_diverged":
        frame = frame.assign(status="diverged", final_val_loss=np.nan)
    elif case == "pending_only":
        frame = frame.assign(status="pending", final_val_loss=np.nan, flops=np.nan)
    elif case == "single_width":
        frame = synthetic_frame(widths=(64,), depths=(2, 4), iso=False)
    elif case == "single_lr":
        frame = synthetic_frame(log2_lrs=(-7,), iso=False)
    elif case == "nan_flops":
        frame = frame.assign(flops=np.nan)
        frame.loc[frame.index[::7], "final_val_loss"] = np.nan  # completed with a NaN loss
    elif case == "missing_column":
        frame = frame.drop(columns=["lr"])
    html = render(frame)
    assert_clean(html)
    assert expected in html
    assert html.count('class="nodata"') >= 1
    for title in ("Loss vs learning rate", "Transfer drift", "Loss vs compute", "FLOP savings",
                  "Compute-optimal aspect ratio", "Coordinate checks"):
        assert title in html, title  # every section is there, as a figure or a box
    if n_figures(html) == 0:
        assert "plotly.min.js" not in html  # no figure, no 4.6 MB of JavaScript


def test_half_finished_sweep_with_failures_shows_progress_and_partial_curves():
    frame = synthetic_frame(iso=False)
    order = np.random.default_rng(1).permutation(len(frame))
    frame.loc[order[: len(frame) // 2], ["status", "final_val_loss"]] = ["pending", np.nan]
    frame.loc[order[-3:], ["status", "final_val_loss"]] = ["failed", np.nan]
    frame.loc[order[-6:-3], ["status", "final_val_loss"]] = ["running", np.nan]
    trials = frame.assign(id=frame["trial_id"], attempts=1, started_at=None,
                          worker_node="node-1", error="RuntimeError: boom\nCUDA out of memory")
    report = fit_report(frame, bootstrap=0)
    html = render_sweep_html(summary_of(frame, "running"), trials, report)
    assert_clean(html)
    assert '<meta http-equiv="refresh" content="5">' in html
    assert "Running now (3)" in html and "Failed trials (3" in html
    assert "CUDA out of memory" in html  # the last line of the error
    assert "ETA" in html and "42 s" in html
    assert n_figures(html) >= 2  # the LR curves are drawn from what has finished


def test_report_none_and_index_and_not_found_pages():
    html = render_sweep_html(summary_of(synthetic_frame().iloc[:0], "pending"), [], None)
    assert_clean(html)
    assert "because the fits were not computed" in html
    assert "No coordinate check yet" in html and "hpt coordcheck" in html
    empty = render_index_html([])
    assert "no sweeps yet" in empty and 'http-equiv="refresh"' not in empty
    running = {**summary_of(synthetic_frame(), "running"), "id": "abc"}
    index = render_index_html([running])
    assert 'href="/dashboards/sweeps/abc"' in index and 'http-equiv="refresh"' in index
    assert "<script" not in render_not_found_html("No sweep with id 'x'.").split("</head>")[1]


def test_coordcheck_png_is_embedded(tmp_path):
    folder = tmp_path / "coordcheck"
    folder.mkdir()
    (folder / "depth.png").write_bytes(PNG_MAGIC + b"fake")
    html = render_sweep_html(summary_of(synthetic_frame()), [], None, coordcheck_dir=folder)
    assert 'alt="depth.png"' in html and "data:image/png;base64," in html
    (folder / "depth.png").unlink()  # none yet: the page says where, not the server's path
    html = render_sweep_html(summary_of(synthetic_frame()), [], None, coordcheck_dir=folder)
    assert "under $HPT_HOME/coordcheck" in html and str(tmp_path) not in html


def test_static_pngs_for_mlflow():
    report = fit_report(synthetic_frame(), bootstrap=0)
    for png in (lr_png(report), frontier_png(report)):
        assert png is not None and png.startswith(PNG_MAGIC) and len(png) > 10_000
    empty = fit_report(synthetic_frame().iloc[:0], bootstrap=0)
    assert lr_png(empty) is None and frontier_png(empty) is None


# ---------------------------------------------------------------- real browser


def chromium(url: str, shot: Path, budget_ms: int, height: int) -> tuple[str, list[str]]:
    """Load `url` headless: the DOM after scripts ran, the console lines, a screenshot."""
    profile = shot.parent / f"profile-{shot.stem}"
    cmd = [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
           "--hide-scrollbars", f"--virtual-time-budget={budget_ms}",
           f"--window-size=1400,{height}", f"--screenshot={shot}", "--dump-dom", url]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = [line for line in proc.stderr.splitlines()
               if "CONSOLE" in line or "Uncaught" in line]
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, SCREENSHOTS / shot.name)
    return proc.stdout, console


def drawn_plots(dom: str) -> tuple[int, int]:
    """(figures on the page, figures Plotly has drawn an <svg class="main-svg"> into)."""
    total = len(re.findall(r'<div[^>]*class="[^"]*plotly-graph-div', dom))
    parts = re.split(r'<div[^>]*class="[^"]*js-plotly-plot[^"]*"', dom)[1:]
    return total, sum(1 for p in parts if re.search(r'<svg[^>]*class="main-svg"', p))


def check_page(
    url: str, shot: Path, min_plots: int, budget_ms: int = 10_000, height: int = 2400
) -> str:
    """No console message or script error, and every figure on the page drawn as SVG."""
    dom, console = chromium(url, shot, budget_ms, height)
    assert console == [], console
    assert 'id="hpt-js-errors"' not in dom and "Traceback" not in dom
    total, drawn = drawn_plots(dom)
    assert drawn == total >= min_plots, (total, drawn)
    return dom


needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="no /usr/bin/chromium (CI installs it with scripts/install_chromium.sh)",
)


@needs_chromium
def test_synthetic_dashboard_file_in_headless_chromium(tmp_path):
    path = tmp_path / "synthetic.html"
    path.write_text(render(synthetic_frame(), plotly="inline", home=None))
    check_page(path.as_uri(), tmp_path / "synthetic_full.png", 5, height=4200)


@pytest.fixture
def server(hpt_home, ray_cluster):
    from hptransfer.api.server import serve_in_thread
    from hptransfer.config import get_settings

    settings = get_settings()
    with serve_in_thread(settings) as url:
        yield url, settings


@needs_chromium
def test_dashboards_in_headless_chromium(server, tiny_spec, tmp_path):
    from hptransfer.client import Client
    from hptransfer.store.store import Store

    url, settings = server
    # two widths and two depths, so both panels have curves; 2^1 is meant to diverge
    tiny_spec["grid"].update(widths=[32, 64], depths=[1, 2], lrs=[2**-8, 2**-6, 2**-4, 2.0])
    with Client(url) as client:
        sweep = client.submit(tiny_spec)
        sid = sweep["id"]
        deadline = time.time() + 120
        while client.get(sid)["done"] < 2 and time.time() < deadline:
            time.sleep(0.2)
        # half-finished: under the 5 s auto-refresh, so the DOM is that of the first load
        live = check_page(f"{url}/dashboards/sweeps/{sid}", tmp_path / "sweep_live.png", 0,
                          budget_ms=4000)
        status = re.search(r"<b>status</b> (\w+)</span>", live).group(1)
        assert ('http-equiv="refresh"' in live) == (status in ("pending", "running"))
        check_page(f"{url}/dashboards", tmp_path / "index_live.png", 0, 4000, height=600)
        final = client.wait(sid, poll=0.3, timeout=300, progress=False)
    assert final["status"] == "completed"

    dom = check_page(f"{url}/dashboards/sweeps/{sid}", tmp_path / "sweep_done.png", 1)
    assert 'http-equiv="refresh"' not in dom and "Loss vs learning rate" in dom
    index = check_page(f"{url}/dashboards", tmp_path / "index_done.png", 0, height=600)
    assert f'href="/dashboards/sweeps/{sid}"' in index

    missing = httpx.get(f"{url}/dashboards/sweeps/nope")
    assert missing.status_code == 404 and "text/html" in missing.headers["content-type"]
    js = httpx.get(f"{url}/dashboards/static/plotly.min.js")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    assert len(js.content) > 1_000_000

    # offline: one self-contained file (no server, no CDN), and the MLflow artifacts
    with Store(settings.database_url) as store:
        path = write_sweep_dashboard(store, sid, tmp_path / "offline")
        artifacts = dashboard_artifacts(store, sid)
    text = path.read_text()
    assert not re.search(r"<script[^>]+src=", text)  # plotly.js is inlined, not fetched
    assert "cdn." not in re.sub(r"<script>.*?</script>", "", text, flags=re.S)
    check_page(path.as_uri(), tmp_path / "sweep_offline.png", 1)
    assert set(artifacts) >= {"dashboards/sweep.html", "dashboards/loss_vs_lr.png"}
    assert artifacts["dashboards/loss_vs_lr.png"][:8] == PNG_MAGIC


# ---------------------------------------------------------------- a staged study's page


def study_frame() -> pd.DataFrame:
    """A study's frame: tune at 64x2, a ladder, an LR bracket at its top, 5 N:L shapes."""
    rng = np.random.default_rng(1)
    rows = []

    def add(stage, arm, w, d, x, opt, sp):
        n = 12 * w * w * d
        loss = (2.0 + 40 * n**-0.3 + 0.04 * np.log(w / d / 16) ** 2 + (0.05 if sp else 0.0)
                + 0.06 * (x - opt) ** 2 + rng.normal(0, 0.003))
        rows.append({
            "trial_id": f"{stage}-{arm}-{w}-{d}-{x}", "arm": arm, "arch": "gpt",
            "parameterization": "sp" if sp else "completep", "width": w, "depth": d,
            "lr": 2.0**x, "sigma_base": 0.02, "seed": 0, "status": "completed",
            "final_val_loss": loss, "flops": 6.0 * n * 20 * n, "tokens": 20.0 * n,
            "params_non_embedding": float(n), "params_embedding": 1e4, "wall_time_s": 1.0,
            "reused": False, "stage": stage})

    for arm in ("gpt-completep", "gpt-sp"):
        sp = arm.endswith("sp")

        def opt(w, sp=sp):
            return -7.0 - (0.5 * np.log2(w / 64) if sp else 0.0)

        for x in range(-10, -3):
            add("tune", arm, 64, 2, x, opt(64), sp)
        for w, d in [(64, 2), (96, 3), (128, 4), (192, 6), (256, 8), (384, 12)]:
            add("transfer", arm, w, d, -7.0, opt(w), sp)
        for off in (-2, -1, 1):
            add("check", arm, 384, 12, -7.0 + off, opt(384), sp)
        for w, d in [(64, 64), (128, 16), (256, 4), (512, 1), (96, 28)]:
            add("aspect_ratio", arm, w, d, -7.0, opt(64), sp)
    return pd.DataFrame(rows, columns=list(RESULT_FRAME_COLUMNS))


def study_page(**kw) -> str:
    from hptransfer.analysis.study_report import study_fit_report

    frame = study_frame()
    summary = summary_of(frame)
    summary["stages"] = [
        {"stage": s, "state": "done", "planned": True, "done": int(n), "total": int(n),
         "progress": 1.0, "counts": {"completed": int(n)}}
        for s, n in frame.groupby("stage", sort=False).size().items()]
    return render_sweep_html(summary, frame, study_fit_report(frame, bootstrap=30), **kw)


def test_study_page_shows_the_stages_in_order():
    html = study_page()
    assert_clean(html)
    order = [html.index(f'<section id="{a}">') for a in ("progress", "headline", "lr", "check",
                                                          "frontier", "savings", "aspect")]
    assert order == sorted(order)
    assert "Transfer drift" not in html  # the plain sweep's section is not a study's
    for stage in ("tune", "transfer", "check", "aspect_ratio"):
        assert f"<td>{stage}</td>" in html  # the progress table lists every stage
    assert "[tune]" in html and "[tune + check]" in html and "[aspect_ratio]" in html
    assert "η* transferred" in html and "shift (log2)" in html


@needs_chromium
def test_study_page_in_headless_chromium(tmp_path):
    path = tmp_path / "study.html"
    path.write_text(study_page(plotly="inline", home=None))
    # tune curves, transfer check, frontier, savings, N:L: every figure drawn
    check_page(path.as_uri(), tmp_path / "study_page.png", 5, height=5200)



def test_a_study_with_a_mup_arm_labels_its_over_mup_band_by_arm() -> None:
    """The study's CompleteP-over-µP comparison is keyed "arm|reference": its legend read
    "gpt-completep|gpt-mup vs gpt-mup" in no arm's colour."""
    from hptransfer.analysis.study_report import study_fit_report
    from hptransfer.dashboards.series import savings_series

    frame = study_frame()
    mup = frame[frame["arm"] == "gpt-sp"].assign(arm="gpt-mup", parameterization="mup")
    mup["final_val_loss"] += 0.02
    frame = pd.concat([frame, mup], ignore_index=True)
    report = study_fit_report(frame, bootstrap=0)
    bands = {(b.arm, b.reference) for b in savings_series(report.savings)}
    assert ("gpt-completep", "gpt-mup") in bands
    assert all("|" not in arm for arm, _ in bands), bands
    html = render_sweep_html(summary_of(frame), frame, report)
    assert "gpt-completep|gpt-mup" not in html and "gpt-completep vs gpt-mup" in html


def test_running_trials_show_behind_many_failures_and_every_failure_is_counted(tmp_path,
                                                                               tiny_spec):
    """A sweep's running and failed trials came in one query of 500 in plan order: 510
    failures planned first hid the 3 trials running after them ("No trial is running")."""
    from hptransfer.coordinator.plan import plan_sweep
    from hptransfer.dashboards.export import NOTABLE_LIMIT, sweep_data
    from hptransfer.dashboards.progress import FAILED_SHOWN
    from hptransfer.spec import load_spec
    from hptransfer.store.store import Store

    spec = dict(tiny_spec, grid={**tiny_spec["grid"], "depths": [1, 2, 3],
                                 "seeds": list(range(60))})
    planned = plan_sweep(load_spec(spec))  # 3 depths x 3 LRs x 60 seeds: 540
    store = Store(f"sqlite:///{tmp_path}/hpt.db")
    store.migrate()
    sid = store.create_sweep("big", spec, "h", "grid", planned)
    n_failed = NOTABLE_LIMIT + 10
    for t in store.lease_pending("me", len(planned)):
        if t.idx < n_failed:
            store.finish_trial(t.id, "failed", None, f"RuntimeError: boom {t.idx}")
    data = sweep_data(store, sid, bootstrap=0)
    html = render_sweep_html(data.summary, data.trials, None)
    assert f"Running now ({len(planned) - n_failed})" in html
    assert f"Failed trials ({n_failed}; the last {FAILED_SHOWN}, last error line)" in html
    assert f"boom {n_failed - 1}<" in html and "boom 0<" not in html
    store.close()


def test_a_failed_trial_without_error_text_in_a_frame_renders() -> None:
    # a DataFrame of trials holds NaN where a failed trial has no error: .strip() on it broke
    # the whole Progress section
    trials = pd.DataFrame([{"id": "t1", "status": "failed", "error": "RuntimeError: boom"},
                           {"id": "t2", "status": "failed"}])
    summary = {"id": "s1", "name": "x", "status": "failed", "counts": {"failed": 2},
               "total": 2, "done": 2}
    html = render_sweep_html(summary, trials, None)
    assert "could not render" not in html and "Failed trials (2; last error line)" in html

def test_every_trial_status_has_a_colour_chip_and_bar_segment():
    from hptransfer.contracts.status import TrialStatus
    from hptransfer.dashboards.html import STATUS_COLORS, progress_bar, status_chips

    assert set(STATUS_COLORS) == set(TrialStatus)
    counts = {str(s): 1 for s in TrialStatus}  # counts come from the store keyed by string
    chips = status_chips(counts)
    bar = progress_bar(counts, len(counts))
    for status in TrialStatus:
        assert f"s-{status}" in chips
        if status is not TrialStatus.PENDING:  # pending is the bar's empty remainder
            assert f'title="{status}: 1"' in bar
