"""What `hpt` and the Python client say when something is wrong: one line naming the problem
and its fix, the right exit code, no traceback, no credential, against a real API server
(its dispatcher off: the tests move trials through the store)."""

from __future__ import annotations

import copy
import csv
import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import yaml
from conftest import TINY_SPEC
from pandas.api.types import is_float_dtype

from hptransfer.client import ApiError, Client

HPT = [sys.executable, "-m", "hptransfer.cli"]


def run(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*HPT, *args], capture_output=True, text=True, timeout=120, **kw)


@pytest.fixture(scope="module")
def server(module_hpt_home):
    from hptransfer.api.server import serve_in_thread
    from hptransfer.config import get_settings

    settings = get_settings()
    with serve_in_thread(settings, dispatch=False) as url:
        yield url, settings


def spec_file(tmp_path, name: str):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**copy.deepcopy(TINY_SPEC), "name": name}))
    return path


# ------------------------------------------------------------------ no server needed


def test_a_bad_spec_file_or_url_is_one_line_naming_it(tmp_path):
    (tmp_path / "broken.yaml").write_text("name: [unclosed\n")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "dir.yaml").mkdir()
    cases = {
        "typo.yaml": "no such file: typo.yaml",
        str(tmp_path / "broken.yaml"): "broken.yaml is not valid YAML/JSON",
        str(tmp_path / "list.yaml"): "list.yaml: a sweep spec must be a mapping",
        str(tmp_path / "dir.yaml"): "dir.yaml is a directory; give a spec file",
    }
    for path, says in cases.items():
        out = run("submit", path, "--url", "http://127.0.0.1:9")
        assert out.returncode == 2 and says in out.stderr, (path, out.stderr)
        assert "Traceback" not in out.stderr
    out = run("train", str(tmp_path / "broken.yaml"))
    assert out.returncode == 2 and "is not valid YAML/JSON" in out.stderr, out.stderr
    out = run("status", "", "--url", "http://127.0.0.1:9")  # not every sweep: no id at all
    assert out.returncode == 2 and "no sweep with id ''" in out.stderr, out.stderr
    out = run("status", "--url", "http://[::1")
    assert out.returncode == 2 and "invalid server URL" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr



def test_the_client_reads_a_spec_as_the_server_does(tmp_path):
    """Through the client a key given twice was kept once (the last), Infinity/NaN failed in
    httpx's encoder naming no field, JSON text of a real spec raised OSError (taken for a
    path too long), and a mistyped path was "not a mapping"."""
    import json

    from hptransfer.client import _as_dict

    spec = copy.deepcopy(TINY_SPEC)
    assert _as_dict(json.dumps(spec)) == spec  # JSON text, far past a file name's length
    assert _as_dict(yaml.safe_dump(spec)) == spec
    (tmp_path / "dup.yaml").write_text("name: a\nname: b\n")
    (tmp_path / "dup.json").write_text('{"name": "a", "name": "b"}')
    for path in ("dup.yaml", "dup.json"):
        with pytest.raises(ValueError, match="duplicate key 'name'"):
            _as_dict(str(tmp_path / path))
    with pytest.raises(ValueError, match=r"^budget.steps, grid.lrs\[1\]: Infinity or NaN is "
                                         r"not a value a spec field accepts"):
        _as_dict({**spec, "budget": {"steps": float("inf")},
                  "grid": {**spec["grid"], "lrs": [1e-3, float("nan")]}})
    (tmp_path / "inf.yaml").write_text("budget: {steps: .inf}\n")
    with pytest.raises(ValueError, match="^budget.steps: Infinity or NaN"):
        _as_dict(str(tmp_path / "inf.yaml"))
    out = run("submit", "examples/cpu_smal", "--url", "http://127.0.0.1:9")
    assert out.returncode == 2 and "no such file: examples/cpu_smal" in out.stderr, out.stderr
    assert _as_dict(yaml.safe_dump(spec).encode()) == spec  # bytes: their text, not b'...'
    with pytest.raises(ValueError, match="the spec's bytes are not UTF-8 text"):
        _as_dict(b"name: \xff")
    (tmp_path / "word.yaml").write_text("hello\n")  # a file that is there, holding no mapping
    with pytest.raises(ValueError, match="word.yaml: a sweep spec must be a mapping"):
        _as_dict(str(tmp_path / "word.yaml"))


