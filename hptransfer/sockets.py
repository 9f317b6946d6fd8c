"""Sockets without the app: the API's and the MLflow UI's listening socket (so `hpt serve`
and `hpt mlflow-ui` refuse a port in use before they import torch and Ray), free ports,
and whether anything listens at an address before a client waits on it."""

from __future__ import annotations

import socket


class CannotListen(ValueError):
    """The address to serve on cannot be bound (a port in use, say)."""


def listen(host: str, port: int) -> socket.socket:
    """The API's listening socket, bound now: a port freed by a stopped server stays free
    only until some other process binds it, and starting Ray starts several that bind
    ports of their own (a restart on the same port once found Ray's metrics agent on it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except (OSError, OverflowError) as exc:  # in use, no such address, out of range
        why = getattr(exc, "strerror", None) or str(exc)
        raise CannotListen(f"cannot listen on {host}:{port}: {why}") from None


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports on 127.0.0.1, each socket held until all are bound: ports
    asked for one at a time can repeat, since a released port may be handed out again
    (`cluster_up.sh` once gave Ray's GCS and its dashboard one port, and Ray refused)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def no_listener(address: str, timeout_s: float = 5.0) -> str | None:
    """Why nothing accepts a connection at `address` ("host:port", "[v6]:port", or either
    after "scheme://"), or None when something does or `address` names no port (Ray's
    "auto", say): Ray's client retries an address nobody listens at for minutes."""
    host, sep, port = address.split("://", 1)[-1].rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return None
    except (OSError, OverflowError) as exc:  # refused, no route, timed out, no such host
        return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
