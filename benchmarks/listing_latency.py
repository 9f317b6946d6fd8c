"""Listing latency under concurrent clients: GET /sweeps and /dashboards with many stored sweeps.

A real `hpt serve` (uvicorn, SQLite app DB, no dispatcher work: every sweep is cancelled so
nothing trains) runs as a subprocess in a scratch HPT_HOME holding `--sweeps` sweeps (each 4
trials). The MLflow mirror then copies every cancelled sweep (and renders its dashboards as
artifacts): the benchmark waits until it has caught up (at most `--settle` seconds; it says
when it did not), so the figures are the listings' own, not that burst's. `--clients`
concurrent clients then issue `--requests` requests each against:

* baseline: GET /docs — FastAPI's Swagger page: the same server's HTTP stack, no database and
  no checks (a small HTML string built per request), measured in the same run;
* GET /health (the component checks), GET /sweeps (a page of 100 summaries) and
  GET /dashboards (the HTML index of every sweep);
* the two listings again while the app database changes `--churn` times a second (a cancel
  of a cancelled sweep: one commit each), so the listings are rebuilt as they are while
  sweeps run, not only served from the listing cache.

It prints p50/p99 per route and the ratio of each route's p50/p99 to the baseline's, so the
figures survive a noisy, shared machine.

`--attack` measures instead GET /sweeps quiet, then beside `--slow-attackers` connections
sending their headers a byte every half second and one client sending 8 MB headers as fast
as the server takes them (both reconnecting when cut off), and prints the p99 under attack
over the quiet p99 (the HTTP edge's limits, hptransfer/api/edge.py, should keep it near 1).

The load comes from a lean keep-alive client on raw asyncio streams (`lean_http`), so on a
small machine the figures are the server's rather than the load generator's; `--client
httpx` uses httpx.AsyncClient instead (about 1 ms of client CPU per request). The last
column is the load generator's CPU time per request.

    .venv/bin/python benchmarks/listing_latency.py [--sweeps 200] [--clients 50] [--requests 10]
    .venv/bin/python benchmarks/listing_latency.py --attack [--slow-attackers 50]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
from lean_http import Connection

from hptransfer.api.server import free_port
from hptransfer.client import Client
from hptransfer.store.store import Store


def tiny_spec(i: int) -> dict:
    return {
        "name": f"listing-{i}",
        "arms": [{"arch": "gpt", "parameterization": "sp"}],
        "grid": {"widths": [32], "depths": [1], "lrs": [0.001, 0.002, 0.004, 0.008],
                 "sigma_bases": [0.02], "seeds": [0]},
        "fixed": {"head_dim": 32, "seq_len": 16, "device": "cpu"},
        "budget": {"steps": 2, "batch_size": 2},
        "max_concurrent": 1,
        "reuse": False,
    }


async def hammer(url: str, path: str, clients: int, requests: int,
                 churn: tuple[str, float] | None = None, client: str = "lean") -> np.ndarray:
    """Latencies (ms) of `clients` x `requests` GETs of `path`, each client on its own
    keep-alive connection; with `churn` (a path, a rate), a POST to that path at that rate
    meanwhile (not timed). `client`: "lean" (raw asyncio streams, little client CPU) or
    "httpx" (httpx.AsyncClient, about 1 ms of client CPU per request)."""
    times: list[float] = []
    if client == "httpx":
        limits = httpx.Limits(max_connections=clients + 1)
        http = httpx.AsyncClient(base_url=url, timeout=60, limits=limits)

        async def connect() -> Any:
            return http

        async def send(conn: Any, method: str, p: str, body: Any = None) -> int:
            return (await conn.request(method, p, json=body)).status_code
    else:
        parsed = urlsplit(url)

        async def connect() -> Any:
            return Connection(parsed.hostname or "127.0.0.1", parsed.port or 80)

        async def send(conn: Any, method: str, p: str, body: Any = None) -> int:
            return (await conn.request(method, p, body))[0]

    async def one_client() -> None:
        conn = await connect()
        for _ in range(requests):
            t0 = time.perf_counter()
            status = await send(conn, "GET", path)
            times.append(time.perf_counter() - t0)
            if status >= 400:
                raise RuntimeError(f"GET {path}: HTTP {status}")
        if client == "lean":
            await conn.close()

    async def writer(post: str, rate: float) -> None:
        conn = await connect()
        while True:
            if (status := await send(conn, "POST", post, {})) >= 400:
                raise RuntimeError(f"POST {post}: HTTP {status}")
            await asyncio.sleep(1.0 / rate)

    task = asyncio.create_task(writer(*churn)) if churn else None
    try:
        await asyncio.gather(*(one_client() for _ in range(clients)))
    finally:
        if task:
            task.cancel()
        if client == "httpx":
            await http.aclose()
    return np.array(times) * 1000.0


async def slow_headers(host: str, port: int) -> None:
    """One connection sending a request's headers a byte every half second, again when cut."""
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET /sweeps HTTP/1.1\r\nHost: x\r\n")
            while not reader.at_eof():
                writer.write(b"a")
                await writer.drain()
                await asyncio.sleep(0.5)
        except OSError:
            await asyncio.sleep(0.05)


async def big_headers(host: str, port: int, megabytes: int = 8) -> None:
    """Requests with a `megabytes` MB header, sent as fast as the server reads them."""
    chunk = b"a" * (1 << 16)
    while True:
        try:
            _, writer = await asyncio.open_connection(host, port)
            writer.write(b"GET /sweeps HTTP/1.1\r\nHost: x\r\nX-Big: ")
            for _ in range(megabytes * 16):
                writer.write(chunk)
                await writer.drain()
            writer.close()
        except OSError:  # cut off by the server
            await asyncio.sleep(0.01)


