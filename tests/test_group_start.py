"""A load whose rank fails to start fails at once on every rank: no rank waits out the start-up timeout."""
from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from backend.parallel.group import GroupHandles, PeerStartFailed, store_client
from backend.parallel.ports import free_port


def handles(port: int, world: int, timeout_s: float) -> GroupHandles:
    return GroupHandles(None, None, None, store=store_client("127.0.0.1", port, "s3cret", timeout_s),
                        world_size=world, init_timeout_s=timeout_s)


def test_a_rank_that_fails_while_loading_ends_its_peers_wait_at_once() -> None:
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    waiting, failing, late = (handles(port, 3, 600) for _ in range(3))
    raised: list[BaseException] = []

    def wait_for_loaded() -> None:
        try:
            waiting.all_arrived("loaded")
        except BaseException as exc:  # noqa: BLE001 - what it raises is the test
            raised.append(exc)

    waiter = threading.Thread(target=wait_for_loaded)
    waiter.start()
    began = time.monotonic()
    failing.fail_start(1, MemoryError("no memory for the transformer's shard"))
    waiter.join(5)
    assert not waiter.is_alive() and time.monotonic() - began < 2
    assert isinstance(raised[0], PeerStartFailed)
    assert "rank 1 of this load failed to start (MemoryError: no memory for the transformer's shard)" in str(raised[0])
    with pytest.raises(PeerStartFailed, match="stops waiting for it at 'loaded'"):
        late.all_arrived("loaded")  # a rank that arrives after the failure does not wait either
    late.fail_start(2, PeerStartFailed("relayed"))  # a peer's failure is not said again as this rank's own
    assert "rank 1" in master.get("lingbot/s3cret/start_failed").decode()


def test_ranks_that_all_arrive_pass_and_one_missing_times_out_naming_the_barrier() -> None:
    port = free_port()
    _master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    ranks = [handles(port, 2, 600) for _ in range(2)]
    threads = [threading.Thread(target=r.all_arrived, args=("joined",)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(TimeoutError, match=r"not every rank arrived at 'loaded' within init_timeout_s=0.3"):
        handles(port, 2, 0.3).all_arrived("loaded")
