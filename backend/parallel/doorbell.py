"""A group-wide doorbell: any rank rings it when it has news; idle ranks block on it instead of polling.

Rings are numbered; ring n creates the store key `doorbell/n`, so every rank that waits for number n wakes
on the same ring, and a ring that came before a wait began is still seen (the key stays).
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import socket
import threading
import weakref
from typing import Protocol
from collections.abc import Callable

import torch.distributed as dist

from .group import store_client

KEY = "doorbell"  # under the group's secret prefix (group.store_client)
# A last-word connection (waking the loops or the listener) gives up this soon: with a dead store, the
# collective timeout's connect retries would hold the failing loop for tens of seconds.
WAKE_TIMEOUT_S = 2.0
log = logging.getLogger(__name__)


def store_listens(address: tuple[str, int]) -> bool:
    """Whether the store's port takes a connection: refused at once when its host died, where a store client
    would retry until its timeout."""
    try:
        socket.create_connection(address, timeout=WAKE_TIMEOUT_S).close()
    except OSError:
        return False
    return True


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

    Two client connections: a store client serialises its calls, so the listener blocked on the next ring
    must not hold the one that `ring` uses from Triton's execute thread. The listener's store wait has no
    timeout; the caller's timeout is a local one (a store wait that times out logs two c10d "poll ... timed
    out" warnings, which an idle server would print every heartbeat).

    What the doorbell reads must be the group's own: a count that is not a number (the store then drops the
    connection) or that went back raises from `count`, which fails the group loop on every rank. A `ring`
    never raises to its caller (Triton's execute thread): it marks the doorbell broken and rings, through a
    fresh connection, the number every rank waits for, so the loops read the count at once and fail.
    """

    def __init__(self, host: str, port: int, secret: str, timeout_s: float) -> None:
        self._address = (host, port)
        self._connect = functools.partial(store_client, host, port, secret, timeout_s)
        self._wake = functools.partial(store_client, host, port, secret, min(timeout_s, WAKE_TIMEOUT_S))
        self._ringer = self._connect()
        self._lock = threading.Lock()  # a store call and the check of its answer, as one step
        self._seen = 0  # the highest count read
        self._awaited = 1  # the ring the loop waits for (every rank waits for the same one)
        self._broken: BaseException | None = None
        self._listener = RingListener(self._connect(), self.count())
        # Once this doorbell is dropped, the listener is woken by a last ring and ends, so no store wait
        # is left open when the group closes its store.
        weakref.finalize(self, self._listener.close, self._wake, self._address)

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
            self._ringer.set(f"{KEY}/{self._add(1)}", b"")
        except Exception as exc:  # noqa: BLE001 - the store is gone or holds another's value: the group fails
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            first, self._broken = self._broken is None, self._broken or exc
        if not first:
            return
        if not store_listens(self._address):  # rank 0 is gone: nothing to wake through, the loops' exchange fails
            log.error("the group's store is gone (%r); the group loops fail at their next exchange", exc)
            return
        log.error("the group's doorbell failed (%r); waking the group loops to fail the group", exc)
        try:
            self._wake().set(f"{KEY}/{self._awaited}", b"")
        except Exception as wake_error:  # noqa: BLE001 - then the heartbeat finds it
            log.warning("cannot wake the group loops (%r); the next heartbeat fails the group", wake_error)

    def wait(self, number: int, timeout_s: float) -> bool:
        self._awaited = number
        return self._listener.wait(number, timeout_s)


class RingListener:
    """A thread that follows the rings one by one on its own store connection."""

    NO_TIMEOUT = datetime.timedelta(days=365)

    def __init__(self, store: dist.Store, seen: int) -> None:
        self._store = store
        self._seen = seen
        self._closing = False
        self._ended = False  # its store wait failed: the store is gone
        self._changed = threading.Condition()
        threading.Thread(target=self._follow, name="doorbell", daemon=True).start()

    def _follow(self) -> None:
        while True:
            try:
                self._store.wait([f"{KEY}/{self._seen + 1}"], self.NO_TIMEOUT)
            except RuntimeError:  # the store is gone (its host, rank 0, died): wake the loop, whose exchange fails
                with self._changed:
                    self._ended = True
                    self._changed.notify_all()
                return
            with self._changed:
                if self._closing:
                    return
                self._seen += 1
                self._changed.notify_all()

    def wait(self, number: int, timeout_s: float) -> bool:
        """True once ring `number` happened, or at once when the store is gone (the caller's exchange then fails
        now, not at its next heartbeat)."""
        with self._changed:
            return self._changed.wait_for(lambda: self._seen >= number or self._ended, timeout_s)

    def close(self, connect: Callable[[], dist.Store], address: tuple[str, int]) -> None:
        """Wake the thread with the key it waits for (not a ring: the count may hold another's value)."""
        with self._changed:
            self._closing = True
            awaited = f"{KEY}/{self._seen + 1}"
        if self._ended or not store_listens(address):  # the store is gone: the thread's wait ends with it
            return
        with contextlib.suppress(Exception):  # the store may be gone already: then the thread's wait ends
            connect().set(awaited, b"")
