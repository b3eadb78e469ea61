"""A group-wide doorbell: any rank rings it when it has news; idle ranks block on it instead of polling.

Rings are numbered; ring n creates the store key `doorbell/n`, so every rank that waits for number n wakes
on the same ring, and a ring that came before a wait began is still seen (the key stays).
"""
from __future__ import annotations

import datetime
import threading
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

    Two client connections: a store client serialises its calls, so a thread blocked in `wait` must not
    hold the one that `ring` uses from Triton's execute thread.
    """

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        self._ringer = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
        self._waiter = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)

    def count(self) -> int:
        return self._ringer.add(KEY, 0)

    def ring(self) -> None:
        number = self._ringer.add(KEY, 1)
        self._ringer.set(f"{KEY}/{number}", b"")

    def wait(self, number: int, timeout_s: float) -> bool:
        try:
            self._waiter.wait([f"{KEY}/{number}"], datetime.timedelta(seconds=timeout_s))
            return True
        except (dist.DistStoreError, RuntimeError):  # timed out, or the store is gone: the exchange will tell
            return False
