"""What the client and `hpt` say when the server's answer is not the hptransfer API's: a
reply of another shape, a page that is not JSON, a redirect, a proxy's error page; and the
client-side refusals of a spec file too large to send and a server URL that is no URL.
Against a real HTTP server (a few lines of http.server) that answers what each test sets."""

from __future__ import annotations

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml
from conftest import TINY_SPEC

from hptransfer.cli import main
from hptransfer.client import ApiError, Client, read_spec_file
from hptransfer.redaction import mask_url

WRONG_SERVER = "is HPT_URL the hptransfer API?"


class _Answer(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        status, headers, body = self.server.reply  # type: ignore[attr-defined]
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:  # quiet test output
        pass


class FakeServer:
    """An HTTP server on a free port answering every request with what `answer` set."""

    def __init__(self) -> None:
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), _Answer)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.answer(200, {})

    def answer(self, status: int, body: object, content_type: str = "application/json",
               **headers: str) -> None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.http.reply = (status, {"content-type": content_type, **headers}, raw)


@pytest.fixture(scope="module")
def fake_server():
    server = FakeServer()
    threading.Thread(target=server.http.serve_forever, daemon=True).start()
    yield server
    server.http.shutdown()
    server.http.server_close()


@pytest.fixture
def fake(fake_server, monkeypatch):
    for var in ("HPT_URL", "HPT_API_TOKEN", "HPT_MAX_REQUEST_BYTES"):
        monkeypatch.delenv(var, raising=False)
    fake_server.answer(200, {})
    return fake_server


def spec_path(tmp_path, spec: dict | None = None):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec or copy.deepcopy(TINY_SPEC)))
    return path


CALLS = {
    "get": lambda c: c.get("abc"),
    "list": lambda c: c.list(),
    "cancel": lambda c: c.cancel("abc"),
    "health": lambda c: c.health(),
    "trials": lambda c: c.trials("abc"),
    "fits": lambda c: c.fits("abc"),
    "fits_text": lambda c: c.fits_text("abc"),
    "plan": lambda c: c.plan(copy.deepcopy(TINY_SPEC)),
    "submit": lambda c: c.submit(copy.deepcopy(TINY_SPEC)),
}


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("status,body", [
    (200, {}), (200, [1, 2, 3]), (200, "ok"), (200, {"items": "x", "total": 1}),
    (200, [{"id": "abc"}]),
    (400, ["oops"]), (502, "Bad gateway"), (400, {"error": {"nested": 1}, "errors": "notalist"}),
    (422, {"error": "bad", "errors": [{"field": 1}]}),
])
def test_a_reply_of_another_shape_is_an_api_error_naming_the_url(fake, call, status, body):
    """They were KeyErrors, TypeErrors and AttributeErrors from inside the client, or the
    reply returned as it came (`get` gave back a list)."""
    fake.answer(status, body)
    with Client(fake.url) as c, pytest.raises(ApiError) as info:
        CALLS[call](c)
    message = info.value.message
    assert info.value.status == status
    assert message.startswith(f"the server at {fake.url} answered {status}"), message
    assert message.endswith(WRONG_SERVER) and "\n" not in message, message
    assert " was expected " in message


def test_a_reply_the_client_can_use_still_passes(fake):
    sweep = {"id": "abc", "name": "n", "status": "running", "counts": {"running": 1},
             "total": 1, "done": 0, "stages": None}
    fake.answer(200, sweep)
    with Client(fake.url) as c:
        assert c.get("abc") == sweep
    fake.answer(404, {"error": "no sweep with id 'abc'", "errors": []})
    with Client(fake.url) as c, pytest.raises(ApiError) as info:
        c.get("abc")
    assert info.value.message == "no sweep with id 'abc'" and info.value.status == 404
    fake.answer(503, {"status": "down", "database": "gone"})  # /health's own report, a 503
    with Client(fake.url) as c, pytest.raises(ApiError) as info:
        c.health()
    assert info.value.message == '{"status": "down", "database": "gone"}'


@pytest.mark.parametrize("args", [["status"], ["status", "abc"], ["trials", "abc"],
                                  ["fits", "abc"], ["cancel", "abc"], ["submit", "SPEC"],
                                  ["plan", "SPEC"]])
