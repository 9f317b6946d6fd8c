"""GET /health and `hpt doctor`: one check per component, credentials masked, a deleted
MLflow store noticed; `hpt serve` stops cleanly on SIGTERM and SIGINT."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from fastapi.testclient import TestClient

from hptransfer.api import create_app
from hptransfer.api.server import free_port
from hptransfer.cli import main
from hptransfer.config import get_settings
from hptransfer.redaction import mask_url, redact

HPT = Path(sys.executable).with_name("hpt")


@pytest.mark.parametrize("url,secret", [
    ("postgresql://hpt:s3cret@db:5432/mlflow", "s3cret"),
    ("postgresql+psycopg://u:p%40ss@h/x", "p%40ss"),
    ("http://alice:hunter2@mlflow:5000", "hunter2"),
    ("http://mlflow:5000/?token=abc123&x=1", "abc123"),
    ("https://tok3n@mlflow.example.com", "tok3n"),
    # raw '/', '#', '?' and '@' in a password: urlsplit finds no credentials in these, but
    # SQLAlchemy and libpq read them as passwords and connect
    ("postgresql://hpt:ml/Secret3@127.0.0.1:1/mlflow", "Secret3"),
    ("postgresql://hpt:opt#Secret2@db/optuna", "Secret2"),
    ("postgresql://hpt:ml?Secret4@db/mlflow", "Secret4"),
    ("postgresql://hpt:p@Secret5@db/x", "Secret5"),
    ("http://u:pa/ss@127.0.0.1:1", "ss"),
])
def test_mask_url_hides_every_credential(url, secret):
    masked = mask_url(url)
    assert secret not in masked and "***" in masked
    assert masked.split("://")[0] == url.split("://")[0]


def test_mask_url_keeps_urls_without_credentials():
    assert mask_url("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert mask_url("sqlite:////tmp/x/mlflow.db") == "sqlite:////tmp/x/mlflow.db"
    assert mask_url("sqlite:////tmp/a@b/mlflow.db") == "sqlite:////tmp/a@b/mlflow.db"
    assert mask_url("http://mlflow/runs/a@b") == "http://mlflow/runs/a@b"
    # where the host, not a password, follows the user name, the host stays
    assert mask_url("postgresql://hpt:ml/Secret3@127.0.0.1:1/mlflow") == (
        "postgresql://hpt:***@127.0.0.1:1/mlflow")


def test_pieces_of_a_configured_password_are_masked_wherever_an_error_quotes_them(
        hpt_home, monkeypatch):
    """A raw '@' in a password: the driver reads what follows it as the host and quotes it
    in its error ("failed to resolve host 'Secret2@127.0.0.1'"), which no URL mask sees."""
    monkeypatch.setenv("HPT_OPTUNA_URL", "postgresql://hpt:opt@Secret2x@127.0.0.1:1/o")
    get_settings()
    shown = redact("OperationalError: failed to resolve host 'Secret2x@127.0.0.1': unknown")
    assert "Secret2x" not in shown and "host '***@127.0.0.1'" in shown


def test_the_servers_log_handlers_redact_messages_and_tracebacks():
    """`hpt serve` puts a RedactingFilter on its log handlers: a database that cannot be
    reached at start-up was logged with a traceback quoting its URL's password."""
    import io
    import logging

    from hptransfer.redaction import RedactingFilter

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(RedactingFilter())
    log = logging.getLogger("hpt-test-redaction")
    log.addHandler(handler)
    try:
        try:
            raise RuntimeError("cannot connect to postgresql://hpt:Pw0rdX@db:5432/hpt")
        except RuntimeError:
            log.exception("startup failed for %s", "http://u:T0kenY@mlflow:5000")
    finally:
        log.removeHandler(handler)
    text = stream.getvalue()
    assert "Pw0rdX" not in text and "T0kenY" not in text, text
    assert "startup failed for http://u:***@mlflow:5000" in text
    assert "Traceback" in text and "postgresql://hpt:***@db:5432/hpt" in text