def test_yaml_only_as_json_carries_it_on_both_sides(tmp_path):
    """A YAML date crashed the client with a TypeError from its JSON encoder (a traceback,
    no field named), !!set and !!binary the same; eight nested aliases in 300 bytes made
    the client expand 10^8 values (seconds, hundreds of MB) before the server could refuse
    the request's size."""
    from hptransfer.client import _as_dict
    from hptransfer.spec import SpecError, load_spec

    dated = yaml.safe_dump(TINY_SPEC) + "tags: {when: 2024-05-01}\n"
    assert _as_dict(dated)["tags"] == {"when": "2024-05-01"}  # text, as YAML 1.2 reads it
    assert load_spec(dated).tags == {"when": "2024-05-01"}
    for tagged in ("!!set {a, b}", "!!binary aGk=", "!!timestamp 2024-05-01"):
        text = yaml.safe_dump(TINY_SPEC) + f"tags: {{x: {tagged}}}\n"
        with pytest.raises(ValueError, match=r"has no JSON equivalent.*line \d+"):
            _as_dict(text)
        with pytest.raises(SpecError, match="has no JSON equivalent"):
            load_spec(text)
    laughs = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 9))
    (tmp_path / "laughs.yaml").write_text(laughs)
    with pytest.raises(ValueError, match="aliases .* expand to more than 100,000 values"):
        _as_dict(str(tmp_path / "laughs.yaml"))
    with pytest.raises(SpecError, match="expand to more than 100,000 values"):
        load_spec(laughs)
    # aliases within reason are YAML's own reuse, and stay
    reused = yaml.safe_dump(TINY_SPEC).replace("name:", "base: &b {steps: 2}\nname:", 1)
    assert _as_dict(reused)["base"] == {"steps": 2}


def test_a_spec_nested_past_any_field_is_one_line_on_every_side(tmp_path):
    """A list 1000 deep ("[[[...]]]") or a YAML block list 3000 deep ended `hpt plan`,
    `submit` and `train` in a RecursionError traceback (the parsers recurse once a level),
    and a dict 3000 deep passed to the client in one from its JSON encoder."""
    from hptransfer.client import _as_dict
    from hptransfer.spec import SpecError, load_spec

    (tmp_path / "deep.json").write_text("[" * 1000 + "]" * 1000)
    # 1400 deep: past the recursion limit, within the 1 MiB a spec file may be
    (tmp_path / "deep.yaml").write_text("\n".join(" " * i + "-" for i in range(1400)))
    (tmp_path / "33.json").write_text('{"a": ' * 33 + "1" + "}" * 33)
    for name in ("deep.json", "deep.yaml", "33.json"):
        for command in (["plan", "--url", "http://127.0.0.1:9"],
                        ["submit", "--url", "http://127.0.0.1:9"], ["train"]):
            out = run(*command, str(tmp_path / name))
            assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
            assert f"{name}: the spec nests mappings or lists more than 32 levels deep" in (
                out.stderr), out.stderr
    deep: dict = {}
    inner = deep
    for _ in range(3000):
        inner["a"] = {}
        inner = inner["a"]
    with pytest.raises(ValueError, match="more than 32 levels deep"):
        _as_dict({**TINY_SPEC, "tags": deep})
    (tmp_path / "objects.json").write_text('{"a": ' * 3000 + "1" + "}" * 3000)
    for source in (deep, (tmp_path / "deep.json").read_text(), tmp_path / "objects.json",
                   (tmp_path / "objects.json").read_text(), (tmp_path / "deep.yaml").read_text()):
        with pytest.raises(SpecError, match="more than 32 levels deep"):
            load_spec(source)
    # 32 levels are still a spec's to give (here in its free-form tags, refused by type)
    tags: dict = {"x": 1}
    for _ in range(30):
        tags = {"a": tags}
    with pytest.raises(SpecError) as exc:
        load_spec({**TINY_SPEC, "tags": tags})
    assert "levels deep" not in str(exc.value)


