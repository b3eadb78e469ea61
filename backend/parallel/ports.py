"""Free TCP ports for servers and rendezvous, picked below the kernel's ephemeral range.

A port found free by binding port 0 comes from the ephemeral range, which every outgoing connection also
draws its local port from: between picking it and a server binding it, a client connection can take it
("address already in use"). Ports below that range are only ever taken by a listener. Torch-free.
"""
from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST_PORT = 10_000


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def free_port(attempts: int = 200) -> int:
    """A port no socket on this host is bound to now, outside the ephemeral range when there is room."""
    top = _ephemeral_start()
    for _ in range(attempts if top > LOWEST_PORT else 0):
        port = random.randrange(LOWEST_PORT, top)
        with socket.socket() as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # no room below the ephemeral range: let the kernel pick
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def port_in_use(port: int) -> bool:
    """Whether a listener holds `port` on this host (the probe binds as a server would, with SO_REUSEADDR)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return True
        return False
