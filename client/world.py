"""A played world that survives its group: a steered session that keeps its last durable snapshot and the steps
sent since (what a recording holds), and when its stream fails resumes from that snapshot through the same address,
makes the blocks since it again (each checked bit for bit against the one received, none shown twice), sends again
the steps not answered, then goes on live (docs/worlds.md, "A world that survives its group").

A failure is one of:
- an answer that ends the stream: GROUP_FAILED, MOVED (the group drains: its snapshot is where the world stood),
  SERVER_STOPPING, SESSION_UNKNOWN, ... (every refusal but those in GIVE_UP), or a failed gRPC stream;
- no block within the stall bound: STALL_BLOCKS times the longest of the session's last BLOCK_SAMPLES block times
  (a block's arrival less the later of the previous response's and its request's send), at least STALL_FLOOR_S,
  counted from the later of the session's last response (a block, a place in line, a save's outcome) and the send
  of the oldest request not answered; a session's first block adds the longest measured time to a first block.
  Until a block time is measured only the caller's timeout bounds a wait, and its passing is the caller's error;
  so is a refusal before the world's first block (a start refused: the line is full, say), while a failed stream then
  starts the world again.

The resume goes to the same address (a fleet's balancer takes it to a group with room; a lone group's healer
brings it back), again and again while the server cannot take it (not ready, reloading, full), waiting
RETRY_FIRST_S, doubling to RETRY_MOST_S, for at most `resume_within_s`; a refusal in GIVE_UP ends the world
(WorldLostError). Before any save is durable the world's base is its first request: it starts again from there.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from backend.api import contract
from backend.api.codec import BlockResponse, BlockUsed, Place, SnapshotNotice
from backend.api.request import Controls, SessionRequest, check_snapshot_id
from client.connection import Connection
from client.steer import SteeredSession, refuses_save
from client.stream import StreamError, StreamTimeoutError

log = logging.getLogger(__name__)

# The interval the players save at unless told: every 4 blocks. At the mid preset on CPU a save pauses the group for
# at most 0.63 % of a block and its background write takes 0.02 of one (bench/README section 18): every 4 blocks
# that is under 1 % of the group's time (2.6 % / 4), while a failover makes at most 4 blocks again (3 since the last
# save and the one the lookahead had asked for), 3 s of video.
DEFAULT_SAVE_EVERY = 4
# A block with a world event's recache takes about 2.1 blocks' time (bench/README section 12: a full window's
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


class WorldLostError(StreamError):
    """The world cannot go on: no resume took within the bound, the server refused its snapshot, or a block made
    again differs from the one received."""


@dataclass(frozen=True)
class Saved:
    """A save's outcome: durable (error None: `snapshot_id` resumes the world after `block_index`), or why not."""

    snapshot_id: str | None  # None: refused at once (the store is full), nothing written
    block_index: int | None  # the block the snapshot follows (None: refused before its block ran)
    asked: bool  # asked for with save(), not a periodic save
    error: str | None = None
    released: str = ""  # durable: the older periodic snapshot it released, deleted from the store ("": none)


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


@dataclass(eq=False)
class _Step:
    controls: Controls  # as the caller sent it (no save flag)


@dataclass(frozen=True)
class _Played:
    index: int
    controls: Controls  # what the block ran on: its step's controls, a held block's camera as poses
    latents_sha256: str


@dataclass
class _Saving:
    step: _Step | None  # the step it rides on, until its block came (or its refusal)
    asked: bool
    release: str = ""  # the older periodic snapshot it asks the server to delete once it is durable
    block_index: int | None = None
    snapshot_id: str | None = None
    error: str | None = None


