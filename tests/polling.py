"""Polled waits with deadlines (tests never sleep a fixed time hoping something happened)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


def _polls(condition: Callable[[], T], timeout: float, what: str) -> Iterator[None]:
    """Yields while `condition()` is falsy, returns its value once it is not; fails naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        yield
    return value


def wait_until(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll until `condition()` is truthy and return it; fail naming `what` after `timeout` seconds."""
    polls = _polls(condition, timeout, what)
    try:
        while True:
            next(polls)
            time.sleep(interval)
    except StopIteration as done:
        return done.value


async def until(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.02) -> T:
    """wait_until on an event loop: poll without blocking it."""
    polls = _polls(condition, timeout, what)
    try:
        while True:
            next(polls)
            await asyncio.sleep(interval)
    except StopIteration as done:
        return done.value
