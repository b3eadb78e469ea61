"""Waiting for something another process does (a launcher stopping, a balancer's rotation), polled with a bound."""
from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(condition: Callable[[], object], timeout_s: float, what: str, every_s: float = 0.05) -> float:
    """Seconds until `condition()` holds, polled every `every_s`; TimeoutError naming `what` after `timeout_s`."""
    began = time.monotonic()
    while not condition():
        if time.monotonic() - began > timeout_s:
            raise TimeoutError(f"waited {timeout_s:g} s for {what}: it did not happen")
        time.sleep(every_s)
    return time.monotonic() - began
