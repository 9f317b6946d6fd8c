"""The `hpt` command as a user runs it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from hptransfer.cli import main

HPT = [sys.executable, "-m", "hptransfer.cli"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*HPT, *args], capture_output=True, text=True, timeout=120)


def test_params_json_worked_case():
    out = run("params", "--arch", "gpt", "--param", "completep", "--width", "1024",
              "--depth", "32", "--lr", "0.01", "--eps", "1e-8", "--json")
    assert out.returncode == 0, out.stderr
    table = json.loads(out.stdout)
    groups = {g["name"]: g for g in table["groups"]}
    assert groups["hidden_weight"]["lr"] == pytest.approx(0.01 / 4)
    assert groups["hidden_weight"]["eps"] == pytest.approx(1e-8 / 64)
    assert table["multipliers"]["residual"] == pytest.approx(1 / 16)
    assert all({"name", "params", "init_std", "lr", "weight_decay", "eps"} <= set(g)
               for g in table["groups"])


def test_params_text():
    out = run("params", "--param", "depth_mup", "--width", "512", "--depth", "8")
    assert out.returncode == 0 and "hidden_weight" in out.stdout and "m_L=4" in out.stdout


def test_model_commands_refuse_bad_flags_before_loading_torch():
    # a typo answers at once, not after importing torch (~1.5 CPU-s): the pairing and the
    # shape are checked first; one process, each command's code and message as `hpt` prints
    probe = """
import contextlib, io, json, sys
from hptransfer.cli import main
seen = []
for argv in (["params", "--arch", "ngpt", "--param", "mup"], ["params", "--width", "100"],
             ["flops", "--width", "100"]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    seen.append([code, err.getvalue()])
print(json.dumps({"seen": seen, "torch": "torch" in sys.modules}))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    (pair_code, pair), (width_code, width), (flops_code, flops) = result["seen"]
    assert pair_code == 2 and "use parameterization 'ngpt'" in pair and "Traceback" not in pair
    assert width_code == 2 and "divisible by head_dim" in width
    assert flops_code == 2 and flops.startswith("hpt flops: error:") and "head_dim" in flops
    assert result["torch"] is False


def test_flops_json_matches_library():
    from hptransfer.models import ModelConfig
    from hptransfer.models.flops import flops_report

    out = run("flops", "--arch", "gpt", "--width", "256", "--depth", "4", "--seq-len", "128",
              "--vocab", "512", "--json")
    assert out.returncode == 0, out.stderr
    expected = flops_report(ModelConfig(width=256, depth=4, vocab_size=512, max_seq_len=128), 128)
    assert json.loads(out.stdout) == json.loads(json.dumps(expected))


@pytest.mark.parametrize(("param", "passed"), [("sp", False), ("completep", True)])
def test_coordcheck_cli_verdicts(tmp_path, param, passed):
    # the library test's physics, smaller: SP's final residual grows with depth (seen: median
    # slope +0.92 per doubling, threshold 0.4), CompleteP's stays flat (seen: -0.20)
    png = tmp_path / "cc.png"
    out = run("coordcheck", "--axis", "depth", "--param", param, "--sizes", "2,4,8,16",
              "--fixed", "64", "--head-dim", "32", "--steps", "8", "--data", "corpus",
              "--strict", "--plot", str(png), "--json")
    assert out.returncode == (0 if passed else 1), out.stderr  # --strict: 1 on a failed check
    result = json.loads(out.stdout)
    assert result["axis"] == "depth" and result["data_source"] == "corpus"
    assert result["verdict"]["passed"] is passed, result["verdict"]["reasons"]
    assert result["verdict"]["modules"]["final_residual"] == ("stable" if passed else "grows")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_coordcheck_cli_bad_data_source():
    out = run("coordcheck", "--axis", "depth", "--sizes", "2,4", "--data", "auto")
    assert out.returncode == 2
    assert "data must be one of" in out.stderr and "Traceback" not in out.stderr


def test_coordcheck_plot_defaults_to_the_dashboards_folder(hpt_home):
    out = run("coordcheck", "--axis", "width", "--param", "mup", "--sizes", "64,128",
              "--head-dim", "32", "--steps", "2", "--data", "random")
    assert out.returncode == 0, out.stderr
    png = hpt_home / "coordcheck" / "gpt-mup-width.png"
    assert png.exists() and str(png) in out.stdout


def test_coordcheck_writes_its_plot_where_it_says(tmp_path):
    """`--plot NAME` said "plot written to NAME" while matplotlib wrote NAME.png, and a
    directory was written beside (DIR.png) after the check had run."""
    plain = tmp_path / "myplot"
    out = run("coordcheck", "--axis", "width", "--sizes", "32,64", "--head-dim", "32",
              "--steps", "2", "--data", "random", "--plot", str(plain))
    assert out.returncode == 0, out.stderr
    assert f"plot written to {plain}\n" in out.stdout
    assert plain.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["myplot"]
    out = run("coordcheck", "--sizes", "32,64", "--plot", str(tmp_path))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"--plot {tmp_path} is a directory; give the PNG file's path" in out.stderr
    for sizes in ("abc", "32,,64", "0,4", ""):
        out = run("coordcheck", "--sizes", sizes)
        assert out.returncode == 2, (sizes, out.stderr)
        assert f"argument --sizes: {sizes!r} is not a comma-separated list" in out.stderr


def test_client_commands_without_server_fail_cleanly():
    out = run("status", "--url", "http://127.0.0.1:9")
    assert out.returncode == 2
    assert "cannot reach" in out.stderr and "Traceback" not in out.stderr


def test_demo_end_to_end(hpt_home, ray_cluster, tiny_spec, tmp_path, capsys):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec))
    out_dir = tmp_path / "dash"
    assert main(["demo", "--spec", str(spec), "--out", str(out_dir)]) == 0
    text = capsys.readouterr().out
    assert "best LR per shape" in text
    assert "Optimal LR per shape" in text  # the fit report
    # priced first by a fresh micro-run, then measured against that price
    num = r"(\d+(?:\.\d)?)"
    planned = re.search(rf"hpt plan: (\d+)-(\d+) trials, {num}-{num} s of wall time "
                        r"\(throughput: a micro-run", text)
    assert planned, text
    took = re.search(rf"took {num} s from submit: ([\d.]+)x the plan's {num} s without "
                     rf"extension rounds, ([\d.]+)x its {num} s at most", text)
    assert took, text
    seconds, low, high = float(took[1]), float(took[3]), float(took[5])
    assert (low, high) == (float(planned[3]), float(planned[4])) and 0 < low <= high
    for ratio, wall in ((float(took[2]), low), (float(took[4]), high)):
        # each printed figure rounded: the ratio within the bounds that rounding leaves
        assert (seconds - 0.05) / (wall + 0.05) - 0.005 <= ratio, (ratio, seconds, wall)
        assert ratio <= (seconds + 0.05) / max(wall - 0.05, 1e-9) + 0.005, (ratio, seconds, wall)
    index = Path(out_dir) / "index.html"
    assert index.exists() and "plotly" in index.read_text()[:200_000].lower()
    # the sweep's experiment in the home's MLflow store, beside MLflow's Default
    experiments = MlflowClient(f"sqlite:///{hpt_home / 'mlflow.db'}").search_experiments()
    assert len(experiments) == 2, [e.name for e in experiments]


