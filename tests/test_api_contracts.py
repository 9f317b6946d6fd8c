"""The contracts between the server and its users: the client imports no server code, the
trial listing's query parameters are TrialFilters' fields, and the status enums keep the
strings every stored row and answer already holds."""

from __future__ import annotations

import inspect
import subprocess
import sys

from hptransfer.contracts.filters import TRIAL_FILTER_NAMES, TrialFilters
from hptransfer.contracts.status import HealthState, StageState, SweepStatus, TrialStatus

SERVER_MODULES = ("sqlalchemy", "ray", "fastapi", "starlette", "uvicorn", "mlflow", "optuna",
                  "hptransfer.store", "hptransfer.coordinator", "hptransfer.api")


def imported_by_the_client() -> set[str]:
    """The modules a fresh interpreter holds after `import hptransfer.client`."""
    out = subprocess.run(
        [sys.executable, "-c", "import sys, hptransfer.client; print('\\n'.join(sys.modules))"],
        capture_output=True, text=True, timeout=300, check=True)
    return set(out.stdout.split())


def _loaded(modules: set[str], name: str) -> bool:
    return any(m == name or m.startswith(name + ".") for m in modules)


def test_the_client_imports_no_server_code():
    modules = imported_by_the_client()
    loaded = [name for name in SERVER_MODULES if _loaded(modules, name)]
    assert not loaded, f"importing hptransfer.client loaded server code: {loaded}"


def test_the_client_imports_no_torch():
    """torch costs `hpt submit` ~1.5 s of CPU at start and ~0.5 s at exit: on a loaded host,
    the margin between Ctrl-C and the exit."""
    assert not _loaded(imported_by_the_client(), "torch")


def test_the_trial_listing_takes_exactly_the_trial_filters():
    from hptransfer.api.routes import trial_filters

    assert tuple(inspect.signature(trial_filters).parameters) == TRIAL_FILTER_NAMES
    built = trial_filters(status="failed", seed=3)
    assert built == TrialFilters(status="failed", seed=3)
    assert built.as_dict() == {name: None for name in TRIAL_FILTER_NAMES} | {
        "status": "failed", "seed": 3}


def test_statuses_keep_their_strings():
    """Stored rows and past answers hold these strings: a renamed member would orphan them."""
    assert [s.value for s in TrialStatus] == [
        "pending", "running", "completed", "diverged", "failed", "cancelled", "pruned"]
    assert [s.value for s in SweepStatus] == [
        "pending", "running", "completed", "cancelled", "failed", "stopped"]
    assert [s.value for s in StageState] == [
        "waiting", "running", "done", "stopped", "skipped", "cancelled"]
    assert [s.value for s in HealthState] == ["ok", "degraded", "down"]