def test_a_number_past_pythons_digit_limit_is_named_without_its_internals(tmp_path):
    """It said "use sys.set_int_max_str_digits() to increase the limit": Python's advice to
    a programmer, not what a spec's author can do."""
    from hptransfer.spec import SpecError, load_spec

    digits = "9" * (sys.get_int_max_str_digits() + 1)
    (tmp_path / "big.yaml").write_text(f"name: {digits}\n")
    (tmp_path / "big.json").write_text(f'{{"name": {digits}}}')
    says = (f"a number in the spec has more than {sys.get_int_max_str_digits()} digits; no spec "
            "field takes one that large")
    for name in ("big.yaml", "big.json"):
        out = run("plan", str(tmp_path / name), "--url", "http://127.0.0.1:9")
        assert out.returncode == 2 and f"{name}: {says}" in out.stderr, out.stderr
        assert "set_int_max_str_digits" not in out.stderr
        with pytest.raises(SpecError, match=says):
            load_spec((tmp_path / name).read_text())
        with pytest.raises(SpecError, match=says):
            load_spec(tmp_path / name)


def test_what_the_cli_says_of_a_directory_a_token_and_a_failed_trial(tmp_path):
    """A directory was "no such file", a non-ASCII token an "invalid server URL", and
    `hpt train` printed a failed trial's whole traceback as its error line."""
    out = run("submit", str(tmp_path), "--url", "http://127.0.0.1:9")
    assert out.returncode == 2 and f"{tmp_path} is a directory; give a spec file" in out.stderr
    fifo = tmp_path / "spec.yaml"  # a pipe: reading it would wait for a writer forever
    os.mkfifo(fifo)
    out = run("submit", str(fifo), "--url", "http://127.0.0.1:9")
    assert out.returncode == 2 and "is not a regular file (a device or a pipe)" in out.stderr
    out = run("submit", "/dev/null", "--url", "http://127.0.0.1:9")
    assert out.returncode == 2 and "/dev/null is not a regular file" in out.stderr
    out = run("cancel", "x", "--url", "http://127.0.0.1:9", "--token", "t\u00e9")
    assert out.returncode == 2 and "non-ASCII character" in out.stderr, out.stderr
    assert "invalid server URL" not in out.stderr
    trial = tmp_path / "trial.yaml"
    trial.write_text("width: 32\ndepth: 1\nhead_dim: 16\nseq_len: 16\nbatch_size: 1\n"
                     "budget: {steps: 1}\ndata: {source: /nonexistent/x.bin, vocab_size: 256}\n")
    out = run("train", str(trial))
    assert out.returncode == 1, out.stderr
    assert "error: DataError: data source '/nonexistent/x.bin' does not exist" in out.stdout
    assert "(--json for the traceback)" in out.stdout and "Traceback" not in out.stdout


def test_a_bad_trial_spec_names_its_fields_as_a_sweeps_do(tmp_path):
    """`hpt train` printed pydantic's raw dump (type names, documentation URLs)."""
    path = tmp_path / "trial.yaml"
    path.write_text("width: 32\ndepth: 1\nhead_dim: 32\nbudget: {steps: 2, batch_size: 4}\n"
                    "widht: 3\n")
    out = run("train", str(path))
    assert out.returncode == 2 and "is not a valid TrialSpec" in out.stderr, out.stderr
    assert "widht: unknown field 'widht'; did you mean 'width'?" in out.stderr
    assert "budget.batch_size: unknown field 'batch_size'" in out.stderr
    assert "errors.pydantic.dev" not in out.stderr and "Traceback" not in out.stderr

def test_no_credential_in_what_the_client_says():
    out = run("status", "--url", "http://admin:S3CRETPW@127.0.0.1:9")
    assert out.returncode == 2 and "cannot reach http://admin:***@127.0.0.1:9" in out.stderr
    assert "S3CRETPW" not in out.stderr + out.stdout
    # a raw '/' in the password: httpx takes its first piece for the port, and says so
    out = run("status", "--url", "http://hpt:Secret1/xyz@127.0.0.1:9")
    assert out.returncode == 2 and "must be percent-encoded" in out.stderr, out.stderr
    assert "Secret1" not in out.stderr + out.stdout
    out = run("status", "--url", "http://127.0.0.1:9", "--token", "TOKENHEAD\nTOKENTAIL")
    assert out.returncode == 2 and "control character" in out.stderr, out.stderr
    assert "TOKENHEAD" not in out.stderr + out.stdout