def test_the_demo_says_when_its_sweep_was_not_priced():
    from hptransfer.demo import against_plan

    assert against_plan(12.04, None) == "took 12.0 s from submit; the plan gave no wall time"
    no_wall = {"total": {"wall_s": None, "wall_s_planned": None}}
    assert against_plan(3.0, no_wall) == "took 3.0 s from submit; the plan gave no wall time"
    priced = {"total": {"wall_s": 4.0, "wall_s_planned": 2.0}}
    assert against_plan(3.0, priced) == ("took 3.0 s from submit: 1.50x the plan's 2.0 s "
                                         "without extension rounds, 0.75x its 4.0 s at most")


def test_client_commands_start_without_torch():
    # `hpt status`, `fits`, `submit`... parse and talk HTTP: importing torch (~2 s) for them
    # would make every one of them slow; the model commands load it when they run
    probe = ("import sys; from hptransfer.cli import build_parser; "
             "build_parser().parse_args(['status']); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr


def test_the_coordinator_starts_without_torch():
    # `hpt serve` never trains (the trainer runs in Ray workers): importing torch cost ~1.4 of
    # its ~5 CPU-s to /health; the workers import it with the trainer, when a task runs
    probe = "import sys; import hptransfer.api.server; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr


def test_the_coordinators_ray_entries_take_what_the_worker_functions_take():
    # Ray checks a task's arguments against its entry's signature and names the worker's
    # process after it (ray::execute_trial): the light entries must be the functions' twins
    import inspect

    from hptransfer.workers import ray_train, remote, tasks

    for entry, real in [(tasks.execute_trial, remote.execute_trial),
                        (tasks.execute_trials, remote.execute_trials),
                        (tasks.execute_trial_on_workers, ray_train.execute_trial_on_workers)]:
        assert entry.__name__ == real.__name__
        assert inspect.signature(entry) == inspect.signature(real), entry.__name__


def test_every_name_of_the_models_package_loads():
    import hptransfer.models as models

    for name in models.__all__:
        assert getattr(models, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = models.nope
