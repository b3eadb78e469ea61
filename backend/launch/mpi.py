"""`--mpi`: one server per MPI rank; MPI says which server this is, how many there are and where rank 0 is.

MPI is used once, at launch (mpi4py: initialise, exchange, finalise): rank 0 also makes the launch's group
secret and MPI hands it to every rank. The group itself rendezvouses through torch's TCP store at rank 0's
address, so a host that dies later is detected like a dead local rank.
Every check runs on every rank after the exchange, so all ranks fail together with the same message.
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import secrets
import socket
import struct
from collections.abc import Mapping

SET_BY_MPI = ("host_rank", "host_count")
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name`."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            request = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError as exc:
            raise ValueError(f"GLOO_SOCKET_IFNAME={name}: interface has no IPv4 address here ({exc.strerror})") from exc
    return socket.inet_ntoa(request[20:24])


def own_address(hosts: int) -> str:
    """The address other hosts reach this one at, chosen as gloo chooses its own: the first interface of
    GLOO_SOCKET_IFNAME if set, else the host name's address; loopback when every rank is on this host."""
    if hosts == 1:
        return "127.0.0.1"
    interfaces = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if interfaces:
        return interface_address(interfaces.split(",")[0])
    address = socket.gethostbyname(socket.gethostname())
    if hosts > 1 and ipaddress.ip_address(address).is_loopback:
        raise ValueError(
            f"rank 0's host name {socket.gethostname()!r} resolves to {address}, which other hosts cannot reach: "
            "set GLOO_SOCKET_IFNAME (mpirun -x GLOO_SOCKET_IFNAME=eth0) or --param rendezvous_host=ADDRESS"
        )
    return address


def _mismatches(values: list[Mapping[str, str]]) -> list[str]:
    """The keys whose value differs from rank 0's, as 'key (ranks ...)'."""
    keys = sorted({k for v in values for k in v})
    return [
        f"{k} (ranks {[r for r, v in enumerate(values) if v.get(k) != values[0].get(k)]})"
        for k in keys
        if any(v.get(k) != values[0].get(k) for v in values)
    ]


def host_parameters(shared: Mapping[str, str], local: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """`host_rank`, `host_count` and `rendezvous_host` of this rank's server, and the group secret (rank 0's).

    `shared` (instances, kind, config parameters) must be equal on every rank; `local` (ports, paths) must
    differ between the ranks on one host. An explicit `rendezvous_host` parameter is kept.
    """
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise RuntimeError(
            "--mpi needs mpi4py and an MPI library: pip install -e '.[mpi]' and apt-get install openmpi-bin"
        ) from exc
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    try:
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        hosts = comm.allreduce(int(node.rank == 0))
        address, error, secret = shared.get("rendezvous_host"), None, secrets.token_hex(16)
        if rank == 0 and address is None:
            try:
                address = own_address(hosts)
            except ValueError as exc:
                error = str(exc)
        everyone = comm.allgather(dict(shared))
        neighbours = node.allgather(dict(local))
        address, error, secret = comm.bcast((address, error, secret), root=0)
        node.Free()
    finally:
        MPI.Finalize()
    if error:
        raise ValueError(error)
    if set(SET_BY_MPI) & set(shared):
        raise ValueError(f"--mpi sets {', '.join(SET_BY_MPI)} from MPI; do not pass them as --param")
    if differ := _mismatches(everyone):
        raise ValueError(f"every rank's server must be configured alike; differing: {', '.join(differ)}")
    for key in local:
        if len({n[key] for n in neighbours}) < len(neighbours):
            raise ValueError(
                f"{len(neighbours)} ranks on one host share {key}={local[key]}: give each its own "
                "(mpirun's colon syntax runs each with its own arguments)"
            )
    return {"host_rank": str(rank), "host_count": str(size), "rendezvous_host": address}, secret
