"""Shared fixtures: a real local Ray cluster and an isolated HPT_HOME per test."""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from typing import Any

import pytest

# Ray workers inherit the environment: keep torch at one thread per trial on 2 cores
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Strict mode (.ci/run, scripts/test.sh under CI): the only skips in this suite are for a
# missing service (PostgreSQL, Chromium), so a skip there means CI tested less than it claims.
STRICT = os.environ.get("HPT_TEST_STRICT") == "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    """With HPT_TEST_STRICT=1, report every skipped test as failed, with the skip's reason."""
    outcome = yield
    report = outcome.get_result()
    if STRICT and report.skipped and not hasattr(report, "wasxfail"):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped in strict mode (HPT_TEST_STRICT=1), a failure: {reason}"
    return None


def pytest_configure(config: pytest.Config) -> None:
    """HPT_TEST_CPU_PROFILE=FILE: each test's CPU of the whole host (tests/cpu_profile.py).
    Under pytest-xdist (scripts/test.sh), before the workers start: the Ray token that a
    new local cluster uses (~/.ray/auth_token, created by the first `ray.init` when missing).
    Two workers starting their clusters at once on a fresh machine could each write one, the
    second over the first; written once here, both clusters read the same token."""
    if profile := os.environ.get("HPT_TEST_CPU_PROFILE"):
        from cpu_profile import CpuProfile

        config.pluginmanager.register(CpuProfile(profile), "hpt-cpu-profile")
    if getattr(config, "workerinput", None) is None and config.getoption("numprocesses", 0):
        try:
            from ray._private.authentication.authentication_token_setup import (
                _get_default_token_path,
                generate_and_save_token,
            )
        except ImportError:  # a Ray without token authentication: nothing to share
            return
        if not _get_default_token_path().exists():
            generate_and_save_token()


RAY_FIXTURES = {"ray_cluster", "module_ray_cluster"}
_ray_files: set[Any] = set()  # the files with a test that uses the session's Ray cluster
_current_file: list[Any] = [None]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files that use the session's Ray cluster first, then the rest; in each part, files with
    a `slow` test first, each file's own order kept. Under pytest-xdist (--dist loadfile
    --no-loadscope-reorder) the workers take files in this order, so the long end-to-end files
    start early and the many quick files fill in around them; last, they would leave one
    worker running a long file alone at the end. Once a worker is past the Ray files it shuts
    its cluster down (pytest_runtest_setup) rather than keep it idle for the rest of the run."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    _ray_files.update(item.path for item in items if RAY_FIXTURES & set(item.fixturenames))
    items.sort(key=lambda item: (item.path not in _ray_files, item.path not in slow_files))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """At the first test of a file that does not use the session's Ray cluster, shut down
    any cluster this process runs (the session's, or one the service started in a test): an
    idle cluster's daemons and workers burn ~4 CPU-s a minute. The file before it has torn
    down its module fixtures by now; a later file that needs Ray starts it again."""
    if item.path == _current_file[0]:
        return
    _current_file[0] = item.path
    if item.path not in _ray_files:
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()


def _local_ray():
    """One local cluster for the whole run, started from the main thread (Ray kills the
    daemons a thread started when that thread ends) and started again if a test shut it."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False,
                 log_to_driver=False)
    return ray


@pytest.fixture
def ray_cluster():
    yield _local_ray()


@pytest.fixture(scope="module")
def module_ray_cluster():
    """ray_cluster for a module-scoped fixture (a result several tests share)."""
    yield _local_ray()


@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory):
    """An empty MLflow store whose schema MLflow itself made, once: making one runs some 50
    migrations (~1 CPU-s on two cores), so every test home starts with a copy of it, as a
    store MLflow made on the first run would be."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