def test_serves_access_log_is_one_redacted_line_per_request(hpt_home, tmp_path):
    """`hpt serve` logs as uvicorn configures it, behind its RedactingFilter: each request is
    one access line (client, method, path, status) with a secret in its query masked, never
    a '--- Logging error ---' traceback (the filter once emptied the args that uvicorn's
    access formatter unpacks, and one GET /health wrote 89 lines of traceback)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HPT_HOME": str(hpt_home), "OMP_NUM_THREADS": "1"}
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([str(HPT), "serve", "--port", str(port)], env=env,
                            stdout=log.open("a"), stderr=subprocess.STDOUT)
    try:
        _wait_health(url, proc, log)
        assert httpx.get(f"{url}/health?token=Sekr1tQ9", timeout=30).status_code == 200
        assert httpx.get(f"{url}/sweeps/424242", timeout=30).status_code == 404
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    text = log.read_text()
    assert "Logging error" not in text and "Traceback" not in text, text[-3000:]
    assert "Sekr1tQ9" not in text
    assert re.search(r'127\.0\.0\.1:\d+ - "GET /health\?token=\*\*\* HTTP/1\.1" 200', text), text
    assert re.search(r'"GET /sweeps/424242 HTTP/1\.1" 404', text), text


def test_redact_masks_urls_and_passwords_inside_error_text():
    text = ("HTTPStatusError: Client error '401 Unauthorized' for url "
            "'http://alice:S3CRETPW@mlflow:5000/version?access_token=T0KEN&x=1' "
            "(connection 'host=db user=bob password=PGPW sslmode=require')")
    out = redact(text)
    assert not any(s in out for s in ("S3CRETPW", "T0KEN", "PGPW")), out
    assert "http://alice:***@mlflow:5000/version" in out and "x=1" in out
    assert "password=***" in out and "host=db user=bob" in out
    assert redact("no secrets at http://mlflow:5000/version") == (
        "no secrets at http://mlflow:5000/version")
    plain = "ValueError: tokens_per_param=20 and max_tokens=5; api_token=abc Secret=x"
    assert redact(plain) == ("ValueError: tokens_per_param=20 and max_tokens=5; "
                             "api_token=*** Secret=***")


@pytest.fixture
def api(hpt_home):
    with TestClient(create_app(get_settings(), dispatch=False)) as c:
        yield c


def _components(body: dict) -> dict:
    return {c["name"]: c for c in body["components"]}


def test_health_reports_every_component(api):
    r = api.get("/health")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "ok", body
    comps = _components(body)
    assert {"database", "optuna", "mlflow", "ray", "dispatcher"} <= set(comps)
    assert all(c["ok"] for c in comps.values())
    assert "migrations at head" in comps["database"]["detail"]


def test_health_notices_a_deleted_mlflow_store(api, hpt_home):
    assert api.get("/health").json()["status"] == "ok"
    db = hpt_home / "mlflow.db"
    assert db.exists()
    for path in hpt_home.glob("mlflow.db*"):
        path.unlink()
    body = api.get("/health").json()
    mlflow = _components(body)["mlflow"]
    assert body["status"] == "degraded"
    assert not mlflow["ok"] and "gone" in mlflow["detail"] and mlflow["fix"]
    db.write_bytes(b"")  # re-created by someone else: still not the store it started with
    mlflow = _components(api.get("/health").json())["mlflow"]
    assert not mlflow["ok"] and "not the store" in mlflow["detail"]


def test_health_masks_the_mlflow_password(hpt_home, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "postgresql://hpt:t0psecret@127.0.0.1:9/mlflow")
    with TestClient(create_app(get_settings(), dispatch=False)) as api:
        r = api.get("/health")
    assert "t0psecret" not in r.text
    mlflow = _components(r.json())["mlflow"]
    assert not mlflow["ok"] and "hpt:***@127.0.0.1:9" in mlflow["detail"]


def test_health_masks_a_database_password_given_in_the_query(hpt_home, monkeypatch):
    """libpq also takes the password as ?password=; SQLAlchemy's own masking hides only
    user:pw@, and /health showed the rest."""
    from hptransfer.store.store import Store

    with TestClient(create_app(get_settings(), dispatch=False)) as api:
        # the server's database now one named that way (none answers on port 9)
        coordinator = api.app.state.coordinator
        monkeypatch.setattr(coordinator, "store",
                            Store("postgresql://bob@127.0.0.1:9/hpt?password=Q5ECRET"))
        r = api.get("/health")
    assert r.status_code == 503 and "Q5ECRET" not in r.text, r.text
    assert r.json()["database"] == "postgresql+psycopg://***@127.0.0.1:9/hpt?password=***"


@pytest.mark.parametrize("credentials", ["alice:S3CRETPW@", "?access_token=S3CRETPW"])
def test_health_masks_credentials_an_mlflow_server_error_quotes(hpt_home, monkeypatch,
                                                                credentials):
    """A tracking server (or its proxy) that answers 401: httpx's error quotes the URL it
    called, credentials and all, and /health used to show it as it was."""
    import http.server
    import threading

    class Unauthorized(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(401)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Unauthorized)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    uri = (f"http://{credentials}127.0.0.1:{port}" if credentials.endswith("@")
           else f"http://127.0.0.1:{port}/{credentials}")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    try:
        with TestClient(create_app(get_settings(), dispatch=False)) as api:
            r = api.get("/health")
    finally:
        server.shutdown()
    mlflow = _components(r.json())["mlflow"]
    assert not mlflow["ok"] and "401" in mlflow["detail"], mlflow
    assert "S3CRETPW" not in r.text, r.text


def test_health_is_503_naming_the_database_when_it_is_gone(hpt_home, monkeypatch):
    from hptransfer.store.engine import make_engine

    with TestClient(create_app(get_settings(), dispatch=False)) as api:
        # the server's connection now leads to a database that does not answer (port 9)
        store = api.app.state.coordinator.store
        monkeypatch.setattr(store, "engine", make_engine("postgresql://hpt:pw@127.0.0.1:9/hpt"))
        r = api.get("/health")
    assert r.status_code == 503
    assert r.json()["status"] == "down"
    assert not _components(r.json())["database"]["ok"]


def test_doctor_names_the_failing_component_and_exits_nonzero(hpt_home, capsys):
    # a fresh home: nothing migrated yet
    assert main(["doctor", "--quick"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  database" in out and "->" in out
    # after a coordinator has started once, every check passes
    with TestClient(create_app(get_settings(), dispatch=False)):
        pass
    assert main(["doctor", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out
    assert {line.split()[1] for line in out.splitlines() if line.startswith("ok")} >= {
        "database", "optuna", "mlflow", "ray"}


# ----------------------------------------------------------------------- clean shutdown


def _wait_health(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.time() < deadline, "hpt serve did not start"
        time.sleep(0.1)


def _ray_processes(server: psutil.Process) -> list[psutil.Process]:
    """Every process of the server's in-process Ray cluster: its descendants, plus any that
    left the tree but name the server's session directory."""
    procs = {p.pid: p for p in server.children(recursive=True)}
    sessions = set()
    for p in server.children():  # its own node's daemons are its direct children
        try:
            if p.name() not in ("gcs_server", "raylet"):
                continue
            sessions.update(re.findall(r"/ray/(session_[0-9_-]+)", " ".join(p.cmdline())))
        except psutil.Error:
            pass
    assert sessions, "no Ray session found under the server"
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if any(f"/{s}/" in cmd for s in sessions):
            procs.setdefault(p.pid, p)
    return list(procs.values())


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_shuts_down_cleanly_and_leaves_trials_for_restart(sig, hpt_home, tmp_path,
                                                                  tiny_spec):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HPT_HOME": str(hpt_home), "OMP_NUM_THREADS": "1"}
    log = tmp_path / "serve.log"

    def serve() -> subprocess.Popen:
        return subprocess.Popen([str(HPT), "serve", "--port", str(port)], env=env,
                                stdout=log.open("a"), stderr=subprocess.STDOUT)

    proc = serve()
    try:
        _wait_health(url, proc, log)
        # the signal lands within a second of the first trial's dispatch, before its worker
        # has imported torch (the dispatcher stops with both trials at step 0); 100 steps
        # (~3 s of training alone on a loaded 2-core host) keep them from finishing first
        spec = {**tiny_spec, "budget": {"steps": 100, "batch_size": 4}}
        spec["grid"] = {**spec["grid"], "lrs": [2**-8, 2**-6]}
        sweep = httpx.post(f"{url}/sweeps", json=spec, timeout=60).json()
        deadline = time.time() + 180
        while httpx.get(f"{url}/sweeps/{sweep['id']}", timeout=10).json()["counts"].get(
                "running", 0) == 0:
            assert time.time() < deadline, "no trial started"
            time.sleep(0.1)
        ray_procs = _ray_processes(psutil.Process(proc.pid))
        assert any("raylet" in " ".join(p.cmdline()) for p in ray_procs)
        proc.send_signal(sig)
        assert proc.wait(120) == 0, log.read_text()[-3000:]
        text = log.read_text()
        assert "shutdown complete" in text and "Application shutdown complete" in text
        # a loaded machine may take a few seconds to reap them; a survivor stays
        deadline = time.time() + 30
        while (survivors := [p for p in ray_procs if _alive(p)]) and time.time() < deadline:
            time.sleep(0.1)
        assert not survivors, [" ".join(p.cmdline())[:200] for p in survivors]
        if sig != signal.SIGTERM:
            return
        # the trials it had in flight were left for the next start (still `running`, not
        # failed or cancelled), which finishes them
        from hptransfer.store.store import Store

        store = Store(f"sqlite:///{hpt_home}/hpt.db")
        left = [t.status for t in store.trials(sweep["id"], limit=None)]
        store.close()
        assert "running" in left and set(left) <= {"running", "pending", "completed"}, left
        proc = serve()
        _wait_health(url, proc, log)
        deadline = time.time() + 400
        while (s := httpx.get(f"{url}/sweeps/{sweep['id']}", timeout=10).json())[
                "status"] in ("pending", "running"):
            assert time.time() < deadline, s
            time.sleep(0.2)
        assert s["status"] == "completed" and s["done"] == s["total"] == 2, s
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_serve_holds_its_port_before_ray_starts(hpt_home, monkeypatch):
    """`hpt serve` binds its port before starting Ray, whose processes bind free ports as
    they start: a restart on the same port once found Ray's metrics agent answering there."""
    import socket

    import hptransfer.coordinator.dispatch as dispatch
    from hptransfer.api.server import free_port, serve_forever

    port = free_port()
    seen: list[bool] = []

    def init_ray_checking_the_port(settings):  # noqa: ANN001, ANN202
        with socket.socket() as probe:
            seen.append(probe.connect_ex(("127.0.0.1", port)) == 0)  # 0: something listens
        raise RuntimeError("stop here: only the order is under test")

    monkeypatch.setattr(dispatch, "init_ray", init_ray_checking_the_port)
    with pytest.raises(RuntimeError, match="stop here"):
        serve_forever(get_settings(), "127.0.0.1", port)
    assert seen == [True]


