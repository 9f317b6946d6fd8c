"""Coord checks (hptransfer.coordcheck): the physics on small CPU models, the verdict
rules, serialisation and plots.

Numbers seen when these settings were chosen (gpt, width 128, head_dim 32, L = 2, 4, 8, 16,
lr 1e-3, batch 8 x 64, 10 steps, seeds 0-4), slope = log2-log2 slope of mean |final residual|
against depth at steps 2..10:
- SP: median +0.93..+1.09, every step >= +0.58; L=16 / L=2 at step 10: 10x-15x.
- alpha = 0.5: median -0.14..+0.01, every step within +/-0.25; ratio 0.66-1.31.
- alpha = 1 (CompleteP): median -0.09..-0.25, never above +0.05; single steps down to -0.66
  (a one-step loss spike of the L=16 model on the fixed batch); ratio 0.62-1.05. The mild fall is
  a finite-depth effect that saturates: the one-update change of h_L is 0.25, 0.21, 0.16, 0.135,
  0.123, 0.122 for L = 2..64.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from hptransfer.coordcheck import (
    MODULES,
    CoordCheckError,
    format_table,
    judge,
    run_coordcheck,
    save_plot,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DEPTHS = [2, 4, 8, 16]
DEPTH_RUN = dict(
    axis="depth", sizes=DEPTHS, fixed=128, head_dim=32, steps=10, lr=1e-3, batch_size=8,
    seq_len=64, seed=0, data="corpus",
)
WIDTHS = [64, 128, 256, 512]
WIDTH_RUN = dict(
    axis="width", sizes=WIDTHS, fixed=2, head_dim=32, steps=10, lr=1e-3, batch_size=4,
    seq_len=32, seed=0, data="corpus",
)
HIDDEN = ("attn_out", "mlp_out", "final_residual")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("hpt-cache"))


@pytest.fixture(scope="module")
def depth_runs(data_dir):
    return {
        p: run_coordcheck(parameterization=p, data_cache_dir=data_dir, **DEPTH_RUN)
        for p in ("sp", "depth_mup", "completep")
    }


@pytest.fixture(scope="module")
def width_runs(data_dir):
    return {
        p: run_coordcheck(parameterization=p, data_cache_dir=data_dir, **WIDTH_RUN)
        for p in ("sp", "mup")
    }


def slopes_after_init(result, module: str) -> list[float]:
    return [result.slope(module, t) for t in range(2, result.steps + 1)]


# --- the physics -----------------------------------------------------------------------------


def test_sp_final_residual_grows_with_depth(depth_runs):
    sp = depth_runs["sp"]
    slopes = slopes_after_init(sp, "final_residual")
    assert min(slopes) > 0.5, slopes  # at every step after the first update
    assert np.median(slopes) > 0.8
    assert sp.ratio("final_residual", 10) > 5.0  # L=16 vs L=2 at step 10 (seen: ~10x)
    assert not sp.verdict.passed
    assert sp.verdict.modules["final_residual"] == "grows"
    assert any("final_residual grows with depth" in r for r in sp.verdict.reasons)


def test_depth_mup_final_residual_stays_flat(depth_runs):
    run = depth_runs["depth_mup"]
    slopes = slopes_after_init(run, "final_residual")
    assert max(abs(s) for s in slopes) < 0.25, slopes
    assert 0.6 < run.ratio("final_residual", 10) < 1.6
    assert run.verdict.passed, run.verdict.reasons
    # its lazy branches may shrink with depth; that is noted, not failed
    assert run.verdict.modules["mlp_out"] == "stable"


def test_completep_final_residual_stays_flat(depth_runs):
    run = depth_runs["completep"]
    slopes = slopes_after_init(run, "final_residual")
    assert abs(np.median(slopes)) < 0.4, slopes
    assert max(slopes) < 0.25, slopes  # it never grows with depth
    assert 0.4 < run.ratio("final_residual", 10) < 1.6
    assert run.verdict.passed, run.verdict.reasons
    # at init it falls with depth (branches scaled by 1/m_L): expected, and said so
    assert run.slope("final_residual", 1) < -0.25
    assert any("final_residual step 1" in n and "expected" in n for n in run.verdict.notes)


def test_sp_separates_from_alpha_modes_at_every_step(depth_runs):
    sp = slopes_after_init(depth_runs["sp"], "final_residual")
    for p in ("depth_mup", "completep"):
        other = slopes_after_init(depth_runs[p], "final_residual")
        gaps = [a - b for a, b in zip(sp, other, strict=True)]
        assert min(gaps) > 0.6, (p, gaps)


def test_width_axis_mup_flat_sp_grows(width_runs):
    sp, mup = width_runs["sp"], width_runs["mup"]
    for m in HIDDEN:
        assert min(slopes_after_init(sp, m)) > 1.0, m
        assert max(abs(s) for s in slopes_after_init(mup, m)) < 0.3, m
        assert sp.verdict.modules[m] == "grows"
        assert mup.verdict.modules[m] == "stable"
    assert mup.verdict.passed, mup.verdict.reasons
    assert not sp.verdict.passed
    # muP's logits shrink with width at init (1/m_N multiplier): expected, noted, not failed
    assert mup.slope("logits", 1) < -0.4
    assert any("logits step 1" in n and "expected" in n for n in mup.verdict.notes)


# --- result object ---------------------------------------------------------------------------


def test_rows_cover_every_size_step_and_module(depth_runs):
    run = depth_runs["completep"]
    assert run.data_source == "corpus"  # the physics above ran on the real corpus
    assert len(run.rows) == len(DEPTHS) * 10 * len(MODULES)
    assert {r["module"] for r in run.rows} == set(MODULES)
    assert all(np.isfinite(r["mean_abs"]) and r["mean_abs"] > 0 for r in run.rows)
    assert len(run.slopes) == 10 * len(MODULES)
    assert run.parameterization == "completep" and run.alpha == 1.0
    assert len(run.losses) == len(DEPTHS) * 10


def test_to_dict_json_round_trip(depth_runs):
    d = depth_runs["sp"].to_dict()
    text = json.dumps(d, allow_nan=False)
    assert json.loads(text) == d
    assert d["verdict"]["passed"] is False
    assert d["axis"] == "depth" and d["sizes"] == DEPTHS and d["fixed"] == 128
    assert set(d["rows"][0]) == {"size", "step", "module", "mean_abs"}
    assert set(d["slopes"][0]) == {"module", "step", "slope"}


def test_format_table_and_png(depth_runs, tmp_path):
    run = depth_runs["completep"]
    table = format_table(run)
    for m in MODULES:
        assert m in table
    assert "PASSED" in table and "median" in table
    path = save_plot(run, tmp_path / "sub" / "completep_depth.png")
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000


def test_ngpt_runs_on_both_axes_and_plots(data_dir, tmp_path):
    small = dict(steps=3, batch_size=2, seq_len=16, head_dim=32, data="corpus",
                 data_cache_dir=data_dir)
    w = run_coordcheck("width", arch="ngpt", parameterization="ngpt", sizes=[64, 128], **small)
    d = run_coordcheck(
        "depth", arch="ngpt", parameterization="ngpt", sizes=[1, 2], fixed=64, **small
    )
    for run in (w, d):
        assert {r["module"] for r in run.rows} == set(MODULES)
        assert json.loads(json.dumps(run.to_dict(), allow_nan=False)) == run.to_dict()
    # unit-norm hidden state: a coordinate is ~N^-1/2, so the expected width slope is -0.5
    assert w.slope("final_residual", 3) == pytest.approx(-0.5, abs=0.05)
    assert w.verdict.modules["final_residual"] == "stable"
    assert w.verdict.modules["attn_out"] == "not judged"
    assert d.verdict.passed, d.verdict.reasons
    path = save_plot(w, tmp_path / "ngpt.png")
    assert path.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(
    ("parameterization", "alpha", "options"),
    [
        ("sp", None, {}),
        ("mup", None, {}),
        ("depth_mup", None, {}),
        ("completep", None, {"x0_mixing": True, "extra_embeddings": 1}),
        ("depth_alpha", 0.75, {"bias": True}),
    ],
)
def test_every_gpt_parameterization_runs(data_dir, parameterization, alpha, options):
    run = run_coordcheck(
        "depth", parameterization=parameterization, alpha=alpha, sizes=[2, 4], fixed=64,
        head_dim=32, steps=2, batch_size=2, seq_len=16, arch_options=options,
        data="corpus", data_cache_dir=data_dir,
    )
    assert run.data_source == "corpus"
    assert len(run.rows) == 2 * 2 * len(MODULES)
    assert all(np.isfinite(r["mean_abs"]) for r in run.rows)
    if alpha is not None:
        assert run.alpha == alpha and run.parameterization == "depth_alpha(0.75)"


# --- data --------------------------------------------------------------------------------------


def test_without_the_data_package_corpus_is_an_error_and_random_must_be_asked(monkeypatch):
    monkeypatch.setitem(sys.modules, "hptransfer.data", None)  # import now raises ImportError
    kw = dict(sizes=[64, 128], head_dim=32, steps=2, batch_size=2, seq_len=16)
    with pytest.raises(CoordCheckError, match="corpus data unavailable.*hptransfer.data"):
        run_coordcheck("width", parameterization="mup", data="corpus", **kw)
    run = run_coordcheck("width", parameterization="mup", data="random", **kw)
    assert run.data_source == "random"
    again = run_coordcheck("width", parameterization="mup", data="random", **kw)
    assert again.rows == run.rows  # the random batch is deterministic


def test_corpus_that_cannot_load_is_an_error(tmp_path):
    not_a_dir = tmp_path / "cache"
    not_a_dir.write_text("a file where the cache directory should be")
    with pytest.raises(CoordCheckError, match="corpus data unavailable"):
        run_coordcheck("width", parameterization="mup", sizes=[64, 128], head_dim=32, steps=2,
                       batch_size=2, seq_len=16, data="corpus", data_cache_dir=str(not_a_dir))


def test_data_source_is_explicit_and_checked():
    kw = dict(sizes=[64, 128], head_dim=32, steps=2, batch_size=2, seq_len=16)
    with pytest.raises(TypeError, match="data"):
        run_coordcheck("width", **kw)  # no default: every caller says what it trains on
    with pytest.raises(CoordCheckError, match="data must be one of"):
        run_coordcheck("width", data="auto", **kw)


def test_explicit_random_data(data_dir):
    run = run_coordcheck(
        "width", parameterization="sp", sizes=[64, 128], head_dim=32, steps=2, batch_size=2,
        seq_len=16, data="random", data_cache_dir=data_dir,
    )
    assert run.data_source == "random"


# --- validation and verdict rules ------------------------------------------------------------


def test_rejects_bad_settings():
    with pytest.raises(CoordCheckError, match="axis"):
        run_coordcheck("height", data="random")
    with pytest.raises(CoordCheckError, match=r"head_dim= a divisor of every width \(e.g. 32\)"):
        run_coordcheck("width", sizes=[96, 128], head_dim=64, data="random")
    # no even head divides 33 and 99: RoPE cannot have the odd gcd the hint would give
    with pytest.raises(CoordCheckError, match="RoPE needs an even head_dim"):
        run_coordcheck("width", sizes=[33, 99], head_dim=64, data="random")
    with pytest.raises(CoordCheckError, match="head_dim"):
        run_coordcheck("depth", sizes=[2, 4], fixed=100, head_dim=64, data="random")
    with pytest.raises(CoordCheckError, match="two"):
        run_coordcheck("depth", sizes=[4], data="random")
    with pytest.raises(CoordCheckError, match="steps"):
        run_coordcheck("depth", steps=0, data="random")
    # one step judges nothing (steps from min_step=2 are): it passed SP, as anything
    with pytest.raises(CoordCheckError, match=r"steps must be >= 2 \(min_step"):
        run_coordcheck("width", parameterization="sp", steps=1, data="random")


def test_a_module_with_no_judged_step_does_not_pass():
    from hptransfer.coordcheck.verdict import judge

    only_init = [{"module": "final_residual", "step": 1, "slope": 1.5}]
    v = judge(only_init, axis="width", arch="gpt", kind="sp", alpha=None)
    assert not v.passed and v.modules["final_residual"] == "not judged"
    assert v.reasons == ["final_residual: no step >= 2 to judge (run more steps, or lower "
                         "min_step)"]


def synthetic(module: str, values: list[float]) -> list[dict]:
    return [{"module": module, "step": t, "slope": v} for t, v in enumerate(values, start=1)]


def test_judge_median_ignores_a_one_step_spike_but_notes_it():
    slopes = synthetic("final_residual", [0.0, 0.1, -0.1, 0.05, -0.9, 0.0])
    v = judge(slopes, axis="depth", arch="gpt", kind="alpha", alpha=1.0)
    assert v.passed and v.modules["final_residual"] == "stable"
    assert any("steps [5]" in n for n in v.notes)


def test_judge_flags_systematic_growth_and_shrinkage():
    grows = judge(synthetic("final_residual", [0.6, 0.7, 0.9, 1.0]), axis="depth",
                  arch="gpt", kind="sp", alpha=None)
    assert not grows.passed and grows.modules["final_residual"] == "grows"
    shrinks = judge(synthetic("attn_out", [0.0, -0.5, -0.6, -0.7]), axis="width",
                    arch="gpt", kind="mup", alpha=None)
    assert not shrinks.passed and shrinks.modules["attn_out"] == "shrinks"


def test_judge_exemptions_are_directional_and_scoped():
    init_logits = synthetic("logits", [-0.5, 0.0, 0.1])
    # step 1 judged too (min_step=1): muP's shrinking logits at init are exempt ...
    assert judge(init_logits, axis="width", arch="gpt", kind="mup", alpha=None,
                 min_step=1).passed
    # ... SP has no such exemption, and a growing init would not be exempt either
    sp = judge(synthetic("logits", [-0.5, -0.5, 0.0]), axis="width", arch="gpt", kind="sp",
               alpha=None, min_step=1)
    assert not sp.passed
    grow = judge(synthetic("logits", [0.9, 0.9, 0.0]), axis="width", arch="gpt", kind="mup",
                 alpha=None, min_step=1)
    assert not grow.passed
    # alpha < 1 on depth: shrinking branches allowed, growing ones are not
    lazy = synthetic("mlp_out", [0.0, -0.6, -0.6, -0.6])
    assert judge(lazy, axis="depth", arch="gpt", kind="alpha", alpha=0.5).passed
    assert not judge(lazy, axis="depth", arch="gpt", kind="alpha", alpha=1.0).passed
    hot = synthetic("mlp_out", [0.0, 0.6, 0.6, 0.6])
    assert not judge(hot, axis="depth", arch="gpt", kind="alpha", alpha=0.5).passed


def test_judge_non_finite_means_diverged():
    v = judge(synthetic("final_residual", [0.0, 0.1, float("nan")]), axis="depth", arch="gpt",
              kind="sp", alpha=None)
    assert not v.passed and v.modules["final_residual"] == "diverged"


def test_verdict_reads_as_attributes_and_as_a_mapping():
    v = judge(synthetic("final_residual", [0.0, 1.0, 1.0]), axis="depth", arch="gpt", kind="sp",
              alpha=None)
    assert v["passed"] is v.passed is False
    assert v["reasons"] == v.reasons and v.get("modules") == v.modules
    assert v.get("missing", 3) == 3