def test_a_timeout_is_not_called_unreachable_and_warns_the_submit_may_have_landed():
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    held = []
    threading.Thread(target=lambda: held.append(silent.accept()[0]), daemon=True).start()
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    try:
        with Client(url, timeout=0.5) as c, pytest.raises(ApiError) as info:
            c.submit(copy.deepcopy(TINY_SPEC))
    finally:
        silent.close()
        for conn in held:
            conn.close()
    message = info.value.message
    assert message.startswith(f"no answer from {url} within 0.5 s (ReadTimeout)")
    assert "check `hpt status` before sending it again" in message
    assert "cannot reach" not in message


# ------------------------------------------------------------------ against the server


@pytest.mark.parametrize("bad_id", ["../health", "x?y=1", "a/b", ".."])
def test_a_sweep_id_cannot_name_another_route(server, bad_id):
    url, _ = server
    out = run("status", bad_id, "--url", url)
    assert out.returncode == 2 and f"no sweep with id {bad_id!r}" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    with Client(url) as c, pytest.raises(ValueError, match="no sweep with id"):
        c.get(bad_id)  # it returned /health's report as a sweep


def test_status_lists_every_sweep_not_the_first_page(server):
    from hptransfer.coordinator.plan import plan_sweep
    from hptransfer.spec import load_spec
    from hptransfer.store.store import Store

    url, settings = server
    store = Store(settings.database_url)
    spec = load_spec(copy.deepcopy(TINY_SPEC))
    for i in range(101):
        store.create_sweep(f"many-{i}", spec.model_dump(mode="json"), "h", "grid",
                           plan_sweep(spec))
    store.close()
    out = run("status", "--url", url)
    assert out.returncode == 0, out.stderr
    names = {line.split()[1] for line in out.stdout.splitlines() if line.strip()
             and not line.startswith(" ")}
    assert {f"many-{i}" for i in range(101)} <= names, len(names)
    with Client(url) as c:
        assert len(c.list_all(page=7)) == len(c.list_all()) >= 101


def submit_and_wait(url: str, tmp_path, name: str) -> subprocess.Popen:
    """`hpt submit SPEC --wait` running; its first line says the sweep id."""
    return subprocess.Popen([*HPT, "submit", str(spec_file(tmp_path, name)), "--wait",
                             "--url", url], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=_ctrl_c_as_in_a_terminal)


def _ctrl_c_as_in_a_terminal() -> None:
    """SIGINT at its default, as a shell leaves it: an ignored SIGINT is inherited through
    exec, and Python then installs no KeyboardInterrupt (a CI run once saw Ctrl-C ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_submit_wait_exits_1_when_the_sweep_fails(server, tmp_path):
    from hptransfer.store.store import Store

    url, settings = server
    p = submit_and_wait(url, tmp_path, "will-fail")
    try:
        line = p.stdout.readline()  # "submitted sweep ID (3 trials)"
        sweep_id = line.split()[2]
        store = Store(settings.database_url)
        store.fail_sweep(sweep_id, "the data could not be loaded")
        store.close()
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 1, (line, out, err)  # it exited 0: a script saw success
    assert "failed: the data could not be loaded" in out


def test_ctrl_c_while_waiting_says_the_sweep_goes_on(server, tmp_path):
    url, _ = server
    p = submit_and_wait(url, tmp_path, "interrupted")
    try:
        sweep_id = p.stdout.readline().split()[2]
        time.sleep(1.0)  # polling now
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130 and "Traceback" not in err, err[-800:]
    assert f"stopped waiting; sweep {sweep_id} goes on" in err


def test_ctrl_c_ends_a_wait_mid_request():
    """A poll the server never answers (a listener that accepts and stays silent): Ctrl-C
    ends the wait at once, not after the client's 60 s read timeout."""
    listener = socket.create_server(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    accepted, held = threading.Event(), []

    def accept() -> None:
        conn, _ = listener.accept()
        held.append(conn)  # open, silent: the client's read waits on it
        accepted.set()

    threading.Thread(target=accept, daemon=True).start()

    def interrupt() -> None:
        if accepted.wait(60):
            time.sleep(0.3)  # the client is in its read now
            os.kill(os.getpid(), signal.SIGINT)

    # Ctrl-C as Python's default handler raises it, whatever an earlier test in this process
    # left installed
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=interrupt, daemon=True).start()
    start = time.monotonic()
    try:
        with Client(url, timeout=60) as c, pytest.raises(KeyboardInterrupt):
            c.wait("abc123", progress=False)
    finally:
        signal.signal(signal.SIGINT, previous)
        for conn in [*held, listener]:
            conn.close()
    assert accepted.is_set() and time.monotonic() - start < 30