class PlayedWorld:
    """A steered session that outlives its group. As SteeredSession: `start` (or `resume`), `step`s ahead, then
    `next_block` for each (it fails over inside, so it returns only blocks not returned before, in order); `save`
    asks for a snapshot on the next step; `finish` ends the world and waits for its last saves. Not thread-safe but
    for `close`, which any thread may call."""

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
        self.save_every, self.resume_within_s, self.strict = save_every, resume_within_s, strict
        self.on_place, self.on_snapshot, self.on_failover = on_place, on_snapshot, on_failover
        self._factory = session_factory
        self.failovers: list[Failover] = []  # each one through, in order
        self.step_latency_s: float | None = None  # the last block's: its arrival less its request's send
        self.last_index = -1  # the last block returned
        self._closed = threading.Event()
        self._heard: queue.SimpleQueue[tuple[int, float, SnapshotNotice | None]] = queue.SimpleQueue()
        self._session: SteeredSession | None = None
        self._generation = 0  # of the session: what an older one tells is dropped
        # The base a resume starts from: the world's first request, or a snapshot after block _base_block.
        self._request: SessionRequest | None = None
        self._return_latents = True
        self._base_id: str | None = None
        # This world's periodic snapshots known durable, oldest first: each periodic save releases the one before the
        # base (so the server frees it once the new save is durable, while the base a failover may still need stays).
        self._periodic: list[str] = []
        self._base_block: int | None = -1  # None: the caller's snapshot, until its next block says which it follows
        self._fork_seed: int | None = None  # the caller's resume's, while its snapshot is the base
        self._played: list[_Played] = []  # blocks returned since the base
        self._queued: deque[_Step] = deque()  # steps sent, no block yet, in the server's order
        self._expect: deque[str] = deque()  # after a resume: the hashes of the blocks made again
        self._saving: _Saving | None = None  # at most one save at a time
        self._save_asked = False
        self._untold: list[Saved] = []  # outcomes for on_snapshot, told once the caller has the block they follow
        self._last_save_block = -1  # the block the latest save follows (or the base)
        self._ending = False  # the caller asked for the end
        self._end_sent = False  # the end flag went out, on a step or alone
        self._end_alone = False  # ... as a request of its own (its answer comes once every save's outcome was told)
        # The stall clock (this session's) and what it learned of the server's pace (every session's).
        self._block_s: deque[float] = deque(maxlen=BLOCK_SAMPLES)
        self._first_block_s = 0.0
        self._first_pending = True  # this session's first block has not come
        self._last_heard_s: float | None = None  # any response of this session
        self._last_paced_s: float | None = None  # its last block or place in line (a block's time runs from there)
        self._failover: Failover | None = None  # a failover not through yet
        self._lost_s = 0.0
        self._give_up_s = 0.0
        self._retry_s = RETRY_FIRST_S

    # The caller's side.

    def start(self, request: SessionRequest) -> None:
        """A new world (its request's return_used is set: each block's hash is what a replay checks)."""
        self._begin()
        self._request = dataclasses.replace(request, return_used=True, save=False)
        self._return_latents = request.return_latents
        self._queued.append(_Step(Controls(poses=request.poses, keys=request.keys)))
        self._open()

    def resume(self, snapshot_id: str, controls: Controls, fork_seed: int | None = None,
               return_latents: bool = True) -> None:
        """A saved world, from its next block on `controls` (fork_seed: new noise from there on)."""
        self._begin()
        self._base_id, self._base_block, self._fork_seed = check_snapshot_id(snapshot_id), None, fork_seed
        self._return_latents = return_latents
        self._queued.append(_Step(controls))
        self._open()

    def _begin(self) -> None:
        if self._session is not None:
            raise ValueError("this world has started already")

    def save(self) -> None:
        """Save the world after the block of the next step (or the one after, while another save is under way)."""
        self._save_asked = True

    def step(self, controls: Controls, end: bool = False) -> None:
        """The next block's camera; `end`: the world ends after its block."""
        if self._session is None or self._ending:
            raise ValueError("step a world after start or resume, and before its end")
        save = self._due_save()
        step = _Step(controls)
        self._queued.append(step)
        if save:
            periodic = not self._save_asked
            release = self._periodic[-2] if periodic and len(self._periodic) >= 2 else ""
            self._saving = _Saving(step, self._save_asked, release)
            self._save_asked = False
            self._last_save_block = self.last_index + len(self._queued)
            controls = dataclasses.replace(controls, release=release)
        # The end rides on the step unless a save is under way: its outcome needs a request open after its block.
        ride = end and self._saving is None
        self._ending, self._end_sent = end, ride
        try:
            self._session.step(controls, end=ride, save=save)
            self._send_owed_end()
        except StreamError:  # the stream is gone: next_block fails over and sends the step again
            pass

    def next_block(self, timeout: float | None = None) -> BlockResponse | None:
        """The next block not returned before; None once the world has ended. StreamTimeoutError when the caller's
        timeout passes before a block time is measured; WorldLostError when a failover cannot help."""
        self._tell_saves()
        deadline = None if timeout is None else time.perf_counter() + timeout
        while True:
            block = self._answer(deadline)
            if block is None:
                return None
            if self._expect:
                self._check(block)
                continue
            self._deliver(block)
            return block

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
        self._tell_saves()

    def close(self) -> None:
        """Cancel the stream (any thread): a next_block waiting then raises, with no failover."""
        self._closed.set()
        if (session := self._session) is not None:
            session.close()

    def __enter__(self) -> PlayedWorld:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # Saves.

    def _due_save(self) -> bool:
        """Whether the step about to be sent carries a save: asked for, or save_every blocks since the last."""
        if self._saving is not None or self._base_block is None:
            return False
        block = self.last_index + len(self._queued) + 1  # the step's block, unless a held block comes first
        return self._save_asked or 0 < self.save_every <= block - self._last_save_block

    def _refused(self, refusal: StreamError) -> None:
        """The save's step was refused at once (the store is full, or the server keeps no snapshots: then no more
        saves are asked for), its block not run: sent again without it, behind the steps sent since."""
        saving, self._saving = self._saving, None
        if refusal.code != contract.SNAPSHOT_STORE_FULL:
            self.save_every = 0
        self._queued.remove(saving.step)
        again = _Step(saving.step.controls)
        self._queued.append(again)
        self._session.step(again.controls)
        self._send_owed_end()
        self._tell(Saved(None, None, saving.asked, refusal.sentence))

    def _told(self, notice: SnapshotNotice) -> None:
        saving = self._saving
        if saving is None or saving.snapshot_id is not None:
            return  # not this session's save (its outcome was told already)
        saving.snapshot_id, saving.error = notice.snapshot_id, notice.error
        self._settle_save()

    def _settle_save(self) -> None:
        """A save whose block came and whose outcome was told: its snapshot is the new base, or it failed."""
        saving = self._saving
        if saving is None or saving.step is not None or saving.snapshot_id is None:
            return
        self._saving = None
        if saving.error is None:
            self._base_id, self._base_block, self._fork_seed = saving.snapshot_id, saving.block_index, None
            self._played = [p for p in self._played if p.index > saving.block_index]
            if not saving.asked:
                self._periodic = [s for s in self._periodic if s != saving.release] + [saving.snapshot_id]
        released = saving.release if saving.error is None else ""
        self._tell(Saved(saving.snapshot_id, saving.block_index, saving.asked, saving.error, released))
        self._send_owed_end()

    def _send_owed_end(self) -> None:
        """The end asked for and not sent (a save was under way): sent on its own once no save waits for its block
        (a refused one is sent again first)."""
        if self._ending and not self._end_sent and not (self._saving is not None and self._saving.step is not None):
            self._end_sent = self._end_alone = True
            self._session.end()

    def _tell(self, saved: Saved) -> None:
        self._untold.append(saved)

    def _tell_saves(self) -> None:
        told, self._untold = self._untold, []
        for saved in told if self.on_snapshot is not None else ():
            self.on_snapshot(saved)

    # Sessions.

    def _open(self) -> None:
        """A new session from the base: its first request, then every step since (made again or never answered)."""
        controls = [p.controls for p in self._played] + [s.controls for s in self._queued]
        self._generation += 1
        generation = self._generation
        session = self._factory(self.url, model_name=self.model_name, connection=self.connection,
                                on_place=lambda place: self._hear(generation, None, place),
                                on_snapshot=lambda notice: self._hear(generation, notice))
        self._session = session
        if self._closed.is_set():
            session.close()
            raise StreamError("the world was closed")
        self._expect = deque(p.latents_sha256 for p in self._played)
        self._first_pending, self._last_heard_s, self._last_paced_s = True, None, None
        if self._base_id is None:
            session.start(self._request)
        else:
            session.resume(self._base_id, controls[0], self._fork_seed, return_latents=self._return_latents,
                           return_used=True)
        for step in controls[1:]:
            session.step(step)
        if self._ending:  # no save is under way after a failover: the end goes at once
            self._end_sent = self._end_alone = True
            session.end()

    def _hear(self, generation: int, notice: SnapshotNotice | None, place: Place | None = None) -> None:
        """tritonclient's thread: a response that answers no request, for the caller's thread to take."""
        self._heard.put((generation, time.perf_counter(), notice))
        if place is not None and self.on_place is not None:
            self.on_place(place)

    def _settle_heard(self) -> None:
        while True:
            try:
                generation, arrival, notice = self._heard.get_nowait()
            except queue.Empty:
                return
            if generation != self._generation:
                continue
            self._last_heard_s = max(self._last_heard_s or 0.0, arrival)
            if notice is None:
                self._last_paced_s = max(self._last_paced_s or 0.0, arrival)
            else:
                self._told(notice)

    # Answers, the stall clock and failovers.

    def _answer(self, deadline: float | None) -> BlockResponse | None:
        """The session's next answer, failing over (and resending a refused save's step) until one is a block or
        the end."""
        while True:
            try:
                return self._receive(deadline)
            except _Stalled as stall:
                if not self._recover(f"no block for {stall.seconds:.1f} s (the stall bound)", None):
                    return None
            except StreamError as exc:
                if self._closed.is_set() or isinstance(exc, (WorldLostError, StreamTimeoutError)):
                    raise
                code = exc.code
                if refuses_save(exc) and self._saving is not None and self._saving.step:
                    self._refused(exc)
                elif code is not None and self.last_index < 0 and self._failover is None:
                    raise  # the world's start refused (the line is full, say): the caller's to handle
                elif code in GIVE_UP:
                    if self._failover is None:
                        raise
                    raise WorldLostError(f"the world cannot be resumed: {exc.sentence}", exc.sentence) from exc
                elif not self._recover(exc.sentence, exc.refusal.snapshot_id if code == contract.MOVED else None):
                    return None

    def _receive(self, deadline: float | None) -> BlockResponse | None:
        while True:
            self._settle_heard()
            stall_at = self._stall_at()
            until = min((t for t in (stall_at, deadline) if t is not None), default=None)
            try:
                block = self._session.next_block(None if until is None else max(0.0, until - time.perf_counter()))
            except StreamTimeoutError:
                now = time.perf_counter()
                if deadline is not None and now >= deadline:
                    raise StreamTimeoutError(f"no block from {self.model_name!r} within the timeout") from None
                self._settle_heard()
                if (stall_at := self._stall_at()) is not None and now >= stall_at:
                    raise _Stalled(now - (stall_at - self._stall_s())) from None
                continue
            self._settle_heard()
            if block is not None:
                self._measure(block)
            return block

    def _stall_s(self) -> float:
        bound = max(STALL_FLOOR_S, STALL_BLOCKS * max(self._block_s))
        return bound + self._first_block_s if self._first_pending else bound

    def _stall_at(self) -> float | None:
        """When the block waited for is late enough to give the stream up (None: no block time measured yet, or
        no request waits)."""
        waiting = self._session.waiting_since()
        if not self._block_s or waiting is None:
            return None
        return max(waiting, self._last_heard_s or 0.0) + self._stall_s()

    def _measure(self, block: BlockResponse) -> None:
        took = block.arrival_s - max(self._session.answered_sent_s or 0.0, self._last_paced_s or 0.0)
        if self._first_pending:
            self._first_block_s = max(self._first_block_s, took)
            self._check_index(block)
        else:
            self._block_s.append(took)
        self._first_pending = False
        self._last_heard_s = self._last_paced_s = block.arrival_s

    def _check_index(self, block: BlockResponse) -> None:
        """A session's first block follows its base: the snapshot's block, or none."""
        if self._base_block is None:  # the caller's snapshot: now it says which block it follows
            self._base_block = self._last_save_block = block.block_index - 1
        elif block.block_index != self._base_block + 1:
            raise WorldLostError(f"the world resumed at block {block.block_index}, not at block "
                                 f"{self._base_block + 1} after its snapshot's")

    def _check(self, block: BlockResponse) -> None:
        """A block made again after a resume: bit for bit the one received before (strict), or counted."""
        want, got = self._expect.popleft(), _latents_sha256(block)
        if got != want:
            if self.strict:
                raise WorldLostError(f"block {block.block_index} made again after the resume differs from the one "
                                     f"received (latents {got[:16]}... against {want[:16]}...)")
            self._failover = dataclasses.replace(self._failover, differed=self._failover.differed + 1)
            index = next(i for i, p in enumerate(self._played) if p.index == block.block_index)
            self._played[index] = dataclasses.replace(self._played[index], latents_sha256=got)
        if not self._expect and not self._queued:
            self._through(block)

    def _deliver(self, block: BlockResponse) -> None:
        if block.held:
            controls = Controls(poses=_used(block).camera)
        elif not self._queued:
            raise StreamError(f"block {block.block_index} came for no step sent")
        else:
            step = self._queued.popleft()
            controls = step.controls
            if self._saving is not None and self._saving.step is step:
                self._saving.step, self._saving.block_index = None, block.block_index
        self._played.append(_Played(block.block_index, controls, _latents_sha256(block)))
        self.last_index = block.block_index
        self.step_latency_s = block.arrival_s - (self._session.answered_sent_s or block.arrival_s)
        self._settle_save()
        self._send_owed_end()
        self._through(block)

    def _through(self, block: BlockResponse) -> None:
        """A failover is through at its first new block (or its last block made again)."""
        if self._failover is None:
            return
        done = dataclasses.replace(self._failover, took_s=block.arrival_s - self._lost_s)
        self._failover = None
        log.warning("resumed at block %s in %.2f s (%d sessions opened, %d blocks made again)", done.resume_block,
                    done.took_s, done.attempts, done.replayed)
        self.failovers.append(done)
        if self.on_failover is not None:
            self.on_failover(done)

    def _recover(self, reason: str, moved_to: str | None) -> bool:
        """Give the stream up and open the world again: a new failover, or another try of the one under way.
        False: the world had ended, every block asked for returned (a save under way is lost with the stream)."""
        self._settle_heard()
        self._session.close()
        if self._ending and not self._queued:
            return False
        if self._failover is not None and self._first_pending:  # the resume did not take: try again
            log.info("the resume did not take (try %d): %s", self._failover.attempts, reason)
            now = time.perf_counter()
            if now >= self._give_up_s:
                raise WorldLostError(f"the world could not be resumed within {self.resume_within_s:g} s: {reason}")
            if self._closed.wait(min(self._retry_s, self._give_up_s - now)):
                raise StreamError("the world was closed")
            self._retry_s = min(2 * self._retry_s, RETRY_MOST_S)
        else:
            self._lost(reason, moved_to)
        self._failover = dataclasses.replace(self._failover, attempts=self._failover.attempts + 1)
        try:
            self._open()
        except StreamError:  # the send failed at once: the next answer says why, and the next try comes
            if self._closed.is_set():
                raise
        return True

    def _lost(self, reason: str, moved_to: str | None) -> None:
        if moved_to is not None and self.last_index >= 0:  # the group saved it where it stood: after its last block
            self._base_id, self._base_block, self._fork_seed = moved_to, self.last_index, None
            self._played = []
        if (saving := self._saving) is not None:  # its outcome was not told: not a base; the next step saves instead
            self._saving, self._save_asked = None, self._save_asked or saving.asked
            self._last_save_block = -1 if self._base_block is None else self._base_block
        self._lost_s = time.perf_counter()
        self._give_up_s = self._lost_s + self.resume_within_s
        self._retry_s = RETRY_FIRST_S
        resume_block = None if self._base_block is None else self._base_block + 1
        self._failover = Failover(reason, resume_block, self._base_id, len(self._played), len(self._queued))
        log.warning("the stream was lost (%s): resuming at block %s from %s", reason, resume_block,
                    self._base_id or "the world's first request")
        if self.on_failover is not None:
            self.on_failover(self._failover)


class _Stalled(Exception):
    def __init__(self, seconds: float) -> None:
        super().__init__(f"no block for {seconds:.1f} s")
        self.seconds = seconds


def _used(block: BlockResponse) -> BlockUsed:
    if block.used is None:
        raise StreamError(f"block {block.block_index} came without what it was made from (return_used)")
    return block.used


def _latents_sha256(block: BlockResponse) -> str:
    return _used(block).latents_sha256