def test_doctor_diagnoses_an_mlflow_file_store_as_a_directory(hpt_home, monkeypatch, capsys):
    """`MLFLOW_TRACKING_URI=file:///...` (MLflow's file store) was pinged as a database:
    "NoSuchModuleError: Can't load plugin: sqlalchemy.dialects:file -> start the database
    server". Now: whether its directory exists, or can be made, and is writable."""
    afile = hpt_home.parent / "afile"
    afile.write_text("")
    fresh = hpt_home.parent / "mlruns" / "new"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{fresh}")
    main(["doctor", "--quick"])
    out = capsys.readouterr().out
    assert f"ok    mlflow     file://{fresh} (file store, created on first use, mlflow " in out
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{afile}/runs")
    assert main(["doctor", "--quick"]) == 1
    out = capsys.readouterr().out
    assert "NoSuchModuleError" not in out and "sqlalchemy" not in out, out
    assert (f"FAIL  mlflow     file://{afile}/runs (a file store): {afile} is a file, so "
            f"{afile}/runs cannot be created under it") in out, out
    assert "-> make that directory writable or point MLFLOW_TRACKING_URI at" in out


def test_a_database_that_accepts_but_never_answers_is_unreachable_within_the_ping_timeout(
        monkeypatch):
    """A listening socket nobody serves: the kernel completes the handshake, then nothing
    comes (as behind a firewall that drops packets). The ping gives up, not hangs."""
    import socket

    from hptransfer.coordinator import health

    monkeypatch.setattr(health, "PING_TIMEOUT_S", 2)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"postgresql://hpt@127.0.0.1:{silent.getsockname()[1]}/db"
        t0 = time.monotonic()
        problem = health.unreachable(url)
        took = time.monotonic() - t0
    assert problem is not None and "timeout" in problem.lower(), problem
    assert took < 10, took
