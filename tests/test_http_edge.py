"""The HTTP edge of `hpt serve` (issue 52): header size, count and time limits, the token
checked before a body is read, weak tokens refused, guessing braked, gzip bodies refused,
security headers and a Swagger UI served from the package."""

from __future__ import annotations

import dataclasses
import re
import secrets
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from fastapi.testclient import TestClient

from hptransfer.api.app import create_app
from hptransfer.api.auth import AuthThrottle
from hptransfer.cli import main as hpt_main
from hptransfer.config import get_settings, token_strength_problem

TOKEN = secrets.token_urlsafe(32)
CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def edge_server(module_hpt_home):
    """A real uvicorn server (the API without Ray) with 1 s head and body deadlines."""
    from hptransfer.api.server import serve_in_thread

    settings = dataclasses.replace(get_settings(), api_token=TOKEN, header_timeout_s=1.0,
                                   body_timeout_s=1.0, auth_failures=1000)
    with serve_in_thread(settings, dispatch=False) as url:
        yield urlsplit(url)


def exchange(url, data: bytes, wait_s: float = 6.0) -> tuple[bytes, float]:
    """Send `data` on a fresh connection; what comes back until the server closes it (or
    `wait_s` passes), and the seconds that took."""
    t0 = time.perf_counter()
    with socket.create_connection((url.hostname, url.port), timeout=wait_s) as s:
        if data:
            s.sendall(data)
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except TimeoutError:
            pass
    return got, time.perf_counter() - t0


def status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0


def test_a_head_over_the_size_limit_is_431_before_the_rest_is_read(edge_server):
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000  # never ended
    got, took = exchange(edge_server, head)
    assert status(got) == 431 and b"HPT_MAX_HEADER_BYTES" in got, got[:300]
    assert took < 0.9  # answered at once, not when the head deadline passed


def test_too_many_headers_is_431(edge_server):
    lines = b"".join(b"X-H%d: v\r\n" % i for i in range(101))
    got, _ = exchange(edge_server, b"GET /health HTTP/1.1\r\nHost: x\r\n" + lines + b"\r\n")
    assert status(got) == 431 and b"HPT_MAX_HEADERS" in got, got[:300]
    fine = b"".join(b"X-H%d: v\r\n" % i for i in range(90))
    got, _ = exchange(edge_server, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                      + fine + b"\r\n")
    assert status(got) == 200, got[:300]


@pytest.mark.parametrize("sent", [b"", b"GET /health HTTP/1.1\r\nHost: x\r\n"],
                         ids=["idle connection", "unfinished headers"])
def test_a_head_not_sent_in_time_is_cut_off(edge_server, sent):
    got, took = exchange(edge_server, sent)
    assert status(got) == 408 and b"HPT_HEADER_TIMEOUT_S" in got, got[:300]
    assert 0.9 < took < 4


def test_a_body_not_sent_in_time_is_cut_off(edge_server):
    head = (f"POST /sweeps HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n").encode()
    got, took = exchange(edge_server, head + b'{"name": ')
    assert status(got) == 408 and b"HPT_BODY_TIMEOUT_S" in got, got[:300]
    assert 0.9 < took < 4


def test_the_token_is_checked_before_the_body_is_read(edge_server):
    """A 401 without waiting for the body it announced (it was read and parsed first: the
    client got 408 here, after the body deadline)."""
    head = (b"POST /sweeps HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 500000\r\nConnection: close\r\n\r\n")
    got, took = exchange(edge_server, head + b"{" * 1000)
    assert status(got) == 401, got[:300]
    assert took < 0.9


