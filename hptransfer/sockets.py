"""The API's and the MLflow UI's listening socket: socket-only, so `hpt serve` and
`hpt mlflow-ui` can refuse a port in use before they import the app (torch, Ray: seconds)."""

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
