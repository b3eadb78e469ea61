"""A played world's stall clock: when a stream that says nothing is given up (client/world.py)."""
from __future__ import annotations

from collections import deque


class Stalled(Exception):
    """No block within the stall bound: the stream is given up."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"no block for {seconds:.1f} s")
        self.seconds = seconds


class StallClock:
    """The stall bound of a world's sessions: `blocks` times the longest of the last `samples` block times (a block's
    arrival less the later of the previous response's and its request's send), at least `floor_s`, counted from the
    later of the session's last response (a block, a place in the queue, a save's outcome) and the send of the oldest
    request not answered; a session's first block adds the longest time a first block took. The block times are
    the server's pace and outlive a session; what a session heard is its own (`restart`)."""

    def __init__(self, floor_s: float, blocks: int, samples: int) -> None:
        self.floor_s, self.blocks = floor_s, blocks
        self._block_s: deque[float] = deque(maxlen=samples)
        self._first_block_s = 0.0
        self._first_pending = True  # this session's first block has not come
        self._last_heard_s: float | None = None  # any response of this session
        self._last_paced_s: float | None = None  # its last block or place in the queue (a block's time runs from there)

    def restart(self) -> None:
        """A new session: its first block is still to come and nothing was heard from it yet."""
        self._first_pending, self._last_heard_s, self._last_paced_s = True, None, None

    @property
    def first_pending(self) -> bool:
        """The session's first block has not come."""
        return self._first_pending

    def heard(self, arrival_s: float, paced: bool) -> None:
        """A response that answers no request: a place in the queue (paced: a block's time runs from it) or a save's
        outcome. Either is a sign of life."""
        self._last_heard_s = max(self._last_heard_s or 0.0, arrival_s)
        if paced:
            self._last_paced_s = max(self._last_paced_s or 0.0, arrival_s)

    def block(self, arrival_s: float, sent_s: float | None) -> bool:
        """A block that arrived at arrival_s for the request sent at sent_s: its time is sampled. True for the
        session's first block."""
        took = arrival_s - max(sent_s or 0.0, self._last_paced_s or 0.0)
        first = self._first_pending
        if first:
            self._first_block_s = max(self._first_block_s, took)
        else:
            self._block_s.append(took)
        self._first_pending = False
        self._last_heard_s = self._last_paced_s = arrival_s
        return first

    def bound_s(self) -> float:
        bound = max(self.floor_s, self.blocks * max(self._block_s))
        return bound + self._first_block_s if self._first_pending else bound

    def stall_at(self, waiting_since: float | None) -> float | None:
        """When the block waited for (its request sent at waiting_since) is late enough to give the stream up (None:
        no block time measured yet, or no request waits)."""
        if not self._block_s or waiting_since is None:
            return None
        return max(waiting_since, self._last_heard_s or 0.0) + self.bound_s()
