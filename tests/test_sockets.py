"""Free ports for a topology of processes (`scripts/cluster_up.sh` asks for 9 at once), and
whether anything listens at an address (RAY_ADDRESS) before a client retries it for minutes."""

from __future__ import annotations

import socket

from hptransfer.sockets import free_port, free_ports, no_listener


def test_ports_picked_together_are_distinct_and_free_again() -> None:
    # one at a time, 1000 picks repeat a port (~5 in 300 measured): a cluster_up.sh run gave
    # Ray's GCS and its dashboard the same one
    ports = free_ports(1000)
    assert len(set(ports)) == 1000 and all(0 < p < 65536 for p in ports)
    with socket.socket() as s:  # released: the caller's server can bind it
        s.bind(("127.0.0.1", ports[0]))
    assert isinstance(free_port(), int)


def test_no_listener_says_why_only_where_nothing_listens() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}", f"localhost:{port}"):
            assert no_listener(address) is None, address
    # closed now: refused, in every spelling of the address
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        assert no_listener(address) == "Connection refused", address
    if socket.has_ipv6:
        try:
            with socket.create_server(("::1", 0), family=socket.AF_INET6) as v6:
                assert no_listener(f"[::1]:{v6.getsockname()[1]}") is None
        except OSError:  # no IPv6 loopback on this host
            pass
    # no port to try: Ray resolves these itself
    for address in ("auto", "local", "ray://head", "head:", ":6379"):
        assert no_listener(address) is None, address
    assert no_listener("127.0.0.1:99999") is not None  # out of range: not a listener
