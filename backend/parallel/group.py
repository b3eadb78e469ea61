"""Joining the group: one bootstrap for the Triton instances and the local spawn helper."""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist


def init_process_group(rank: int, world_size: int, host: str, port: int, backend: str, timeout_s: float) -> None:
    """Join the default process group through a TCP store that rank 0 hosts at host:port."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=(rank == 0), timeout=timeout, wait_for_workers=True)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


@dataclass(frozen=True)
class GroupHandles:
    """The groups one rank works with; both None in a group of one."""

    data: dist.ProcessGroup | None  # the SP exchanges: NCCL on GPU, gloo on CPU
    control: dist.ProcessGroup | None  # small control messages: always gloo
    decode: dist.ProcessGroup | None  # the split VAE decode's rows (parallel/rows): always gloo


def join_group(
    rank: int,
    world_size: int,
    host: str,
    port: int,
    backend: str,
    init_timeout_s: float,
    collective_timeout_s: float,
) -> GroupHandles:
    """Rendezvous under the long start-up timeout; block-time groups get the short one, so a dead or hung
    peer is detected in bounded time. The control group gets half of it: an idle group exchanges at least
    every half timeout (its heartbeat), so a peer that hangs while idle is found within the whole one."""
    if world_size == 1:
        return GroupHandles(None, None, None)
    init_process_group(rank, world_size, host, port, backend, init_timeout_s)
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    return GroupHandles(
        data=dist.new_group(backend=backend, timeout=timeout),
        control=dist.new_group(backend="gloo", timeout=timeout / 2),
        decode=dist.new_group(backend="gloo", timeout=timeout),
    )


def leave_group() -> None:
    """Destroy every process group of this process: peer sockets close and rank 0's store stops listening,
    so the same rendezvous port serves the next load (also after a peer died)."""
    if dist.is_initialized():
        dist.destroy_process_group()
