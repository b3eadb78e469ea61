"""A played world's failover: the base a resume starts from, and the resumes tried until one takes (client/world.py,
docs/worlds.md "A world that survives its group")."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from backend.api.request import Controls, SessionRequest
from client.steer import SteeredSession
from client.stream import StreamError
from client.world_saves import Saved

log = logging.getLogger("client.world")  # the played world's log, whichever part tells it


class WorldLostError(StreamError):
    """The world cannot go on: no resume took within the bound, the server refused its snapshot, or a block made
    again differs from the one received."""


@dataclass(frozen=True)
class Failover:
    """A stream given up and the world resumed: told when the stream is lost (took_s None), and again with the time
    from then to the next new block (or, with nothing new asked for, to the last block made again)."""

    reason: str
    resume_block: int | None  # the first block the resumed world makes (None: the snapshot's next, not known yet)
    snapshot_id: str | None  # None: from the world's first request
    replayed: int  # blocks received since the snapshot, made again and checked, not shown twice
    resent: int  # steps sent and not answered, sent again
    took_s: float | None = None
    attempts: int = 0  # sessions opened to resume it
    differed: int = 0  # blocks made again whose latents are not the received ones' (batched otherwise: not strict)


@dataclass(frozen=True)
class Played:
    """A block returned since the base: what a resume sends again for it and the hash it checks."""

    index: int
    controls: Controls  # what the block ran on: its step's controls, a held block's camera as poses
    latents_sha256: str


class Base:
    """What a resume starts from: the world's first request (`request`), or a snapshot after block `block`; and
    the blocks returned since, which a resume makes again."""

    def __init__(self, request: SessionRequest | None = None, snapshot_id: str | None = None,
                 fork_seed: int | None = None, return_latents: bool = True) -> None:
        self.request = request  # the world's first request, while no save is durable
        self.snapshot_id = snapshot_id
        # The block the snapshot follows (-1: none); None for the caller's, until its next block says which.
        self.block: int | None = -1 if snapshot_id is None else None
        self.fork_seed = fork_seed  # the caller's resume's, while its snapshot is the base
        self.return_latents = return_latents
        self.played: list[Played] = []

    def moved(self, snapshot_id: str, block: int) -> None:
        """A snapshot after `block` is the base now: a save made durable, or the one a draining group made."""
        self.snapshot_id, self.block, self.fork_seed = snapshot_id, block, None
        self.played = [p for p in self.played if p.index > block]

    def saved(self, saved: Saved) -> None:
        """A save settled: once durable, its snapshot is the base."""
        if saved.error is None:
            self.moved(saved.snapshot_id, saved.block_index)

    def add(self, played: Played) -> None:
        self.played.append(played)

    def differed(self, index: int, latents_sha256: str) -> None:
        """Block `index` made again differs from the one received: the world goes on from the one made again."""
        at = next(i for i, p in enumerate(self.played) if p.index == index)
        self.played[at] = dataclasses.replace(self.played[at], latents_sha256=latents_sha256)

    def open(self, session: SteeredSession, controls: Controls) -> None:
        """A session's first request: the world's, or a resume of the snapshot on `controls`."""
        if self.snapshot_id is None:
            session.start(self.request)
        else:
            session.resume(self.snapshot_id, controls, self.fork_seed, return_latents=self.return_latents,
                           return_used=True)

    def first_block(self, index: int) -> bool:
        """A session's first block follows the base: WorldLostError when it does not. True when it tells which
        block the caller's snapshot follows (the base's block from now on)."""
        if self.block is None:
            self.block = index - 1
            return True
        if index != self.block + 1:
            raise WorldLostError(f"the world resumed at block {index}, not at block {self.block + 1} after its "
                                 "snapshot's")
        return False


class Resumer:
    """A world's failovers: the one under way, told to on_failover when its stream is lost and again once it is
    through, its resume tried again while the server cannot take it (not ready, reloading, full), retry_first_s
    after the first try, doubling to retry_most_s, for at most within_s (then WorldLostError); those through are
    kept in `failovers`, in order."""

    def __init__(self, within_s: float, retry_first_s: float, retry_most_s: float,
                 on_failover: Callable[[Failover], None] | None) -> None:
        self.within_s, self.retry_first_s, self.retry_most_s = within_s, retry_first_s, retry_most_s
        self.on_failover = on_failover
        self.failovers: list[Failover] = []  # each one through, in order
        self._current: Failover | None = None  # a failover not through yet
        self._lost_s = 0.0
        self._give_up_s = 0.0
        self._retry_s = retry_first_s

    @property
    def under_way(self) -> bool:
        return self._current is not None

    def lost(self, reason: str, base: Base, resent: int) -> None:
        """The stream was given up: a new failover, resuming from `base` with `resent` steps not answered."""
        self._lost_s = time.perf_counter()
        self._give_up_s = self._lost_s + self.within_s
        self._retry_s = self.retry_first_s
        resume_block = None if base.block is None else base.block + 1
        lost = Failover(reason, resume_block, base.snapshot_id, len(base.played), resent)
        log.warning("the stream was lost (%s): resuming at block %s from %s", reason, resume_block,
                    base.snapshot_id or "the world's first request")
        if self.on_failover is not None:
            self.on_failover(lost)
        self._current = dataclasses.replace(lost, attempts=1)

    def again(self, reason: str, closed: threading.Event) -> None:
        """The resume did not take: wait for the next try (WorldLostError past the bound, StreamError once the
        world is closed)."""
        log.info("the resume did not take (try %d): %s", self._current.attempts, reason)
        now = time.perf_counter()
        if now >= self._give_up_s:
            raise WorldLostError(f"the world could not be resumed within {self.within_s:g} s: {reason}")
        if closed.wait(min(self._retry_s, self._give_up_s - now)):
            raise StreamError("the world was closed")
        self._retry_s = min(2 * self._retry_s, self.retry_most_s)
        self._current = dataclasses.replace(self._current, attempts=self._current.attempts + 1)

    def differed(self) -> None:
        """A block made again differs from the one received (the world goes on: not strict)."""
        self._current = dataclasses.replace(self._current, differed=self._current.differed + 1)

    def through(self, arrival_s: float) -> None:
        """The failover is through: at its first new block, arrived at arrival_s (or its last block made again)."""
        if self._current is None:
            return
        done = dataclasses.replace(self._current, took_s=arrival_s - self._lost_s)
        self._current = None
        log.warning("resumed at block %s in %.2f s (%d sessions opened, %d blocks made again)", done.resume_block,
                    done.took_s, done.attempts, done.replayed)
        self.failovers.append(done)
        if self.on_failover is not None:
            self.on_failover(done)
