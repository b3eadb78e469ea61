"""A group-wide doorbell: any rank rings it when it has news; idle ranks block on it instead of polling.

Rings are numbered; ring n creates the store key `doorbell/n`, so every rank that waits for number n wakes
on the same ring, and a ring that came before a wait began is still seen (the key stays).
"""
from __future__ import annotations

import datetime
import functools
import logging
import threading
from typing import Protocol

import torch.distributed as dist

from .group import store_client

KEY = "doorbell"  # under the group's secret prefix (group.store_client)
log = logging.getLogger(__name__)


class GroupTampered(RuntimeError):
    """The store held a value the group did not write."""


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

    What the doorbell reads must be the group's own: a count that is not a number (the store then drops the
    connection) or that went back raises from `count`, which fails the group loop on every rank. A `ring`
    never raises to its caller (Triton's execute thread): it marks the doorbell broken and rings, through a
    fresh connection, the number every rank waits for, so the loops read the count at once and fail.
    """

    def __init__(self, host: str, port: int, secret: str, timeout_s: float) -> None:
        self._connect = functools.partial(store_client, host, port, secret, timeout_s)
        self._ringer = self._connect()
        self._waiter = self._connect()
        self._lock = threading.Lock()  # a store call and the check of its answer, as one step
        self._seen = 0  # the highest count read
        self._awaited = 1  # the ring the waiter waits for (every rank waits for the same one)
        self._broken: BaseException | None = None

    def _add(self, amount: int) -> int:
        with self._lock:
            if self._broken is not None:
                raise GroupTampered("the group's doorbell failed earlier") from self._broken
            number = self._ringer.add(KEY, amount)
            if number < self._seen:
                raise GroupTampered(f"the doorbell count went back from {self._seen} to {number}: "
                                    "a value the group did not write")
            self._seen = number
            return number

    def count(self) -> int:
        return self._add(0)

    def ring(self) -> None:
        try:
            number = self._add(1)
            self._ringer.set(f"{KEY}/{number}", b"")
        except Exception as exc:  # noqa: BLE001 - the store is gone or holds another's value: the group fails
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            first, self._broken = self._broken is None, self._broken or exc
        if not first:
            return
        log.error("the group's doorbell failed (%r); waking the group loops to fail the group", exc)
        try:
            self._connect().set(f"{KEY}/{self._awaited}", b"")
        except Exception as wake_error:  # noqa: BLE001 - then the heartbeat finds it
            log.warning("cannot wake the group loops (%r); the next heartbeat fails the group", wake_error)

    def wait(self, number: int, timeout_s: float) -> bool:
        self._awaited = number
        try:
            self._waiter.wait([f"{KEY}/{number}"], datetime.timedelta(seconds=timeout_s))
            return True
        except (dist.DistStoreError, RuntimeError):  # timed out, or the store is gone: the exchange will tell
            return False
