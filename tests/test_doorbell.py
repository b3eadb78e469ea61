"""The group's doorbell on the rendezvous store: rings wake waiting ranks; an idle wait logs nothing."""
from __future__ import annotations

import gc
import threading
import time

import torch.distributed as dist

from backend.parallel.doorbell import StoreDoorbell
from backend.parallel.ports import free_port
from polling import wait_until


def listeners() -> int:
    return sum(t.name == "doorbell" for t in threading.enumerate())


def test_rings_wake_waiters_and_idle_waits_time_out_silently(capfd) -> None:
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, wait_for_workers=False)
    before = listeners()
    first, second = StoreDoorbell("127.0.0.1", port, "s3cret", 10), StoreDoorbell("127.0.0.1", port, "s3cret", 10)
    assert listeners() == before + 2

    started = time.monotonic()
    assert not second.wait(1, 0.3) and not second.wait(1, 0.3)  # two idle heartbeats: no ring
    assert 0.5 <= time.monotonic() - started < 5

    woke = []
    waiter = threading.Thread(target=lambda bell=second: woke.append(bell.wait(1, 10)))
    waiter.start()
    first.ring()
    waiter.join(10)
    assert woke == [True] and second.count() == 1 and first.wait(1, 5)  # every rank sees ring 1

    del first, second  # as a closing loop drops its doorbell: the listeners end before the store goes
    gc.collect()
    wait_until(lambda: listeners() == before, 10, "the listeners to end")
    del store
    assert "c10d" not in capfd.readouterr().err  # no "poll ... timed out", no broken-connection trace