def test_a_request_within_the_limits_is_served(edge_server):
    head = (f"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            f"X-Pad: {'p' * 60_000}\r\n\r\n").encode()
    got, _ = exchange(edge_server, head)
    assert status(got) == 200, got[:300]


def test_a_body_in_a_transfer_coding_other_than_chunked_is_415_saying_so(edge_server):
    # uvicorn undoes only the chunking: the handler got gzip bytes and called them not UTF-8
    body = b"\x1f\x8b\x08\x00"
    head = (f"POST /sweeps HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {TOKEN}\r\nTransfer-Encoding: gzip, chunked\r\n"
            f"Connection: close\r\n\r\n").encode()
    got, _ = exchange(edge_server, head + b"4\r\n" + body + b"\r\n0\r\n\r\n")
    assert status(got) == 415, got[:300]
    assert b"Transfer-Encoding 'gzip' is not supported" in got, got[:600]


def test_weak_token_refused_when_serving_beyond_loopback(hpt_home, monkeypatch, capsys):
    monkeypatch.setenv("HPT_API_TOKEN", "a")
    assert hpt_main(["serve", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "too weak" in err and "secrets.token_urlsafe(32)" in err


@pytest.mark.parametrize("token", ["a", "s3cret", "a" * 64, "ab" * 40, "hunter2hunter2",
                                   "a8546f86dd581d71b606400b91f2cf",  # token_hex(15): 120 bits
                                   "0123456789" * 3])
def test_weak_tokens(token):
    assert token_strength_problem(token) is not None


# fixed draws of secrets.token_urlsafe(16), token_urlsafe(32), token_hex(16) and its upper case:
# the same test ids in every process (pytest-xdist's workers must collect alike)
@pytest.mark.parametrize("token", ["UthzJq2_Fj9XqMWSnIuCnA",
                                   "CGYJ5BFypYbMm1aBoOcXj9ju5tvUtKi8PY-wfCf-Ig4",
                                   "f9c1eb07b3eb54721b4fd8c03ac499ed",
                                   "049C860DB52AA465304E24CFCBB13FB0"])
def test_strong_tokens(token):
    assert token_strength_problem(token) is None


def test_the_throttle_counts_failures_per_address_over_a_window():
    throttle = AuthThrottle(limit=3, window_s=60)
    for t in (0, 1, 2):
        assert throttle.wait_s("10.0.0.1", now=t) == 0
        throttle.failed("10.0.0.1", now=t)
    assert throttle.wait_s("10.0.0.1", now=3) == 57
    assert throttle.wait_s("10.0.0.2", now=3) == 0  # another client is not slowed
    assert throttle.wait_s("10.0.0.1", now=60.5) == 0  # the first failure left the window


@pytest.fixture
def client(hpt_home, monkeypatch):
    monkeypatch.setenv("HPT_API_TOKEN", TOKEN)
    monkeypatch.setenv("HPT_AUTH_FAILURES", "3")
    with TestClient(create_app(get_settings(), dispatch=False)) as c:
        yield c


def test_repeated_401s_are_answered_429_with_retry_after(client):
    wrong = {"authorization": "Bearer wrong", "content-type": "application/json"}
    assert [client.post("/sweeps", json={}, headers=wrong).status_code
            for _ in range(3)] == [401] * 3
    right = {"authorization": f"Bearer {TOKEN}"}
    r = client.post("/sweeps", json={}, headers=right)  # even the right one, for a while
    assert r.status_code == 429 and 0 < int(r.headers["retry-after"]) <= 60
    assert "HPT_API_TOKEN" in r.json()["error"]


def test_a_compressed_body_is_415_saying_so(client):
    r = client.post("/sweeps", content=b"\x1f\x8b\x08\x00",
                    headers={"authorization": f"Bearer {TOKEN}",
                             "content-type": "application/json", "content-encoding": "gzip"})
    assert r.status_code == 415
    assert "Content-Encoding 'gzip' is not supported" in r.json()["error"]


def test_pages_carry_security_headers_and_docs_load_nothing_from_elsewhere(client):
    docs = client.get("/docs")
    assert docs.status_code == 200
    policy = docs.headers["content-security-policy"]
    assert "script-src 'self' 'sha256-" in policy and "frame-ancestors 'none'" in policy
    assert not re.search(r'(src|href)="https?://', docs.text), docs.text
    for asset in re.findall(r'(?:src|href)="(/docs/static/[^"]+)"', docs.text):
        assert client.get(asset).status_code == 200, asset
    assert client.get("/docs/static/package.json").status_code == 404
    redoc = client.get("/redoc", follow_redirects=False)
    assert redoc.status_code == 307 and redoc.headers["location"] == "/docs"
    for path in ("/docs", "/openapi.json", "/health"):
        headers = client.get(path).headers
        assert headers["x-content-type-options"] == "nosniff", path
        assert headers["x-frame-options"] == "DENY", path


@pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium")
def test_swagger_ui_runs_under_its_policy(edge_server, tmp_path):
    url = f"http://{edge_server.hostname}:{edge_server.port}/docs"
    proc = subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
         "--virtual-time-budget=8000", "--dump-dom", url],
        capture_output=True, text=True, timeout=120)
    console = [line for line in proc.stderr.splitlines() if "CONSOLE" in line]
    assert console == [], console
    assert "/sweeps" in proc.stdout and "opblock" in proc.stdout  # the operations drawn
