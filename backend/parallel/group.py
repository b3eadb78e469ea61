"""Joining the group: one bootstrap for the Triton instances and the local spawn helper.

The group keeps to itself: rank 0's rendezvous store listens on `host` only (not on every interface), every key
the ranks use carries the launch's secret, and a group on one host (a loopback `host`) keeps gloo and NCCL on
loopback too.
"""
from __future__ import annotations

import datetime
import secrets
import ipaddress
import logging
import os
import socket
import time
from dataclasses import dataclass

import torch.distributed as dist

from ..api.errors import ConfigError

_INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
# Rank 0's store server, referenced from here only (the groups hold client connections): leaving the group
# drops it, so the port is free for the next load even while a failed group's objects linger.
_hosted: list[dist.TCPStore] = []
log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) is this machine's loopback, so the group is on one host."""
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
    except (socket.gaierror, ValueError):
        return False


def _keep_on_loopback() -> None:
    """gloo and NCCL bind the interface these name; on one host that is loopback, whatever was set."""
    for name in _INTERFACE_VARIABLES:
        if os.environ.get(name, "lo") != "lo":
            log.warning("%s=%s ignored: the group is on one host, so its sockets stay on loopback", name,
                        os.environ[name])
        os.environ[name] = "lo"


def _listening_socket(host: str, port: int) -> int:
    """A socket listening on `host`'s address only, handed to the store as a file descriptor it owns."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"the rendezvous store cannot listen on rendezvous_host={host} rendezvous_port={port}: "
                          f"{exc.strerror}") from exc
    return sock.detach()


def store_client(host: str, port: int, secret: str, timeout_s: float) -> dist.Store:
    """A connection to the group's store whose keys all carry the secret."""
    client = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                           wait_for_workers=False)
    return dist.PrefixStore(f"lingbot/{secret}", client)


FAILED_KEY = "start_failed"  # what a rank that could not start says (GroupHandles.fail_start)
ARRIVAL_POLL_S = 0.05


class PeerStartFailed(RuntimeError):
    """Another rank of this load could not start, so this one stops waiting for it."""


def _all_arrived(store: dist.Store, world_size: int, key: str, timeout_s: float) -> None:
    """Wait until every rank has called this with `key`; a rank that says it failed to start ends the wait at
    once for every other (none waits out the start-up timeout for a peer that will never come)."""
    if store.add(key, 1) == world_size:
        store.set(f"{key}/all", b"1")
    deadline = time.monotonic() + timeout_s
    while not store.check([f"{key}/all"]):
        if store.check([FAILED_KEY]):
            raise PeerStartFailed(f"{store.get(FAILED_KEY).decode()}; this rank stops waiting for it at '{key}'")
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every rank arrived at '{key}' within init_timeout_s={timeout_s:g}")
        time.sleep(ARRIVAL_POLL_S)


@dataclass(frozen=True)
class GroupHandles:
    """The groups one rank works with; all None in a group of one.

    Each gloo group runs a thread that wakes every 10 ms (gloo's TCP event loop), so every gloo group adds to
    an idle CPU instance's cost (bench/README, section 6): the default group is the data group, not a fourth one."""

    data: dist.ProcessGroup | None  # the SP exchanges: NCCL on GPU, gloo on CPU (the default group)
    control: dist.ProcessGroup | None  # small control messages: always gloo
    decode: dist.ProcessGroup | None  # the split VAE decode's rows (parallel/rows): gloo, when the decode is split
    store: dist.Store | None = None  # the rendezvous store, hosted by rank 0 (keys prefixed with the secret)
    load_id: str = ""  # this join's name, the same on every rank (rank 0 draws it): tells one load from the next
    world_size: int = 1
    init_timeout_s: float = 0.0

    def all_arrived(self, key: str) -> None:
        """A barrier under the long start-up timeout (the groups' own have the short one), e.g. after loading;
        it ends at once, raising PeerStartFailed, when another rank says it failed to start."""
        if self.store is not None:
            _all_arrived(self.store, self.world_size, key, self.init_timeout_s)

    def fail_start(self, rank: int, exc: BaseException) -> None:
        """This rank cannot start: every rank waiting at a barrier stops now (their load fails with this one)."""
        if self.store is not None and not isinstance(exc, PeerStartFailed):
            self.store.set(FAILED_KEY, f"rank {rank} of this load failed to start ({type(exc).__name__}: {exc})")


def join_group(
    rank: int,
    world_size: int,
    host: str,
    port: int,
    backend: str,
    init_timeout_s: float,
    collective_timeout_s: float,
    secret: str,
    split_decode: bool = True,
) -> GroupHandles:
    """Rendezvous under the long start-up timeout; the groups get the short one, so a dead or hung peer is
    detected in bounded time. The control group gets half of it: an idle group exchanges at least every half
    timeout (its heartbeat), so a peer that hangs while idle is found within the whole one. The decode group
    exists only with `split_decode` (every rank must pass the same)."""
    if world_size == 1:
        return GroupHandles(None, None, None)
    if is_loopback(host):
        _keep_on_loopback()
    if rank == 0:
        _hosted.append(dist.TCPStore(host, port, is_master=True, master_listen_fd=_listening_socket(host, port),
                                     timeout=datetime.timedelta(seconds=init_timeout_s), wait_for_workers=False))
    store = store_client(host, port, secret, init_timeout_s)
    if rank == 0:
        store.set("load_id", secrets.token_hex(8))
    _all_arrived(store, world_size, "joined", init_timeout_s)  # every rank is here: connecting needs no long timeout
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return GroupHandles(
        data=dist.group.WORLD,
        control=dist.new_group(backend="gloo", timeout=timeout / 2),
        decode=dist.new_group(backend="gloo", timeout=timeout) if split_decode else None,
        store=store,
        load_id=store.get("load_id").decode(),
        world_size=world_size,
        init_timeout_s=init_timeout_s,
    )


def leave_group() -> None:
    """Destroy every process group of this process: peer sockets close and rank 0's store stops listening,
    so the same rendezvous port serves the next load (also after a peer died)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    _hosted.clear()
