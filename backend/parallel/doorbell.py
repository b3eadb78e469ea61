"""A group-wide doorbell: any rank rings it when it has news; idle ranks block on it instead of polling.

Rings are numbered; ring n creates the store key `doorbell/n`, so every rank that waits for number n wakes
on the same ring, and a ring that came before a wait began is still seen (the key stays).
"""
from __future__ import annotations

import contextlib
import datetime
import threading
import weakref
from typing import Protocol

import torch.distributed as dist

KEY = "lingbot/doorbell"


class Doorbell(Protocol):
    def count(self) -> int: ...  # rings so far

    def ring(self) -> None: ...

    def wait(self, number: int, timeout_s: float) -> bool: ...  # True once ring `number` happened


class LocalDoorbell:
    """One process: a condition variable."""

    def __init__(self) -> None:
        self._rings = 0
        self._changed = threading.Condition()

    def count(self) -> int:
        with self._changed:
            return self._rings

    def ring(self) -> None:
        with self._changed:
            self._rings += 1
            self._changed.notify_all()

    def wait(self, number: int, timeout_s: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self._rings >= number, timeout_s)


class StoreDoorbell:
    """The group's TCP store (rank 0 hosts it): a blocked `wait` costs no CPU on any rank.

    Two client connections: a store client serialises its calls, so the listener blocked on the next ring
    must not hold the one that `ring` uses from Triton's execute thread. The listener's store wait has no
    timeout; the caller's timeout is a local one (a store wait that times out logs two c10d "poll ... timed
    out" warnings, which an idle server would print every heartbeat).
    """

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        self._ringer = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
        follower = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
        self._listener = RingListener(follower, self.count())
        # Once this doorbell is dropped, the listener is woken by a last ring and ends, so no store wait
        # is left open when the group closes its store.
        weakref.finalize(self, self._listener.close, self._ringer)

    def count(self) -> int:
        return self._ringer.add(KEY, 0)

    def ring(self) -> None:
        ring(self._ringer)

    def wait(self, number: int, timeout_s: float) -> bool:
        return self._listener.wait(number, timeout_s)


def ring(store: dist.Store) -> None:
    number = store.add(KEY, 1)
    store.set(f"{KEY}/{number}", b"")


class RingListener:
    """A thread that follows the rings one by one on its own store connection."""

    NO_TIMEOUT = datetime.timedelta(days=365)

    def __init__(self, store: dist.Store, seen: int) -> None:
        self._store = store
        self._seen = seen
        self._closing = False
        self._changed = threading.Condition()
        threading.Thread(target=self._follow, name="doorbell", daemon=True).start()

    def _follow(self) -> None:
        while True:
            try:
                self._store.wait([f"{KEY}/{self._seen + 1}"], self.NO_TIMEOUT)
            except RuntimeError:  # the store is gone: waits time out, and the exchange will tell
                return
            with self._changed:
                if self._closing:
                    return
                self._seen += 1
                self._changed.notify_all()

    def wait(self, number: int, timeout_s: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self._seen >= number, timeout_s)

    def close(self, ringer: dist.Store) -> None:
        with self._changed:
            self._closing = True
        with contextlib.suppress(RuntimeError):  # the store may be gone already
            ring(ringer)
