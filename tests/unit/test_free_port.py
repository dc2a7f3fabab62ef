"""The tests' ports: free, and where no outgoing connection takes them while their server
is down (synthq.testing.procs.free_port)."""

from __future__ import annotations

import socket
from pathlib import Path

from synthq.testing.procs import free_port


def test_ports_are_free_and_below_the_ephemeral_range() -> None:
    """A server killed and started again on its port (vLLM in the engine tier, the chaos
    tier's PostgreSQL and Redis) failed with "Address already in use" when its port was
    one the kernel hands to outgoing connections: the restart raced every connection
    opened on the machine meanwhile."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert all(1024 < p < low for p in ports), (low, ports)
    assert len(set(ports)) > 40  # drawn, not one fixed port
    for port in ports[:10]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: nothing holds it
