"""Run the API (with its dispatcher) in a background thread: the demo and the tests use it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from hptransfer.config import Settings

from .app import create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_in_thread(settings: Settings, port: int | None = None,
                    startup_timeout: float = 120.0) -> Iterator[str]:
    """Yield the base URL of a running server; shut it down on exit."""
    port = port or free_port()
    config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=port,
                            log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="hpt-api", daemon=True)
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
