"""How ranks agree at a block boundary: one small all-gather when nothing changed, a second with the news.

Every rank sends a fixed-size header (its news' size, the doorbell count it read before collecting, its clock); only
when some rank has news does a second all-gather carry the pickled events. Every rank then plans the same
`Plan` from the same events with its own copy of the scheduler (pure logic), so no broadcast is needed.
Idle ranks block on the doorbell, and wake at least every `heartbeat_s` to exchange: a dead or hung peer
fails that exchange. A rank with a decision of its own due (its intake's, on a steered session's limit) rings.
"""
from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

from ..parallel.doorbell import Doorbell
from .scheduler import RankEvents


class ControlPlane:
    def __init__(self, ranks: int, group: dist.ProcessGroup | None, doorbell: Doorbell, heartbeat_s: float) -> None:
        self.ranks = ranks
        self.group = group
        self.doorbell = doorbell
        self.heartbeat_s = heartbeat_s
        self._next_ring = 1  # the ring that ends the next idle wait, agreed by every rank

    def exchange(self, events: RankEvents, rings_seen: int) -> list[RankEvents]:
        """Every rank's events, in rank order; `rings_seen` is the doorbell count read before collecting."""
        if self.ranks == 1:
            self._next_ring = rings_seen + 1
            return [events]
        payload = pickle.dumps(events) if events else b""
        headers = [torch.zeros(3, dtype=torch.int64) for _ in range(self.ranks)]
        clock_us = round(events.clock_s * 1e6)
        dist.all_gather(headers, torch.tensor([len(payload), rings_seen, clock_us]), group=self.group)
        sizes = [int(h[0]) for h in headers]
        # The lowest count any rank read: a ring after it may carry news some rank has not collected yet.
        self._next_ring = min(int(h[1]) for h in headers) + 1
        if not any(sizes):  # no news: every rank's clock still travels (the scheduler's one clock)
            return [RankEvents(clock_s=int(h[2]) / 1e6) for h in headers]
        buffers = [torch.empty(max(sizes), dtype=torch.uint8) for _ in range(self.ranks)]
        mine = torch.zeros(max(sizes), dtype=torch.uint8)
        if payload:
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        dist.all_gather(buffers, mine, group=self.group)
        return [pickle.loads(b[:n].numpy().tobytes()) if n else RankEvents() for b, n in zip(buffers, sizes)]

    def wait_idle(self) -> None:
        """Block until some rank rings (news) or the heartbeat is due; every rank then exchanges once."""
        self.doorbell.wait(self._next_ring, self.heartbeat_s)