def _isolate_home(home, monkeypatch: pytest.MonkeyPatch, mlflow_template):
    """Point every store at `home`, as a fresh install would (its MLflow store made)."""
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy(mlflow_template, home / "mlflow.db")
    monkeypatch.setenv("HPT_HOME", str(home))
    for var in ("HPT_DATABASE_URL", "HPT_OPTUNA_URL", "MLFLOW_TRACKING_URI", "HPT_API_TOKEN",
                "RAY_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    return home


@pytest.fixture
def hpt_home(tmp_path, monkeypatch, mlflow_template):
    return _isolate_home(tmp_path / "hpt", monkeypatch, mlflow_template)


@pytest.fixture(scope="module")
def module_hpt_home(tmp_path_factory, mlflow_template):
    """hpt_home for a module-scoped fixture: set until the module's tests are done (a
    test's own hpt_home overrides it while that test runs)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield _isolate_home(tmp_path_factory.mktemp("hpt"), monkeypatch, mlflow_template)


TINY_SPEC = {
    "name": "tiny",
    "arms": [{"arch": "gpt", "parameterization": "completep"}],
    "grid": {"widths": [32], "depths": [1], "lrs": [2**-8, 2**-6, 2**-4], "seeds": [0]},
    "fixed": {"head_dim": 32, "seq_len": 32, "base_width": 32, "base_depth": 1,
              "device": "cpu", "eval_every": 5},
    "budget": {"steps": 10, "batch_size": 4},
    "data": {"source": "stdlib", "val_tokens": 1024, "max_corpus_bytes": 400000},
    "max_concurrent": 2,
    "retries": 1,
}


@pytest.fixture
def tiny_spec():
    import copy

    return copy.deepcopy(TINY_SPEC)


@pytest.fixture
def postgres_url() -> str:
    """The test PostgreSQL server's URL (`.ci/run` starts one; locally
    scripts/postgres_up.sh), or skip (a failure in strict mode, see above)."""
    url = os.environ.get("HPT_TEST_POSTGRES_URL")
    if not url:
        pytest.skip("HPT_TEST_POSTGRES_URL not set (.ci/run sets it; locally run "
                    "scripts/postgres_up.sh)")
    return url


@pytest.fixture
def postgres_schema_url(postgres_url: str):
    """A URL to an empty database on the test PostgreSQL server: a fresh schema, dropped
    afterwards."""
    import uuid

    from sqlalchemy import create_engine

    from hptransfer.store.store import normalize_url

    schema = f"hpt_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(normalize_url(postgres_url))
    with admin.begin() as conn:
        conn.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
    # search_path per connection: the store, and Alembic's version table, live in the schema
    url = normalize_url(postgres_url).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
        admin.dispose()


@dataclass(frozen=True)
class PlannedTrial:
    """Stand-in for the planner's output: the attributes Store.create_sweep reads."""

    arm: str
    trial: Any
    width: int
    depth: int
    lr: float
    sigma_base: float
    seed: int
    content_hash: Any


def planned_trials(n: int, prefix: str = "hash") -> list[PlannedTrial]:
    """n distinct trials of one shape, told apart by seed and content hash."""
    return [PlannedTrial("sp", {"seed": i}, 64, 1, 0.01, 1.0, i, f"{prefix}-{i}")
            for i in range(n)]


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path):
    """A URL to an empty database: a fresh SQLite file, or a fresh PostgreSQL schema."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'nested' / 'hpt.db'}"  # parent missing: Store makes it
        return
    yield request.getfixturevalue("postgres_schema_url")


@pytest.fixture
def open_store(db_url: str):
    """Open Store instances on the same database (closed before it is dropped)."""
    from hptransfer.store.store import Store

    stores: list[Store] = []

    def _open() -> Store:
        stores.append(Store(db_url))
        return stores[-1]

    yield _open
    for st in stores:
        st.close()


@pytest.fixture
def migrated_store(open_store):
    """A migrated app database on SQLite and on the test PostgreSQL server."""
    st = open_store()
    st.migrate()
    return st