def sweep_with_a_failed_trial(server, name: str, error: str) -> str:
    """A new sweep of TINY_SPEC whose first trial failed with `error` (through the store:
    the server's dispatcher is off)."""
    from hptransfer.store.store import Store

    url, settings = server
    with Client(url) as c:
        sweep_id = c.submit({**copy.deepcopy(TINY_SPEC), "name": name})["id"]
    store = Store(settings.database_url)
    (trial,) = store.lease_pending("me", 1, sweep_id=sweep_id)
    store.finish_trial(trial.id, "failed", error=error)
    store.close()
    return sweep_id


def test_the_trials_table_shows_a_failed_trials_error(server):
    """A failed sweep's status sends the user to `hpt trials ID --status failed`, whose
    table had no error column: the one thing they came for."""
    url, _ = server
    sweep_id = sweep_with_a_failed_trial(
        server, "why-failed", "DataError: the data changed\nTraceback ...")
    out = run("trials", sweep_id, "--status", "failed", "--url", url)
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.splitlines()
    assert header.split()[-1] == "error" and row.endswith("DataError: the data changed")
    out = run("trials", sweep_id, "--status", "pending", "--url", url)
    assert out.returncode == 0 and "error" not in out.stdout.splitlines()[0], out.stdout


def test_the_trials_csv_quotes_a_cell_a_spreadsheet_would_run(server):
    url, _ = server
    sweep_id = sweep_with_a_failed_trial(server, "csv-formula", "=cmd|' /C calc'!A0")
    out = run("trials", sweep_id, "--csv", "--url", url)
    assert out.returncode == 0, out.stderr
    rows = list(csv.DictReader(io.StringIO(out.stdout)))
    assert [r["error"] for r in rows if r["status"] == "failed"] == ["'=cmd|' /C calc'!A0"]


def test_trials_frame_keeps_its_columns_and_numeric_dtypes(server):
    from hptransfer.contracts.records import TRIAL_COLUMNS, TRIAL_NUMERIC_COLUMNS

    url, _ = server
    sweep_id = sweep_with_a_failed_trial(server, "frame", "boom")
    with Client(url) as c:
        full = c.trials(sweep_id)
        none = c.trials(sweep_id, status="diverged")
        failed = c.trials(sweep_id, status="failed")
        # a typo'd filter is an error, not every trial (the API ignores what it does not know)
        with pytest.raises(TypeError, match="unknown trial filter widht; filter by status, arm, "
                                            "width"):
            c.trials(sweep_id, widht=64)
        # and every filter the client takes, the API applies (seed, sigma_base were ignored)
        assert len(c.trials(sweep_id, seed=12345)) == 0
        assert len(c.trials(sweep_id, sigma_base=99.0)) == 0
        assert len(c.trials(sweep_id, seed=0)) == len(full)
        # fit tables keep their columns when no row is there (savings of one arm: none)
        fits = c.fits(sweep_id, bootstrap=0)
        assert fits["savings"].empty and "reliable" in fits["savings"].columns
        assert {"reliable"} <= set(fits["aspect_ratio"].columns)
    assert list(full.columns) == list(none.columns) == list(TRIAL_COLUMNS) and len(none) == 0
    assert len(failed) == 1 and failed["error"].iloc[0] == "boom"
    for column in TRIAL_NUMERIC_COLUMNS:  # no result: NaN floats, not None objects
        assert failed[column].dtype != object, column
    assert is_float_dtype(failed["final_val_loss"]) and failed["final_val_loss"].isna().all()
    assert failed["final_val_loss"].round(3).isna().all()  # .round raised on object dtype


def test_fits_with_an_arm_the_sweep_lacks_is_a_422_naming_its_arms(server):
    import httpx

    url, _ = server
    with Client(url) as c:
        sweep_id = c.submit({**copy.deepcopy(TINY_SPEC), "name": "arms"})["id"]
    r = httpx.get(f"{url}/sweeps/{sweep_id}/fits", params={"reference_arm": "nope"})
    assert r.status_code == 422, r.text
    assert r.json()["error"] == (f"reference_arm 'nope' is not an arm of sweep {sweep_id}; "
                                 "its arms: gpt/completep")
    out = run("fits", sweep_id, "--reference-arm", "nope", "--url", url)
    assert out.returncode == 2 and "its arms: gpt/completep" in out.stderr, out.stderr
    ok = httpx.get(f"{url}/sweeps/{sweep_id}/fits", params={"reference_arm": "gpt/completep",
                                                            "bootstrap": 0})
    assert ok.status_code == 200, ok.text


