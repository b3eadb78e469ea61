"""What Linux's /proc says about the server's processes (no tool needed): who they are, memory, CPU time, TCP
sockets."""
from __future__ import annotations

import contextlib
import os
import re
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


def unix_socket_names(pid: int) -> set[str]:
    """The names of the unix sockets a process holds (an abstract socket's with its leading '@'); none once it has
    exited."""
    try:
        inodes = socket_inodes(pid)
    except OSError:
        return set()
    names = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes:
            names.add(fields[7])
    return names


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


def children(pid: int) -> list[int]:
    """A process's children, whichever of its threads started them (none once it has exited)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def descendants(pid: int) -> list[int]:
    """Its children, theirs, and so on."""
    found, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        found += kids
        todo += kids
    return found


def command_line(pid: int) -> list[str]:
    """Its argv ([] once it has exited, or for a zombie)."""
    try:
        return [a for a in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0") if a]
    except OSError:
        return []


def tritonserver_of(root: int, grpc_port: int) -> int | None:
    """The tritonserver serving `grpc_port` among `root`'s descendants (a fleet's or a launcher's), if one runs."""
    flag = f"--grpc-port={grpc_port}"
    return next((p for p in descendants(root) if flag in command_line(p)), None)


def stub_pids(server: int) -> dict[int, int]:
    """rank -> pid of a tritonserver's Python-backend stub processes (one per model instance; the last number of an
    instance name is its index, which is the rank for the single KIND_CPU group the launcher renders)."""
    stubs: dict[int, int] = {}
    for pid in children(server):
        argv = command_line(pid)
        if argv and argv[0].endswith("triton_python_backend_stub"):
            instance = next(a for a in argv if re.fullmatch(r".+_\d+_\d+", a))
            stubs[int(instance.rsplit("_", 1)[1])] = pid
    return dict(sorted(stubs.items()))
