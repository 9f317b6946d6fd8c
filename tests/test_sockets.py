"""Free ports for a topology of processes (`scripts/cluster_up.sh` asks for 9 at once)."""

from __future__ import annotations

import socket

from hptransfer.sockets import free_port, free_ports


def test_ports_picked_together_are_distinct_and_free_again() -> None:
    # one at a time, 1000 picks repeat a port (~5 in 300 measured): a cluster_up.sh run gave
    # Ray's GCS and its dashboard the same one
    ports = free_ports(1000)
    assert len(set(ports)) == 1000 and all(0 < p < 65536 for p in ports)
    with socket.socket() as s:  # released: the caller's server can bind it
        s.bind(("127.0.0.1", ports[0]))
    assert isinstance(free_port(), int)
