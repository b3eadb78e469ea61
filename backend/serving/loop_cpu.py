"""The control plane's CPU: what the group loop's thread spends outside run_block (collect, exchange, plan,
open and close sessions, hand blocks to the decode sender). Blocked waits cost nothing."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

# (CPU seconds of the loop thread outside run_block since the previous block, session blocks the block computed)
Report = Callable[[float, int], None]


class LoopCpu:
    def __init__(self, report: Report | None = None) -> None:
        self.report = report
        self._mark = 0.0  # the loop thread's CPU clock when it last left run_block

    def start(self) -> None:
        """Call on the loop thread before its first iteration (thread CPU clocks are per thread)."""
        self._mark = time.thread_time()

    @contextlib.contextmanager
    def run_block(self, blocks: int) -> Iterator[None]:
        """Around run_block: excludes the block's own CPU, then reports what the loop spent since the last one
        (the report's own cost counts toward the next)."""
        start = time.thread_time()
        yield
        control_s = start - self._mark
        self._mark = time.thread_time()
        if self.report is not None:
            self.report(control_s, blocks)