@pytest.mark.parametrize("body", [{}, [1, 2, 3]])
def test_the_cli_says_one_line_of_a_reply_of_another_shape(fake, tmp_path, capsys, args,
                                                           body):
    """Each printed a traceback, and `hpt status` printed nothing and exited 0 for `{}`."""
    fake.answer(200, body)
    args = [str(spec_path(tmp_path)) if a == "SPEC" else a for a in args]
    assert main([*args, "--url", fake.url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"hpt {args[0]}: the server at "), err
    assert WRONG_SERVER in err


def test_a_page_that_is_not_json_a_redirect_and_a_proxy_page_are_named(fake, capsys):
    """A login page or a redirect was a bare JSONDecodeError ("Expecting value: line 1
    column 1"), and a proxy's 502 page was printed whole as the error line."""
    login = b"<html><head><title>Sign in</title></head><body>" + b"x" * 5000 + b"</body></html>"
    fake.answer(200, login, "text/html; charset=utf-8")
    with Client(fake.url) as c, pytest.raises(ApiError) as info:
        c.get("abc")
    assert info.value.message == (f"the server at {fake.url} answered 200 OK with text/html, "
                                  f"not JSON ('Sign in'): {WRONG_SERVER}")

    fake.answer(302, b"", "text/html", location="http://127.0.0.1:9/login")
    with Client(fake.url) as c, pytest.raises(ApiError) as info:
        c.list()
    assert info.value.message.startswith(f"the server at {fake.url} answered 302 Found, a "
                                         "redirect to 'http://127.0.0.1:9/login': ")

    nginx = (b"<html><head><title>502 Bad Gateway</title></head><body><center><h1>502 Bad "
             b"Gateway</h1></center><hr><center>nginx</center>" + b" " * 6000 + b"</body></html>")
    fake.answer(502, nginx, "text/html")
    assert main(["status", "abc", "--url", fake.url]) == 2
    err = capsys.readouterr().err
    assert err == (f"hpt status: the server at {fake.url} answered 502 Bad Gateway with "
                   f"text/html, not JSON ('502 Bad Gateway'): {WRONG_SERVER}\n")

    # no title: the text without its tags, cut short
    fake.answer(503, b"<p>" + b"busy " * 2000 + b"</p>", "text/plain")
    with Client(fake.url) as c, pytest.raises(ApiError) as info:
        c.get("abc")
    assert "('busy busy" in info.value.message and len(info.value.message) < 400
    fake.answer(200, b"{not json", "application/json")
    with Client(fake.url) as c, pytest.raises(ApiError, match="a body that is not valid JSON"):
        c.get("abc")


def test_the_cli_escapes_terminal_control_characters_in_error_lines(fake, tmp_path, capsys):
    """A spec's unknown key holding ESC/BEL reached the terminal raw as the field path of
    the 422's error ("fixed.^[[2J^[[31mEVIL^G: unknown field ...")."""
    key = "\x1b[2J\x1b[31mEVIL\x07"
    fake.answer(422, {"error": f"invalid sweep spec: fixed.{key}: unknown field {key!r}",
                      "errors": [{"field": f"fixed.{key}", "message": f"unknown field {key!r}"}]})
    assert main(["plan", str(spec_path(tmp_path)), "--url", fake.url]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err
    assert "  fixed.\\x1b[2J\\x1b[31mEVIL\\x07: unknown field '\\x1b[2J" in err, err
    # a local error the same: `hpt train` validates its spec itself
    trial = tmp_path / "trial.json"
    trial.write_text(json.dumps({"width": 32, "depth": 1, "head_dim": 32,
                                 "budget": {"steps": 2}, key: 1}))
    assert main(["train", str(trial)]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err and "\\x1b[2J" in err, err


def test_the_cli_names_its_own_flag_not_the_query_parameter(fake, tmp_path, capsys):
    """`hpt fits ID --bootstrap -1` said "query.bootstrap: ...", a name the user never gave."""
    def refused(name: str) -> None:
        fake.answer(422, {"error": f"invalid request: query.{name}: Input should be greater "
                                   "than or equal to 0",
                          "errors": [{"field": f"query.{name}",
                                      "message": "Input should be greater than or equal to 0"}]})

    refused("bootstrap")
    assert main(["fits", "abc", "--bootstrap", "-1", "--url", fake.url]) == 2
    err = capsys.readouterr().err
    assert err == ("hpt fits: invalid request:\n"
                   "  --bootstrap: Input should be greater than or equal to 0\n"), err
    refused("cpus")
    assert main(["plan", str(spec_path(tmp_path)), "--cpus", "-1", "--url", fake.url]) == 2
    assert "  --cpus: Input should be" in capsys.readouterr().err
    refused("limit")  # a parameter the CLI sets on its own keeps the server's name
    assert main(["status", "--url", fake.url]) == 2
    assert "  query.limit: Input should be" in capsys.readouterr().err


def test_a_spec_file_far_past_any_spec_is_refused_before_it_is_read(fake, tmp_path, capsys):
    """A 200 MB file took 89 s and 620 MB of memory to be refused as "not a mapping"."""
    big = tmp_path / "big.yaml"
    with big.open("wb") as f:  # sparse: 200 MiB on no disk
        f.truncate(200 * 2**20)
    says = f"{big} is 200 MiB; no spec is larger than 64 MiB: is this the right"
    with pytest.raises(ValueError, match="is 200 MiB; no spec is larger than 64 MiB"):
        read_spec_file(big)
    for args in (["plan", str(big), "--url", fake.url], ["submit", str(big), "--url", fake.url],
                 ["train", str(big)]):
        assert main(args) == 2
        assert f"error: {says} file?" in capsys.readouterr().err
    # a spec of 2 MiB, most of it comments, is read: its request body is what counts (the
    # server's HPT_MAX_REQUEST_BYTES, which a client cannot know)
    commented = tmp_path / "commented.yaml"
    commented.write_text(("# " + "x" * 1000 + "\n") * 2000 + yaml.safe_dump(TINY_SPEC))
    assert read_spec_file(commented)["name"] == TINY_SPEC["name"]


def test_a_server_url_without_a_scheme_or_malformed_says_what_is_wrong():
    """"127.0.0.1:18641" failed at the first request as "UnsupportedProtocol", and
    "http://[::1" was shown as '***'."""
    with pytest.raises(ValueError, match=r"invalid server URL '127.0.0.1:18641': it has no "
                                         r"scheme: add http:// \(http://127.0.0.1:18641\)"):
        Client("127.0.0.1:18641")
    with pytest.raises(ValueError, match=r"invalid server URL 'http://\[::1': it is not a "
                                         r"valid URL \(Invalid IPv6 URL\)"):
        Client("http://[::1")
    with pytest.raises(ValueError, match="'ftp://h': the API is served over http"):
        Client("ftp://h")
    # credentials stay masked in a URL urlsplit cannot read
    assert mask_url("http://u:S3CRET@[::1/x?token=T0KEN") == "http://u:***@[::1/x?***"


def test_a_long_sweep_id_is_cut_in_the_message(capsys):
    """`hpt status <3000 x's>` echoed all 3,000."""
    assert main(["status", "x" * 3000, "--url", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert len(err) < 200 and "ids are 1 to 64 letters, digits, - and _" in err, err


@pytest.mark.parametrize("status,body,content_type", [
    (200, {}, "application/json"),  # another JSON service's 200 used to pass as "answers"
    (200, {"status": "ok"}, "application/json"),  # no components: not our report
    (200, {"status": ["ok"], "components": []}, "application/json"),
    (200, [1, 2], "application/json"),  # was "unreachable ('list' object has no ...)"
    (502, b"<html>Bad Gateway</html>", "text/html"),  # a proxy's page, not unreachable
])
def test_doctors_api_check_fails_on_a_server_that_is_not_hptransfer(fake, status, body,
                                                                     content_type):
    from hptransfer.coordinator.health import check_api

    fake.answer(status, body, content_type=content_type)
    check = check_api(fake.url)
    assert not check.ok and "with no hptransfer health report" in check.detail, check
    assert f"answers {status} ({content_type})" in check.detail
    assert WRONG_SERVER in check.fix


def test_doctors_api_check_passes_a_health_report_and_names_a_degraded_one(fake):
    from hptransfer.coordinator.health import check_api

    fake.answer(200, {"status": "degraded", "components": [{"name": "ray", "ok": False}]})
    assert check_api(fake.url).ok and "(degraded)" in check_api(fake.url).detail
    fake.answer(503, {"status": "down", "components": [{"name": "database", "ok": False}]})
    check = check_api(fake.url)
    assert not check.ok and "answers 503 (down)" in check.detail, check
    fake.answer(401, {"detail": "a bearer token is required"})
    assert "refuses this HPT_API_TOKEN (401)" in check_api(fake.url).detail
