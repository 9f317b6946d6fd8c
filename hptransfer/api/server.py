"""Run the API (with its dispatcher) in a background thread: the demo and the tests use it."""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from hptransfer.config import Settings
from hptransfer.redaction import redact_logs
from hptransfer.sockets import CannotListen, free_port, listen

from .app import create_app
from .edge import EdgeLimits, edge_protocol

# uvicorn's C-backed HTTP parser and event loop (declared in pyproject.toml): with h11 and
# the stock asyncio loop the HTTP stack, not the routes, set the latency under concurrent
# clients (benchmarks/listing_latency.py: /docs p50 11.7 -> 4.9 ms at 50 clients). Named
# rather than left to uvicorn's "auto", so a missing package fails loudly, not slowly.
# The httptools protocol comes with the head's size, count and time limits (edge.py).
SERVER_OPTIONS = {"loop": "uvloop"}
__all__ = ["CannotListen", "free_port", "listen", "serve_forever", "serve_in_thread"]


def server_options(settings: Settings) -> dict:
    """uvicorn.Config's keywords for the HTTP stack: uvloop, and httptools with limits."""
    limits = EdgeLimits(max_header_bytes=settings.max_header_bytes,
                        max_headers=settings.max_headers,
                        header_timeout_s=settings.header_timeout_s,
                        body_timeout_s=settings.body_timeout_s)
    return {**SERVER_OPTIONS, "http": edge_protocol(limits)}


def serve_forever(settings: Settings, host: str, port: int, log_level: str = "info",
                  sock: socket.socket | None = None) -> None:
    """`hpt serve`: the API in the main thread until SIGTERM or SIGINT, then a clean stop.

    The dispatcher stops (trials in flight stay `running` in the app database and the next
    start re-queues them), Ray shuts down (with an in-process cluster, every process of it)
    and "shutdown complete" is logged. Ray is started first because `ray.init` installs a
    SIGTERM handler that raises SystemExit: uvicorn's own handlers, installed after it, must
    be the ones in force while serving. `sock`: the socket `listen(host, port)` gave, where
    the caller bound it already.
    """
    import ray

    from hptransfer.coordinator.dispatch import init_ray

    if sock is None:  # before Ray, whose processes pick free ports as they start
        sock = listen(host, port)
    init_ray(settings)
    print(f"hptransfer API on http://{host}:{port}  (docs at /docs, dashboards at /dashboards)",
          flush=True)
    # uvicorn puts these back after a signal-initiated stop and re-raises the signal into
    # them: they only note it, so the clean-up below runs.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        config = uvicorn.Config(create_app(settings, freeze_gc=True), host=host, port=port,
                                log_level=log_level, **server_options(settings))
        redact_logs("uvicorn", "uvicorn.error", "uvicorn.access")  # handlers made by Config
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        if ray.is_initialized():
            ray.shutdown()
        print("hpt serve: shutdown complete", file=sys.stderr, flush=True)


@contextmanager
def serve_in_thread(settings: Settings, port: int | None = None,
                    startup_timeout: float = 120.0, dispatch: bool = True) -> Iterator[str]:
    """Yield the base URL of a running server; shut it down on exit. `dispatch=False`: the
    API and its store only (no Ray; trials stay where the store puts them)."""
    port = port or free_port()
    sock = listen("127.0.0.1", port)  # before the app's start-up starts Ray (see listen)
    config = uvicorn.Config(create_app(settings, dispatch=dispatch), host="127.0.0.1", port=port,
                            log_level="warning", lifespan="on",
                            **server_options(settings))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="hpt-api",
                              daemon=True)
    thread.start()
    deadline = time.time() + startup_timeout
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the API server failed to start (see the log above)")
        if time.time() > deadline:
            raise TimeoutError("the API server did not start in time")
        time.sleep(0.1)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()  # uvicorn closes it on a clean stop; this covers a failed start