def test_serving_on_a_port_in_use_is_one_line_and_exit_2():
    busy = socket.create_server(("127.0.0.1", 0))
    port = busy.getsockname()[1]
    try:
        for args in (["serve", "--port", str(port)], ["mlflow-ui", "--port", str(port)]):
            out = run(*args)
            assert out.returncode == 2, (args, out.returncode, out.stderr[-500:])
            assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in out.stderr
            assert "Traceback" not in out.stderr and " on http" not in out.stdout
    finally:
        busy.close()
    out = run("serve", "--port", "70000")
    assert out.returncode == 2 and "'70000' is not a port number (1-65535)" in out.stderr


def test_a_ray_address_nobody_listens_at_is_one_line_at_once(tmp_path):
    """With RAY_ADDRESS at a closed port `hpt serve` printed its banner and hung in ray.init's
    retries (SIGTERM did not stop it; `hpt doctor` the same, past 400 s): now serve exits 2
    and doctor fails its ray check, each naming the address, within seconds."""
    closed = socket.create_server(("127.0.0.1", 0))
    address = f"127.0.0.1:{closed.getsockname()[1]}"
    closed.close()  # a port nothing listens at
    env = {**os.environ, "HPT_HOME": str(tmp_path / "hpt"), "RAY_ADDRESS": address}
    with socket.create_server(("127.0.0.1", 0)) as free:
        port = str(free.getsockname()[1])
    started = time.monotonic()
    out = run("serve", "--port", port, env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"hpt serve: no Ray cluster answers at RAY_ADDRESS={address} (Connection refused)" in (
        out.stderr)
    assert " on http" not in out.stdout  # no banner for an API that never served
    out = run("doctor", "--quick", env=env)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"FAIL  ray        {address} unreachable" in out.stdout, out.stdout
    assert "no Ray cluster answers" in out.stdout
    assert time.monotonic() - started < 100  # the retries alone took minutes


def test_a_log_level_uvicorn_lacks_is_refused_before_anything_starts():
    out = run("serve", "--log-level", "bogus")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert ("'bogus' is not a log level: use one of critical, error, warning, info, debug, "
            "trace") in out.stderr


def test_refusals_come_before_the_heavy_imports(tmp_path):
    """A port in use, a bad database URL, an invalid trial spec and an unreachable server are
    refused without loading torch, Ray or pandas (each took 4-7 s of CPU when it did)."""
    busy = socket.create_server(("127.0.0.1", 0))
    port = str(busy.getsockname()[1])
    trial = tmp_path / "trial.yaml"
    trial.write_text("width: 32\ndepth: 1\nhead_dim: 32\nbudget: {steps: 2}\nwidht: 3\n")
    env = {**os.environ, "HPT_HOME": str(tmp_path / "home")}
    cases = [(["serve", "--port", port], {}), (["mlflow-ui", "--port", port], {}),
             (["serve"], {"HPT_DATABASE_URL": "postgresql:/x@db"}),
             (["train", str(trial)], {}), (["status", "--url", "http://127.0.0.1:9"], {})]
    try:
        for args, extra in cases:
            out = subprocess.run([sys.executable, "-X", "importtime", "-m", "hptransfer.cli",
                                  *args], capture_output=True, text=True, timeout=120,
                                 env={**env, **extra})
            assert out.returncode == 2, (args, out.stderr[-800:])
            loaded = {line.split("|")[-1].strip() for line in out.stderr.splitlines()
                      if line.startswith("import time:")}
            assert not loaded & {"torch", "ray", "pandas"}, (args, loaded & {"torch", "ray",
                                                                               "pandas"})
    finally:
        busy.close()


def test_the_mlflow_ui_off_loopback_needs_insecure(tmp_path):
    """`hpt mlflow-ui --host ""` served MLflow (no login: runs can be read and deleted) on
    every interface with no word; `hpt serve` refuses that without a token."""
    env = {**os.environ, "HPT_HOME": str(tmp_path / "home")}
    for host, shown in (("", "every interface"), ("0.0.0.0", "0.0.0.0"),
                        ("example.org", "example.org")):
        out = run("mlflow-ui", "--host", host, "--port", "8999", env=env)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert f"hpt mlflow-ui: refusing to serve on {shown}: the MLflow UI has no login" in (
            out.stderr)
        assert "MLflow UI on" not in out.stdout
    # with --insecure it goes on (to the port check here: a port in use)
    with socket.create_server(("0.0.0.0", 0)) as busy:
        port = str(busy.getsockname()[1])
        out = run("mlflow-ui", "--host", "0.0.0.0", "--port", port, "--insecure", env=env)
    assert "warning: the MLflow UI on 0.0.0.0 without a login (--insecure)" in out.stderr
    assert out.returncode == 2 and f"cannot listen on 0.0.0.0:{port}" in out.stderr, out.stderr


def test_a_bad_worker_setting_is_refused_up_front(tmp_path):
    import os

    trial = tmp_path / "trial.yaml"
    trial.write_text("width: 32\ndepth: 1\nhead_dim: 32\nbudget: {steps: 2}\n")
    for name, value, says in (("HPT_CACHE_MAX_GB", "abc", "HPT_CACHE_MAX_GB must be a number"),
                              ("HPT_COMPILE", "bogus", "HPT_COMPILE='bogus': use one of")):
        env = {**os.environ, name: value, "HPT_HOME": str(tmp_path / "home")}
        for args in (["train", str(trial)], ["doctor", "--quick"]):
            out = run(*args, env=env)
            assert out.returncode == 2 and says in out.stderr, (args, out.stderr[-800:])
            assert "Traceback" not in out.stderr


@pytest.mark.parametrize("name", ["HPT_DATABASE_URL", "HPT_OPTUNA_URL"])
def test_a_database_url_that_is_not_one_is_named_at_once(tmp_path, name):
    """It failed deep in the server's start, after Ray had started: a 41-line traceback
    naming neither the variable nor what to give."""
    import os

    env = {**os.environ, name: "postgresql:/admin:S3CRETPW@db", "HPT_HOME": str(tmp_path)}
    for args in (["serve"], ["doctor", "--quick"]):
        out = run(*args, env=env)
        assert out.returncode == 2, (args, out.stderr[-800:])
        assert f"{name} is not a database URL" in out.stderr and "Traceback" not in out.stderr
        assert "S3CRETPW" not in out.stderr + out.stdout


def test_a_refused_spec_lists_each_problem_once_one_a_line(server, tmp_path):
    url, _ = server
    spec = {**copy.deepcopy(TINY_SPEC), "name": "two-typos"}
    spec["grid"]["widthz"] = [32]
    spec["budget"]["stepz"] = 3
    path = tmp_path / "typos.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = run("submit", str(path), "--url", url)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and lines[0] == "hpt submit: invalid sweep spec:", out.stderr
    assert sorted(line.split(":")[0].strip() for line in lines[1:]) == ["budget.stepz",
                                                                      "grid.widthz"]
    assert sum("widthz" in line for line in lines) == 1  # also on the first line, all joined


# ------------------------------------------- settings refused before Ray (fourth probe)


def _closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def _refused_at_once(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run `hpt ARGS`: it must exit 2 within seconds with one line and no traceback (each of
    these started Ray first, then printed tracebacks)."""
    started = time.monotonic()
    out = run(*args, env={**os.environ, **env})
    assert out.returncode == 2, (args, out.returncode, out.stderr[-800:])
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, (
        out.stderr)
    assert " on http" not in out.stdout  # no banner: nothing served
    assert time.monotonic() - started < 30, args
    return out


def test_a_checkpoint_store_pyarrow_cannot_open_is_named_by_serve_and_doctor(tmp_path):
    """HPT_CHECKPOINT_URL=bogus://x/y passed `hpt serve`, /health and `hpt doctor`; every
    checkpointing trial then failed with a pyarrow traceback."""
    env = {"HPT_HOME": str(tmp_path / "home"), "HPT_CHECKPOINT_URL": "bogus://x/y"}
    out = run("doctor", "--quick", env={**os.environ, **env})
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "FAIL  checkpoint HPT_CHECKPOINT_URL=bogus://x/y" in out.stdout, out.stdout
    assert "-> set HPT_CHECKPOINT_URL to an absolute directory path" in out.stdout
    out = _refused_at_once(["serve", "--port", str(_closed_port())], env)
    assert "HPT_CHECKPOINT_URL=bogus://x/y has a scheme pyarrow does not open" in out.stderr
    assert "file:///path, s3://" in out.stderr  # what it accepts


@pytest.mark.parametrize("args", [["serve"], ["mlflow-ui"],
                                  ["coordcheck", "--steps", "1", "--sizes", "8,16"]])
def test_a_home_that_is_no_directory_is_one_line_before_anything_starts(tmp_path, args):
    """HPT_HOME a file, or under one: serve started Ray, then a 34-line traceback; mlflow-ui
    and coordcheck gave tracebacks too. Now the check `hpt train` had, for every command."""
    afile = tmp_path / "afile"
    afile.write_text("")
    port = ["--port", str(_closed_port())] if args[0] != "coordcheck" else []
    for home in (afile, afile / "sub"):  # coordcheck's folder is HPT_HOME/coordcheck
        out = _refused_at_once([*args, *port], {"HPT_HOME": str(home)})
        assert f"hpt {args[0]}: error: HPT_HOME cannot be used: {afile} is a file" in (
            out.stderr)
        assert out.stderr.rstrip().endswith("; set HPT_HOME to a writable directory")


def test_coordcheck_refuses_a_home_before_it_imports_torch(tmp_path):
    """The refusal is one line at once: importing torch first cost ~2.5 CPU-s before it."""
    afile = tmp_path / "afile"
    afile.write_text("")
    probe = ("import sys; from hptransfer.cli import main; "
             "code = main(['coordcheck', '--steps', '1', '--sizes', '8,16']); "
             "print(code, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env={**os.environ, "HPT_HOME": str(afile)}, timeout=120)
    assert out.stdout.split() == ["2", "False"], out.stdout + out.stderr
    assert "HPT_HOME cannot be used" in out.stderr


@pytest.mark.parametrize("written, said", [
    (None, "no such file"), ("name: x\n", "arms: required field is missing")])
def test_demo_refuses_a_spec_before_it_starts_ray(tmp_path, written, said):
    """`hpt demo --spec` on a missing or invalid file printed its banner and started the API
    and Ray (~5 CPU-s) before the submit said why."""
    spec = tmp_path / "study.yaml"
    if written is not None:
        spec.write_text(written)
    probe = ("import ray; from hptransfer.cli import main; "
             f"code = main(['demo', '--spec', {str(spec)!r}]); "
             "print(code, ray.is_initialized())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env={**os.environ, "HPT_HOME": str(tmp_path / "home")}, timeout=120)
    assert out.stdout.split() == ["2", "False"], out.stdout + out.stderr
    assert out.stderr.startswith("hpt demo: error: ") and said in out.stderr, out.stderr


def test_an_app_database_nobody_answers_at_is_one_line_before_ray(tmp_path):
    """It started Ray, then printed 138 lines with two tracebacks after 11 s."""
    url = f"postgresql://hpt@127.0.0.1:{_closed_port()}/db"
    out = _refused_at_once(["serve", "--port", str(_closed_port())],
                           {"HPT_HOME": str(tmp_path / "home"), "HPT_DATABASE_URL": url})
    assert "hpt serve: error: cannot reach the app database HPT_DATABASE_URL=" in out.stderr
    assert "Connection refused" in out.stderr


@pytest.mark.parametrize("url", ["sqlite:///", "sqlite://", "sqlite:///:memory:",
                                 "sqlite:///file::memory:?uri=true"])
def test_an_in_memory_app_database_is_refused(tmp_path, url):
    """sqlite:/// was served, /health said ok, and every result was gone on restart."""
    env = {"HPT_HOME": str(tmp_path / "home"), "HPT_DATABASE_URL": url}
    for args in (["doctor", "--quick"], ["serve", "--port", str(_closed_port())]):
        out = _refused_at_once(args, env)
        assert f"HPT_DATABASE_URL={url} is an in-memory SQLite database" in out.stderr
    out = _refused_at_once(["doctor", "--quick"], {"HPT_HOME": str(tmp_path / "home"),
                                                   "MLFLOW_TRACKING_URI": url})
    assert f"MLFLOW_TRACKING_URI={url} is an in-memory SQLite store" in out.stderr
