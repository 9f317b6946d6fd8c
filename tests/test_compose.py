"""docker-compose.yml is a valid Compose file and in step with scripts/cluster_up.sh.

The schema is the Compose specification's JSON schema as shipped inside the docker-compose
1.29.2 wheel (compose/config/compose_spec.json), fetched with pip from the package index
(the only network CI has) into a cache, or read from $HPT_COMPOSE_SPEC.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
CLUSTER_UP = ROOT / "scripts" / "cluster_up.sh"
WHEEL = "docker-compose==1.29.2"
# flags only the one-machine script needs: ports, paths and sizes that compose leaves to
# each container (its own network namespace, file system and memory)
LOCAL_ONLY = {
    "--node-ip-address", "--num-cpus", "--num-gpus", "--dashboard-port", "--temp-dir",
    "--ray-client-server-port", "--dashboard-agent-listen-port", "--object-store-memory",
    "--include-dashboard",  # HPT_RAY_DASHBOARD=0 turns it off (tests); on by default, as here
}


def _compose_schema() -> dict:
    given = os.environ.get("HPT_COMPOSE_SPEC")
    if given:
        return json.loads(Path(given).read_text())
    cache = Path(os.environ.get("HPT_TEST_CACHE", Path.home() / ".cache" / "hptransfer-tests"))
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob("docker_compose-1.29.2-*.whl"))
    if not wheels:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache), WHEEL],
            capture_output=True, text=True, timeout=300)
        wheels = sorted(cache.glob("docker_compose-1.29.2-*.whl"))
        if not wheels:
            if os.environ.get("CI") == "true":
                pytest.fail(f"pip download {WHEEL} failed in CI: {proc.stderr[-2000:]}")
            pytest.skip(f"pip download {WHEEL} failed (no package index?): {proc.stderr[-300:]}")
    with zipfile.ZipFile(wheels[-1]) as z:
        return json.loads(z.read("compose/config/compose_spec.json"))


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_file_is_valid_against_the_compose_spec(compose):
    schema = _compose_schema()
    validator = jsonschema.Draft201909Validator(schema)
    errors = sorted(validator.iter_errors(compose), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def test_the_schema_check_rejects_a_broken_file(compose):
    """The validation can fail: a misspelt key in the GPU reservation is caught."""
    schema = _compose_schema()
    broken = json.loads(json.dumps(compose))
    broken["services"]["ray-gpu-worker"]["deploy"]["resources"]["reservations"]["gpus"] = 1
    assert list(jsonschema.Draft201909Validator(schema).iter_errors(broken))


def test_gpu_worker_reserves_nvidia_gpus_and_joins_the_head(compose):
    gpu = compose["services"]["ray-gpu-worker"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and "gpu" in d.get("capabilities", [])
               for d in devices)
    assert "--address=ray-head:6379" in gpu["command"]


def _flags(command: str, program: str) -> set[str]:
    """The --flag names of `program ...` inside a command line (up to a `&&`)."""
    text = re.sub(r'"\$BIN/(\w+)"', r"\1", command.replace("\\\n", " "))
    at = text.find(program)
    assert at >= 0, f"{program!r} not in {command!r}"
    segment = text[at + len(program):].split("&&")[0]
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", segment))


def _script_command(text: str, marker: str) -> str:
    """The (backslash-continued) command in cluster_up.sh that contains `marker`."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if marker in line:
            out = [line]
            while out[-1].rstrip().endswith("\\"):
                i += 1
                out.append(lines[i])
            return " ".join(x.rstrip().rstrip("\\") for x in out)
    raise AssertionError(f"{marker!r} not in cluster_up.sh")


@pytest.mark.parametrize("service,program,marker", [
    ("mlflow", "mlflow server", '"$BIN/mlflow" server'),
    ("ray-head", "ray start", '"$BIN/ray" start --head'),
    ("ray-worker", "ray start", '"$BIN/ray" start --address'),
    ("coordinator", "hpt serve", '"$BIN/hpt" serve'),
])
def test_compose_runs_the_commands_cluster_up_runs(compose, service, program, marker):
    script = CLUSTER_UP.read_text()
    local = _script_command(script, marker)
    if service == "ray-worker":  # join_ray's common flags plus the worker's own
        local += " " + _script_command(script, "join_ray ray-worker")
    ours = _flags(local, program) - LOCAL_ONLY
    theirs = _flags(compose["services"][service]["command"], program) - LOCAL_ONLY
    assert ours == theirs, f"{service}: only in cluster_up {ours - theirs}, " \
                           f"only in compose {theirs - ours}"


def test_coordinator_environment_matches_cluster_up(compose):
    env = compose["services"]["coordinator"]["environment"]
    names = set(env) - {"<<"} | set(compose["x-ray-auth"])
    script = CLUSTER_UP.read_text()
    exported = set(re.findall(r"^\s*printf 'export (\w+)=", script, flags=re.M))
    # HPT_URL tells local shells where the API is; in compose that is the published port
    assert exported - {"HPT_URL"} <= names, exported - names
    assert {"HPT_DATABASE_URL", "HPT_OPTUNA_URL", "MLFLOW_TRACKING_URI", "RAY_ADDRESS",
            "HPT_API_TOKEN", "RAY_AUTH_TOKEN"} <= exported
    assert compose["services"]["coordinator"]["command"].count("--num-cpus=0") == 1


def test_every_mlflow_server_runs_with_the_server_environment(compose):
    """cluster_up.sh and compose start `mlflow server` with SERVER_ENV (its job runner off),
    as `hpt mlflow-ui` does (tests/test_mlflow_ui.py checks the processes)."""
    from hptransfer.tracking.tracking import SERVER_ENV

    local = _script_command(CLUSTER_UP.read_text(), '"$BIN/mlflow" server')
    prefix = local[:local.index('"$BIN/mlflow" server')]
    assert dict(re.findall(r"(\w+)=(\S+)", prefix)) == SERVER_ENV, prefix
    assert compose["services"]["mlflow"]["environment"] == SERVER_ENV
