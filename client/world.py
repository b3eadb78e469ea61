"""A played world that survives its group: a steered session that keeps its last durable snapshot and the steps
sent since (what a recording holds), and when its stream fails resumes from that snapshot through the same address,
makes the blocks since it again (each checked bit for bit against the one received, none shown twice), sends again
the steps not answered, then goes on live (docs/worlds.md, "A world that survives its group").

A failure is one of:
- an answer that ends the stream: GROUP_FAILED, MOVED (the group drains: its snapshot is where the world stood),
  SERVER_STOPPING, SESSION_UNKNOWN, ... (every refusal but those in GIVE_UP), or a failed gRPC stream;
- no block within the stall bound: STALL_BLOCKS times the longest of the session's last BLOCK_SAMPLES block times
  (a block's arrival less the later of the previous response's and its request's send), at least STALL_FLOOR_S,
  counted from the later of the session's last response (a block, a place in the queue, a save's outcome) and the send
  of the oldest request not answered; a session's first block adds the longest measured time to a first block.
  Until a block time is measured only the caller's timeout bounds a wait, and its passing is the caller's error;
  so is a refusal before the world's first block (a start refused: the queue is full, say), while a failed stream then
  starts the world again.

The resume goes to the same address (a fleet's balancer takes it to a group with room; a lone group's healer
brings it back), again and again while the server cannot take it (not ready, reloading, full), waiting
RETRY_FIRST_S, doubling to RETRY_MOST_S, for at most `resume_within_s`; a refusal in GIVE_UP ends the world
(WorldLostError). Before any save is durable the world's base is its first request: it starts again from there.

PlayedWorld composes one part for each of these jobs: the save schedule (client/world_saves.py), the stall clock
(world_stall.py), the replay check (world_replay.py), and the base and the resumes (world_failover.py). The constants
below set them when a world is made.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

from backend.api import contract
from backend.api.codec import BlockResponse, Place, SnapshotNotice
from backend.api.request import Controls, SessionRequest, check_snapshot_id
from client.connection import Connection
from client.steer import SteeredSession, refuses_save
from client.stream import StreamError, StreamTimeoutError
from client.world_failover import Base, Failover, Played, Resumer, WorldLostError
from client.world_replay import ReplayCheck, latents_sha256, used
from client.world_saves import Saved, SaveSchedule, Step
from client.world_stall import Stalled, StallClock

# The interval the players save at unless told: every 4 blocks. At the mid preset on CPU a save pauses the group for
# at most 0.63 % of a block and its background write takes 0.02 of one (bench/README section 18): every 4 blocks
# that is under 1 % of the group's time (2.6 % / 4), while a failover makes at most 4 blocks again (3 since the last
# save and the one the lookahead had asked for), 3 s of video.
DEFAULT_SAVE_EVERY = 4
# A block with a prompt event's recache takes about 2.1 blocks' time (bench/README section 12: a full window's
# recache costs 1.1 blocks), and a session that joins the group's batch lengthens every block: 4 covers both.
STALL_BLOCKS = 4
# A loaded CPU host runs blocks 2 to 7 times slower than alone (bench/README section 18), in bursts: a tiny model's
# 0.1-0.3 s blocks must not read as a failure when the host stalls them for a second.
STALL_FLOOR_S = 2.0
BLOCK_SAMPLES = 8  # block times the stall bound looks back on: the last few, as the group's load changes
# A failed group heals in 5-20 s (the healer's reload: bench/README section 13; serving/messages.HEAL_S): a resume
# keeps trying for three of those.
RESUME_WITHIN_S = 60.0
# A dead group leaves a fleet's rotation within one check (1 s by default; HAProxy sends a refused connection to
# another group at once): the first retry comes soon, later ones no more often than that check.
RETRY_FIRST_S, RETRY_MOST_S = 0.25, 1.0
# Refusals a resume cannot help: the request, the key or the snapshot is wrong, or the session may not go on.
GIVE_UP = frozenset({contract.INVALID_INPUT, contract.SETTINGS_MISMATCH, contract.SESSION_EXISTS, contract.EXPIRED,
                     contract.CANCELLED, contract.RELOAD_REFUSED, contract.AUTH_REQUIRED, contract.AUTH_INVALID,
                     contract.USER_SESSION_LIMIT, contract.QUOTA_EXHAUSTED, contract.SNAPSHOT_UNKNOWN,
                     contract.SNAPSHOT_EXPIRED, contract.SNAPSHOT_INVALID})


class _Heard:
    """Responses that answer no request (a place in the queue, a save's outcome), handed over from tritonclient's thread
    to the caller's through a queue; what an older session tells is dropped."""

    def __init__(self, on_place: Callable[[Place], None] | None) -> None:
        self.on_place = on_place
        self._queue: queue.SimpleQueue[tuple[int, float, SnapshotNotice | None]] = queue.SimpleQueue()
        self._generation = 0  # of the session: what an older one tells is dropped

    def listen(self) -> dict[str, Callable]:
        """A new session's on_place and on_snapshot (from now on what the older ones tell is dropped)."""
        self._generation += 1
        generation = self._generation
        return {"on_place": lambda place: self._put(generation, None, place),
                "on_snapshot": lambda notice: self._put(generation, notice)}

    def _put(self, generation: int, notice: SnapshotNotice | None, place: Place | None = None) -> None:
        """tritonclient's thread."""
        self._queue.put((generation, time.perf_counter(), notice))
        if place is not None and self.on_place is not None:
            self.on_place(place)

    def take(self) -> Iterator[tuple[float, SnapshotNotice | None]]:
        """The current session's responses since the last take, in order: (arrival, a save's outcome or None for a
        place in the queue)."""
        while True:
            try:
                generation, arrival, notice = self._queue.get_nowait()
            except queue.Empty:
                return
            if generation == self._generation:
                yield arrival, notice


class PlayedWorld:
    """A steered session that outlives its group. As SteeredSession: `start` (or `resume`), `step`s ahead, then
    `next_block` for each (it fails over inside, so it returns only blocks not returned before, in order); `save`
    asks for a snapshot on the next step; `finish` ends the world and waits for its last saves. Not thread-safe but
    for `close`, which any thread may call.

    It keeps the steps sent and not answered, the end and the session; its parts decide the rest: the saves
    (SaveSchedule), when a stream is given up (StallClock), the check of the blocks made again (ReplayCheck), what a
    resume starts from (Base) and the resumes (Resumer)."""

    def __init__(self, url: str, *, model_name: str = contract.MODEL_NAME, connection: Connection = Connection(),
                 save_every: int = DEFAULT_SAVE_EVERY, resume_within_s: float = RESUME_WITHIN_S,
                 on_place: Callable[[Place], None] | None = None, on_snapshot: Callable[[Saved], None] | None = None,
                 on_failover: Callable[[Failover], None] | None = None, strict: bool = False,
                 session_factory: Callable[..., SteeredSession] = SteeredSession) -> None:
        """save_every: a snapshot every this many blocks (0: only those asked for with `save`); strict: a block
        made again that differs from the one received loses the world (WorldLostError), else it is counted in the
        failover's `differed` and the world goes on from it. A group makes the same bits only for a session in a
        forward of its own (max_batch=1) or batched as it was (docs/fidelity.md): a world that ran beside others
        may come back within float rounding. on_place: called on tritonclient's thread; on_snapshot and
        on_failover: on the caller's, from next_block and finish."""
        if save_every < 0:
            raise ValueError(f"save_every must be 0 or more, got {save_every}")
        self.url, self.model_name, self.connection = url, model_name, connection
        self._factory = session_factory
        self._closed = threading.Event()
        self._heard = _Heard(on_place)
        self._saves = SaveSchedule(save_every, on_snapshot)
        self._clock = StallClock(STALL_FLOOR_S, STALL_BLOCKS, BLOCK_SAMPLES)
        self._replay = ReplayCheck(strict)
        self._resumer = Resumer(resume_within_s, RETRY_FIRST_S, RETRY_MOST_S, on_failover)
        self.failovers: list[Failover] = self._resumer.failovers  # each one through, in order (the resumer's)
        self.step_latency_s: float | None = None  # the last block's: its arrival less its request's send
        self.last_index = -1  # the last block returned
        self._session: SteeredSession | None = None
        self._base = Base()  # start's or resume's
        self._queued: deque[Step] = deque()  # steps sent, no block yet, in the server's order
        self._ending = False  # the caller asked for the end
        self._end_sent = False  # the end flag went out, on a step or alone
        self._end_alone = False  # ... as a request of its own (its answer comes once every save's outcome was told)

    # The caller's side.

    def start(self, request: SessionRequest) -> None:
        """A new world (its request's return_used is set: each block's hash is what a replay checks)."""
        base = Base(dataclasses.replace(request, return_used=True, save=False), return_latents=request.return_latents)
        self._begin(base, Controls(poses=request.poses, keys=request.keys))

    def resume(self, snapshot_id: str, controls: Controls, fork_seed: int | None = None,
               return_latents: bool = True) -> None:
        """A saved world, from its next block on `controls` (fork_seed: new noise from there on)."""
        self._begin(Base(snapshot_id=check_snapshot_id(snapshot_id), fork_seed=fork_seed,
                         return_latents=return_latents), controls)

    def _begin(self, base: Base, controls: Controls) -> None:
        if self._session is not None:
            raise ValueError("this world has started already")
        self._base = base
        self._saves.based(base.block)
        self._queued.append(Step(controls))
        self._open()

    def save(self) -> None:
        """Save the world after the block of the next step (or the one after, while another save is under way)."""
        self._saves.ask()

    def step(self, controls: Controls, end: bool = False) -> None:
        """The next block's camera; `end`: the world ends after its block."""
        if self._session is None or self._ending:
            raise ValueError("step a world after start or resume, and before its end")
        block = self.last_index + len(self._queued) + 1  # the step's block, unless a held block comes first
        save = self._saves.due(block)
        step = Step(controls)
        self._queued.append(step)
        if save:
            controls = dataclasses.replace(controls, release=self._saves.send(step, block))
        # The end rides on the step unless a save is under way: its outcome needs a request open after its block.
        ride = end and not self._saves.under_way
        self._ending, self._end_sent = end, ride
        try:
            self._session.step(controls, end=ride, save=save)
            self._send_owed_end()
        except StreamError:  # the stream is gone: next_block fails over and sends the step again
            pass

    def next_block(self, timeout: float | None = None) -> BlockResponse | None:
        """The next block not returned before; None once the world has ended. StreamTimeoutError when the caller's
        timeout passes before a block time is measured; WorldLostError when a failover cannot help."""
        self._saves.tell()
        deadline = None if timeout is None else time.perf_counter() + timeout
        while True:
            block = self._answer(deadline)
            if block is None:
                return None
            if not self._replay.pending:
                self._deliver(block)
                return block
            if (differs := self._replay.check(block)) is not None:  # not strict: the world goes on from this one
                self._base.differed(block.block_index, differs)
                self._resumer.differed()
            if not self._replay.pending and not self._queued:  # nothing new asked for: through at the last one
                self._resumer.through(block.arrival_s)

    def end(self) -> None:
        """End the world after the blocks of the steps sent: next_block returns them, then None (once every save's
        outcome was told)."""
        self._ending = True
        self._send_owed_end()

    def finish(self, timeout: float | None = None) -> None:
        """End the world after the blocks returned (call it after the last one) and wait until the server has told
        the outcome of every save asked for."""
        if self._queued:
            raise ValueError(f"{len(self._queued)} block(s) asked for were not read: read them first")
        self.end()
        if self._end_alone:  # its answer comes once the saves' outcomes were told
            while self.next_block(timeout) is not None:
                pass
        self._settle_heard()
        self._saves.tell()

    def close(self) -> None:
        """Cancel the stream (any thread): a next_block waiting then raises, with no failover."""
        self._closed.set()
        if (session := self._session) is not None:
            session.close()

    def __enter__(self) -> PlayedWorld:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # The session.

    def _send_owed_end(self) -> None:
        """The end asked for and not sent (a save was under way): sent on its own once no save waits for its block
        (a refused one is sent again first)."""
        if self._ending and not self._end_sent and not self._saves.waits_for_block:
            self._end_sent = self._end_alone = True
            self._session.end()

    def _open(self) -> None:
        """A new session from the base: its first request, then every step since (made again or never answered)."""
        played = self._base.played
        controls = [p.controls for p in played] + [s.controls for s in self._queued]
        session = self._factory(self.url, model_name=self.model_name, connection=self.connection,
                                **self._heard.listen())
        self._session = session
        if self._closed.is_set():
            session.close()
            raise StreamError("the world was closed")
        self._replay.expect(p.latents_sha256 for p in played)
        self._clock.restart()
        self._base.open(session, controls[0])
        for step in controls[1:]:
            session.step(step)
        if self._ending:  # no save is under way after a failover: the end goes at once
            self._end_sent = self._end_alone = True
            session.end()

    def _settle_heard(self) -> None:
        """Take in what the session told that answers no request: signs of life, and saves' outcomes."""
        for arrival, notice in self._heard.take():
            self._clock.heard(arrival, paced=notice is None)
            if notice is not None and (saved := self._saves.told(notice)) is not None:
                self._base.saved(saved)
                self._send_owed_end()

    def _answer(self, deadline: float | None) -> BlockResponse | None:
        """The session's next answer, failing over (and resending a refused save's step) until one is a block or
        the end."""
        while True:
            try:
                return self._receive(deadline)
            except Stalled as stall:
                if not self._recover(f"no block for {stall.seconds:.1f} s (the stall bound)", None):
                    return None
            except StreamError as exc:
                if self._closed.is_set() or isinstance(exc, (WorldLostError, StreamTimeoutError)):
                    raise
                code = exc.code
                if refuses_save(exc) and self._saves.waits_for_block:
                    self._refused(exc)
                elif code is not None and self.last_index < 0 and not self._resumer.under_way:
                    raise  # the world's start refused (the queue is full, say): the caller's to handle
                elif code in GIVE_UP:
                    if not self._resumer.under_way:
                        raise
                    raise WorldLostError(f"the world cannot be resumed: {exc.sentence}", exc.sentence) from exc
                elif not self._recover(exc.sentence, exc.refusal.snapshot_id if code == contract.MOVED else None):
                    return None

    def _receive(self, deadline: float | None) -> BlockResponse | None:
        """The session's next answer within the caller's deadline and the stall bound (then Stalled)."""
        while True:
            self._settle_heard()
            stall_at = self._clock.stall_at(self._session.waiting_since())
            until = min((t for t in (stall_at, deadline) if t is not None), default=None)
            try:
                block = self._session.next_block(None if until is None else max(0.0, until - time.perf_counter()))
            except StreamTimeoutError:
                now = time.perf_counter()
                if deadline is not None and now >= deadline:
                    raise StreamTimeoutError(f"no block from {self.model_name!r} within the timeout") from None
                self._settle_heard()
                if (stall_at := self._clock.stall_at(self._session.waiting_since())) is not None and now >= stall_at:
                    raise Stalled(now - (stall_at - self._clock.bound_s())) from None
                continue
            self._settle_heard()
            if block is not None and self._clock.block(block.arrival_s, self._session.answered_sent_s):
                if self._base.first_block(block.block_index):  # the caller's snapshot: now it says which block
                    self._saves.based(self._base.block)
            return block

    def _deliver(self, block: BlockResponse) -> None:
        """A new block: it answers the oldest step (a held block none) and joins the blocks since the base."""
        step = None
        if block.held:
            controls = Controls(poses=used(block).camera)
        elif not self._queued:
            raise StreamError(f"block {block.block_index} came for no step sent")
        else:
            step = self._queued.popleft()
            controls = step.controls
        self._base.add(Played(block.block_index, controls, latents_sha256(block)))
        self.last_index = block.block_index
        self.step_latency_s = block.arrival_s - (self._session.answered_sent_s or block.arrival_s)
        if step is not None and (saved := self._saves.came(step, block.block_index)) is not None:
            self._base.saved(saved)
        self._send_owed_end()
        self._resumer.through(block.arrival_s)

    def _refused(self, refusal: StreamError) -> None:
        """The save's step was refused at once, its block not run: sent again without it, behind the steps sent
        since."""
        refused = self._saves.refused(refusal)
        self._queued.remove(refused)
        again = Step(refused.controls)
        self._queued.append(again)
        self._session.step(again.controls)
        self._send_owed_end()

    # Failovers.

    def _recover(self, reason: str, moved_to: str | None) -> bool:
        """Give the stream up and open the world again: a new failover, or another try of the one under way.
        False: the world had ended, every block asked for returned (a save under way is lost with the stream)."""
        self._settle_heard()
        self._session.close()
        if self._ending and not self._queued:
            return False
        if self._resumer.under_way and self._clock.first_pending:  # the resume did not take: try again
            self._resumer.again(reason, self._closed)
        else:
            if moved_to is not None and self.last_index >= 0:  # the group saved it where it stood: after its last block
                self._base.moved(moved_to, self.last_index)
            self._saves.lost(self._base.block)  # its outcome was not told: not a base; the next step saves instead
            self._resumer.lost(reason, self._base, len(self._queued))
        try:
            self._open()
        except StreamError:  # the send failed at once: the next answer says why, and the next try comes
            if self._closed.is_set():
                raise
        return True