async def attacked(url: str, path: str, clients: int, requests: int, slow: int,
                   client: str) -> np.ndarray:
    """hammer() while `slow` slow-header connections and one big-header client run."""
    parsed = urlsplit(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    attackers = [asyncio.create_task(slow_headers(host, port)) for _ in range(slow)]
    attackers.append(asyncio.create_task(big_headers(host, port)))
    await asyncio.sleep(2.0)  # the attack under way first
    try:
        return await hammer(url, path, clients, requests, client=client)
    finally:
        for task in attackers:
            task.cancel()
        await asyncio.gather(*attackers, return_exceptions=True)


def attack_report(url: str, a: argparse.Namespace) -> None:
    """GET /sweeps p50/p99 quiet and under attack, in the same run, and their ratio."""
    path = "/sweeps?limit=100"
    asyncio.run(hammer(url, path, 4, 2, client=a.client))  # warm up
    quiet = asyncio.run(hammer(url, path, a.clients, a.requests, client=a.client))
    under = asyncio.run(attacked(url, path, a.clients, a.requests, a.slow_attackers, a.client))
    print(f"{a.sweeps} sweeps stored, {a.clients} clients x {a.requests} requests of GET {path}"
          f"; attack: {a.slow_attackers} slow-header connections + one 8 MB-header client; "
          f"load average {os.getloadavg()[0]:.2f}")
    q50, q99 = np.percentile(quiet, 50), np.percentile(quiet, 99)
    u50, u99 = np.percentile(under, 50), np.percentile(under, 99)
    print(f"{'':<14} {'p50 ms':>8} {'p99 ms':>8}")
    print(f"{'quiet':<14} {q50:8.1f} {q99:8.1f}")
    print(f"{'under attack':<14} {u50:8.1f} {u99:8.1f}")
    print(f"p99 under attack / quiet: {u99 / q99:.2f} (p50: {u50 / q50:.2f})")


def wait_for_mirror(home: Path, timeout: float) -> str:
    """Wait until the server's MLflow mirror has nothing left to copy; say how long it took."""
    t0 = time.time()
    with Store(f"sqlite:///{home / 'hpt.db'}") as store:  # read only: counts rows
        while (backlog := store.mirror_backlog()) and time.time() - t0 < timeout:
            time.sleep(1.0)
    took = time.time() - t0
    return (f"mirror caught up in {took:.0f} s" if not backlog else
            f"mirror still busy after {took:.0f} s ({backlog} rows left): figures include it")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweeps", type=int, default=200)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--churn", type=float, default=10.0,
                    help="commits a second during the second round of listings")
    ap.add_argument("--settle", type=float, default=300.0,
                    help="seconds to wait at most for the MLflow mirror to catch up")
    ap.add_argument("--client", choices=("lean", "httpx"), default="lean",
                    help="load generator: raw asyncio streams (default) or httpx.AsyncClient")
    ap.add_argument("--attack", action="store_true",
                    help="GET /sweeps quiet vs beside slow- and big-header attackers")
    ap.add_argument("--slow-attackers", type=int, default=50,
                    help="slow-header connections in --attack")
    a = ap.parse_args()

    home = Path(tempfile.mkdtemp(prefix="hpt-listing-"))
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "HPT_DATABASE_URL", "MLFLOW_TRACKING_URI", "HPT_API_TOKEN")}
    env.update(HPT_HOME=str(home), HPT_PORT=str(port))
    server = subprocess.Popen([sys.executable, "-m", "hptransfer.cli", "serve"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code < 500:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise SystemExit("server did not start")
            time.sleep(0.5)
        with Client(url) as c:
            for i in range(a.sweeps):
                sid = c.submit(tiny_spec(i))["id"]
                c.cancel(sid)  # stored, listed, never trained
        churn = (f"/sweeps/{sid}/cancel", a.churn)
        settled = wait_for_mirror(home, a.settle)
        if a.attack:
            attack_report(url, a)
            return
        rows, cpu = {}, {}
        writes = f"{a.churn:g} commits/s"
        for name, path, writing in (
            ("baseline /docs", "/docs", None), ("GET /health", "/health", None),
            ("GET /sweeps", "/sweeps?limit=100", None), ("GET /dashboards", "/dashboards", None),
            (f"GET /sweeps, {writes}", "/sweeps?limit=100", churn),
            (f"GET /dashboards, {writes}", "/dashboards", churn),
        ):
            asyncio.run(hammer(url, path, 4, 2, client=a.client))  # warm up
            t0 = time.process_time()
            rows[name] = asyncio.run(hammer(url, path, a.clients, a.requests, writing,
                                            a.client))
            cpu[name] = (time.process_time() - t0) * 1000.0 / len(rows[name])
        base = rows["baseline /docs"]
        b50, b99 = np.percentile(base, 50), np.percentile(base, 99)
        print(f"{a.sweeps} sweeps stored, {a.clients} concurrent clients x {a.requests} requests"
              f"; {settled}; {a.client} client; load average {os.getloadavg()[0]:.2f}")
        print(f"{'route':<32} {'p50 ms':>8} {'p99 ms':>8} {'p50/base':>9} {'p99/base':>9} "
              f"{'client CPU ms/req':>18}")
        for name, t in rows.items():
            p50, p99 = np.percentile(t, 50), np.percentile(t, 99)
            print(f"{name:<32} {p50:8.1f} {p99:8.1f} {p50 / b50:9.2f} {p99 / b99:9.2f} "
                  f"{cpu[name]:18.2f}")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
