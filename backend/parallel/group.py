"""Joining the group: one bootstrap for the Triton instances and the local spawn helper."""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist


def _all_arrived(store: dist.Store, world_size: int, key: str) -> None:
    """Wait until every rank has called this with `key`, under the store's own (start-up) timeout."""
    if store.add(f"lingbot/{key}", 1) == world_size:
        store.set(f"lingbot/{key}/all", b"1")
    store.wait([f"lingbot/{key}/all"])


@dataclass(frozen=True)
class GroupHandles:
    """The groups one rank works with; all None in a group of one.

    Each gloo group runs a thread that wakes every 10 ms (gloo's TCP event loop), so every gloo group adds to
    an idle CPU instance's cost (bench/README, section 6): the default group is the data group, not a fourth one."""

    data: dist.ProcessGroup | None  # the SP exchanges: NCCL on GPU, gloo on CPU (the default group)
    control: dist.ProcessGroup | None  # small control messages: always gloo
    decode: dist.ProcessGroup | None  # the split VAE decode's rows (parallel/rows): gloo, when the decode is split
    store: dist.Store | None = None  # the rendezvous store, hosted by rank 0

    def all_arrived(self, key: str) -> None:
        """A barrier under the long start-up timeout (the groups' own have the short one), e.g. after loading."""
        if self.store is not None:
            _all_arrived(self.store, dist.get_world_size(), key)


def join_group(
    rank: int,
    world_size: int,
    host: str,
    port: int,
    backend: str,
    init_timeout_s: float,
    collective_timeout_s: float,
    split_decode: bool = True,
) -> GroupHandles:
    """Rendezvous under the long start-up timeout; the groups get the short one, so a dead or hung peer is
    detected in bounded time. The control group gets half of it: an idle group exchanges at least every half
    timeout (its heartbeat), so a peer that hangs while idle is found within the whole one. The decode group
    exists only with `split_decode` (every rank must pass the same)."""
    if world_size == 1:
        return GroupHandles(None, None, None)
    store = dist.TCPStore(host, port, world_size, is_master=(rank == 0),
                          timeout=datetime.timedelta(seconds=init_timeout_s), wait_for_workers=True)
    _all_arrived(store, world_size, "joined")  # every rank is here: connecting needs no long timeout
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return GroupHandles(
        data=dist.group.WORLD,
        control=dist.new_group(backend="gloo", timeout=timeout / 2),
        decode=dist.new_group(backend="gloo", timeout=timeout) if split_decode else None,
        store=store,
    )


def leave_group() -> None:
    """Destroy every process group of this process: peer sockets close and rank 0's store stops listening,
    so the same rendezvous port serves the next load (also after a peer died)."""
    if dist.is_initialized():
        dist.destroy_process_group()
