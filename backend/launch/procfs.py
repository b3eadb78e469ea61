"""What Linux's /proc says about the server's processes (no tool needed): memory, CPU time, TCP sockets."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

LISTEN, ESTABLISHED = "0A", "01"  # /proc/net/tcp's state codes


@dataclass(frozen=True)
class TcpSocket:
    address: str  # local
    port: int  # local
    remote_port: int
    state: str  # a /proc/net/tcp state code, e.g. LISTEN

    @property
    def listening(self) -> bool:
        return self.state == LISTEN


def status_kib(pid: int | str, field: str) -> int:
    """A memory figure of /proc/PID/status in KiB: VmRSS (resident now), VmHWM (its peak); pid "self" for this
    process."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def tcp_sockets(pids: list[int]) -> list[TcpSocket]:
    """Every TCP socket (IPv4 and IPv6) that these processes hold."""
    inodes = set().union(*(socket_inodes(pid) for pid in pids))
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] not in inodes:
                continue
            address, port = fields[1].split(":")
            raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, len(address), 8))
            found.append(TcpSocket(socket.inet_ntop(family, raw), int(port, 16), int(fields[2].split(":")[1], 16),
                                   fields[3]))
    return found
