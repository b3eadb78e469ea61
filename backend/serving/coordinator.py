"""The group loop every rank runs: agree on one plan at each block boundary, run it together, answer.

A rank that receives a request keeps its stream, rings the doorbell and shares the request at the next block
boundary (control_plane); every rank plans the same plan from the same events with its own scheduler copy and
opens, runs and closes the same sessions in the same order. Each rank's decode sender decodes its band of every
block (in plan order, so the ranks meet in the same decodes) while the group runs the next block; the owning
rank sends the frames. An idle group sleeps until the doorbell rings (a request, a step, a delivered block, a
cancellation), the heartbeat is due, or a steered session on this rank reaches its idle or lifetime limit.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar
from contextlib import AbstractContextManager

import torch.distributed as dist

from ..api import contract as c
from ..api.errors import InputError
from ..api.refusal import Refusal
from ..api.request import SessionRequest, StepRequest
from ..engine.rollout import WorldModelEngine
from ..engine.session import Session
from ..engine.validation import GLOBAL_WINDOW
from ..parallel.doorbell import Doorbell, LocalDoorbell
from . import messages
from .cancel_watch import CancelWatch
from .config import ServingConfig
from .control_plane import ControlPlane
from .decode_sender import DecodeSender
from .loop_cpu import LoopCpu
from .admission import admit, admit_step
from .line import MAX_RETRY_S, UNMEASURED_RETRY_S, Clocks, LineCounts, line_waits
from .scheduler import Plan, RankEvents, Scheduler, StepEvent
from .sessions import EndReason, Ending, LocalPart, OwnerPart, SharedSession
from .streams import OwnerStream, Responder, SteeredStream, WholeStream
from .threads import CoreSplit, use_threads

log = logging.getLogger(__name__)

KEEP_ENDED = 1024  # sequence keys whose session ended, remembered to tell a late step why


class GroupFailure(RuntimeError):
    """The group loop failed; the cause, with its traceback, is in the log."""


class GroupCoordinator:
    def __init__(
        self,
        engine: WorldModelEngine,
        settings: ServingConfig,
        control_group: dist.ProcessGroup | None,
        on_failure: Callable[[BaseException], None],
        doorbell: Doorbell | None = None,
        threads: CoreSplit | None = None,  # torch threads of the loop (DiT) and the decode; None: as they are
        cpu: LoopCpu | None = None,
        on_prompts: Callable[[int, int], None] | None = None,  # (world events applied, prompt cache hits) since the last call
        on_ended: Callable[[str], None] | None = None,  # (why) when a session this rank owns ends, as logged
        on_line: Callable[[LineCounts], None] | None = None,  # the group's sessions by state, after a plan
        send_lock: AbstractContextManager | None = None,  # reentrant: the lock responders send under (see streams)
    ) -> None:
        self.engine: WorldModelEngine | None = engine
        self.settings = settings
        self.rank = engine.sp.rank
        self.world = engine.sp.degree
        self.block_frames = engine.config.block_frames
        self.window_frames = engine.window_frames
        self.keep_commits = engine.window_frames != GLOBAL_WINDOW  # what a recache needs (a sliding window)
        self.control_group = control_group
        self.on_failure = on_failure
        self.control = ControlPlane(self.world, control_group, doorbell or LocalDoorbell(),
                                    heartbeat_s=settings.collective_timeout_s / 2)
        self.scheduler = Scheduler(settings)  # a copy on every rank: all plan alike from the same events
        self.threads = threads
        self.cpu = cpu or LoopCpu()
        self.on_prompts = on_prompts
        self.on_ended = on_ended
        self.on_line = on_line
        self._last_counts: LineCounts | None = None
        self.clocks = Clocks()  # the line's wait estimates
        self.send_lock = send_lock
        self.decoder = DecodeSender(engine, threads.decode if threads else None, on_failure=self._ring,
                                    on_stream_failed=self._stream_failed)
        # What this rank holds per session (its owner part from the request on, its engine session from the
        # opening on), until the session ends; the state itself is the scheduler's.
        self.local: dict[str, LocalPart] = {}
        self.running: dict[str, str] = {}  # Triton sequence key -> its steered session that takes steps here
        # sequence key -> how its last session ended (the code and sentence a late step gets)
        self.ended_keys: OrderedDict[str, Refusal] = OrderedDict()
        self._lock = threading.Lock()  # local, running, ended_keys: shared with Triton's thread and the cancel watch
        self._closed_reason: Refusal | None = None  # set when the loop has ended, for requests still arriving
        self._inbox: queue.SimpleQueue[SharedSession] = queue.SimpleQueue()
        self._steps: queue.SimpleQueue[StepEvent] = queue.SimpleQueue()
        self._failed: queue.SimpleQueue[tuple[str, Ending]] = queue.SimpleQueue()
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._cancels = CancelWatch(self._owned_streams, self._ring)
        self._thread = threading.Thread(target=self._run, name="lingbot-group-loop", daemon=True)
        self._thread.start()

    # -- called from Triton's execute thread -------------------------------------------------------

    def submit(self, request: SessionRequest | StepRequest, responder: Responder) -> None:
        engine = self.engine
        if engine is None:  # the loop has ended and let the model go
            responder.send_error(self._closed_reason or messages.MODEL_UNLOADING)
            return
        if isinstance(request, StepRequest):
            self._step(request, responder)
            return
        try:
            shared = admit(request, self.settings, engine, f"r{self.rank}-{next(self._ids)}", self.rank)
        except InputError as exc:
            responder.send_error(exc.refusal)
            return
        stream: OwnerStream = (SteeredStream(responder, self._ring, self.send_lock) if request.steered
                               else WholeStream(responder, self._ring, self.send_lock))
        key = request.session_key
        with self._lock:
            if request.steered and key in self.running:
                responder.send_error(messages.session_exists(key))
                return
            self.local[shared.id] = LocalPart(OwnerPart(stream, key))
            if request.steered:
                self.running[key] = shared.id
        self._inbox.put(shared)
        self._ring()
        if self._closed_reason is not None:  # the loop is gone: nobody else will take it
            self._refuse_inbox(self._closed_reason)

    def end_pause(self, key: str) -> None:
        """A request of Triton sequence `key` arrived: its session's open pause is answered before it is handled."""
        with self._lock:
            part = self._steered(key)
            ended = part is not None and part.owner.stream.end_pause()
        if ended:  # the idle clock runs again: wake the loop to wait for its new deadline
            self._ring()

    def _step(self, step: StepRequest, responder: Responder) -> None:
        """A step of a steered session this rank owns (Triton routes a sequence to one instance)."""
        key = step.session_key
        with self._lock:
            part = self._steered(key)
            if part is None:
                responder.send_error(messages.no_session(key, self.ended_keys.get(key, messages.NEVER_STARTED),
                                                         step.pause))
                return
            stream: SteeredStream = part.owner.stream
            if step.pause:  # no news for the scheduler: it changes no block
                stream.pause(responder)
                return
            try:
                admit_step(step, self.block_frames, self.window_frames)
            except InputError as exc:
                responder.send_error(exc.refusal)
                return
            sid = self.running[key]
            if step.end:  # no step may follow: the sequence's next request is told so
                self._forget_key(key, sid, messages.ENDED_BY_FLAG)
            if step.controls is not None:
                stream.add(responder)
            else:  # an end flag alone: the request is answered when the session closes
                stream.add_closing(responder)
        self._steps.put(StepEvent(sid, step.controls, step.end))
        self._ring()

    def stop(self, timeout_s: float = 120.0) -> None:
        self._stop.set()
        self._ring()
        self._thread.join(timeout_s)
        self._cancels.stop()

    def _ring(self) -> None:
        self.control.doorbell.ring()

    def _steered(self, key: str) -> LocalPart | None:
        """This rank's steered session that takes the steps of Triton sequence `key` (under the lock)."""
        sid = self.running.get(key)
        return None if sid is None else self.local[sid]

    def _forget_key(self, key: str, sid: str, ending: Refusal) -> None:
        """Sequence `key` no longer steers session `sid` (under the lock); a late request is told `ending`."""
        if self.running.get(key) == sid:
            del self.running[key]
        self.ended_keys[key] = ending
        self.ended_keys.move_to_end(key)
        while len(self.ended_keys) > KEEP_ENDED:
            self.ended_keys.popitem(last=False)

    def _owned_streams(self) -> list[OwnerStream]:
        return [part.owner.stream for _, part in self._owned()]

    def _stream_failed(self, session_id: str) -> None:
        """The decode sender could not decode one of this rank's sessions alone: it ends at the next boundary."""
        self._failed.put((session_id, Ending(EndReason.FAILED, messages.DECODE_FAILED)))
        self._ring()

    # -- the loop ----------------------------------------------------------------------------------

    def _run(self) -> None:
        use_threads(self.threads.dit if self.threads else None)
        self.cpu.start()
        try:
            while True:
                if self.decoder.failure is not None:  # a shared decode failed: the ranks no longer agree
                    raise RuntimeError("a block's shared decode failed") from self.decoder.failure
                rings = self.control.doorbell.count()  # before collecting: a later ring ends the next wait
                plan = self.scheduler.plan(self.control.exchange(self._collect(), rings))
                if plan.stop:
                    self._close(messages.MODEL_UNLOADING)
                    return
                self._apply(plan)
                self._tell_line(plan)
                if plan.idle:
                    self.control.wait_idle(self._next_deadline())
        except BaseException as exc:  # a dead or silent peer, or a failed forward: the group is broken
            log.exception("sequence-parallel group loop failed on rank %d", self.rank)
            failure = GroupFailure(repr(exc))
        # Past the handler: its traceback's frames (a forward's, holding the engine and its tensors) are gone,
        # so the failure handler can release the model's memory.
        self._close(messages.GROUP_FAILED)
        self.on_failure(failure)

    def _owned(self) -> list[tuple[str, LocalPart]]:
        """This rank's sessions that have not ended, by id."""
        with self._lock:
            return [(sid, part) for sid, part in self.local.items() if part.owner is not None]

    def _next_deadline(self) -> float | None:
        """The soonest idle or lifetime limit of this rank's open steered sessions (monotonic seconds)."""
        deadlines = [part.owner.deadline(self.settings) for _, part in self._owned() if part.steered_here and part.engine]
        return min(deadlines, default=None)

    def _close(self, reason: Refusal) -> None:
        """The loop ends: every session is aborted with `reason`, then late arrivals are answered directly."""
        self._closed_reason = reason
        drain(self._inbox)  # sessions not shared yet: their owner parts get the error below
        ending = Ending(EndReason.ABORTED, reason)
        self.scheduler.abort(ending)
        for sid in list(self.local):
            self._end(sid, ending)
        self.decoder.close()
        self._cancels.stop()
        self._refuse_inbox(reason)
        self.engine = self.decoder.engine = None  # the weights go now: a reload may need the memory
        self.control.doorbell = LocalDoorbell()  # close the store connections too
        self.control.group = self.control_group = None  # and the control group's sockets

    def _refuse_inbox(self, reason: str) -> None:
        for shared in drain(self._inbox):
            with self._lock:
                part = self.local.pop(shared.id, None)
                if part is not None and part.steered_here:
                    self._forget_key(part.owner.key, shared.id, reason)
            if part is not None:
                part.owner.stream.send_error(reason)

    def _collect(self) -> RankEvents:
        """This rank's news for the boundary: what its clients did, and what its clocks decided."""
        owned = self._owned()
        now = time.monotonic()
        events = RankEvents(submissions=drain(self._inbox), steps=drain(self._steps), failed=drain(self._failed),
                            stop=self._stop.is_set())
        events.cancelled = [sid for sid, part in owned if part.owner.stream.is_cancelled()]
        # The owner's clock decides a steered session's limits; the decision travels as news, so every rank's
        # scheduler ends it alike.
        events.expired = [(sid, why) for sid, part in owned if part.steered_here and part.engine is not None
                          and (why := part.owner.expiry(self.settings, now)) is not None]
        # Delivery counts matter only to a session held back by its client (see Scheduler._next_batch):
        # report those that advanced, so a boundary where nothing changed carries no news.
        table = self.scheduler.table
        events.delivered = {
            sid: part.owner.stream.sent for sid, part in owned
            if (s := table.get(sid)) is not None and s.lags(self.settings.max_blocks_ahead)
            and part.owner.stream.sent > s.delivered
        }
        return events

    def _apply(self, plan: Plan) -> None:
        for sid, ending in plan.ended:
            self._end(sid, ending)
        if plan.opens:
            self._open_all(plan.opens)
        for sid, prompt in plan.recaches:  # a boundary of its own (the scheduler plans no batch beside it)
            session = self.local[sid].engine
            self._set_prompt(session, prompt)
            with self.cpu.run_block(1):
                self.engine.recache(session)
            log.info("rank %d: session %s recomputed its cached frames under its new prompt", self.rank, sid)
        if not plan.batch:
            return
        sessions = [self.local[sid].engine for sid in plan.batch]
        for sid, controls in plan.controls.items():
            session = self.local[sid].engine
            if controls.controls is None:
                log.info("rank %d: block %d of session %s runs on held controls (its step is late)",
                         self.rank, session.block_index, sid)
            elif controls.controls.prompt is not None:
                self._set_prompt(session, controls.controls.prompt)
        start = time.perf_counter()
        with self.cpu.run_block(len(plan.batch)):
            outputs = self.engine.run_block(sessions, plan.controls)
        self.clocks.batch.observe(time.perf_counter() - start)
        finishing = {sid for sid, _ in plan.finishing}
        for sid, session, output in zip(plan.batch, sessions, outputs):
            owner = self.local[sid].owner
            stream = owner.stream if owner is not None else None
            if stream is not None or session.split_decode:
                self.decoder.block(stream, session, output, final=sid in finishing)
        for sid, ending in plan.finishing:
            self._end(sid, ending)

    def _tell_line(self, plan: Plan) -> None:
        """After a plan: each of this rank's sessions whose place in line changed is told its new place (0: it has
        its slot) and its estimated wait; the group's counts go to the metrics hook when they changed."""
        now = time.monotonic()
        places = {s.id: n for n, s in enumerate(self.scheduler.waiting(), start=1)}
        told = [(part.owner, places.get(sid, 0)) for sid, part in self._owned()]
        told = [(owner, place) for owner, place in told if place != (owner.place or 0)]
        if told:
            waits = line_waits(self.scheduler, self.clocks, self._opened_s(), now)
            for owner, place in told:
                owner.place = place
                owner.stream.send_place(place, waits[place - 1] if place else 0.0)  # before any block of its own
        if self.on_line is not None:
            opened = {s.id for s in plan.opens}
            waited = [now - part.owner.started_s for sid, part in self._owned() if sid in opened]
            counts = LineCounts.of(self.scheduler, self.settings, waited)
            if waited or counts != self._last_counts:
                self._last_counts = counts
                self.on_line(counts)

    def _opened_s(self) -> dict[str, float]:
        with self._lock:
            return {sid: part.opened_s for sid, part in self.local.items() if part.opened_s is not None}

    def _with_retry(self, refusal: Refusal) -> Refusal:
        """A full line's refusal gets its retry time here, from this rank's measured block times: the wait of the
        place behind the line's last (the plan carries none: no plan depends on a clock)."""
        if refusal.code != c.CAPACITY_EXHAUSTED:
            return refusal
        wait = line_waits(self.scheduler, self.clocks, self._opened_s(), time.monotonic(), extra=1)[-1]
        return dataclasses.replace(refusal, retry_after_s=min(wait, MAX_RETRY_S) if wait > 0 else UNMEASURED_RETRY_S)

    def _set_prompt(self, session: Session, prompt: str) -> None:
        """A world event, at the same block on every rank (its step travelled to all as news)."""
        engine = self.engine
        hits, same = engine.prompts.hits, prompt == session.prompt
        try:
            engine.set_prompt(session, prompt)
        except Exception:  # the encode failed: every rank learns it in the same broadcast; the old prompt stays
            log.warning("rank %d: the world event of session %s failed; its prompt stays", self.rank, session.id,
                        exc_info=True)
            return
        log.info("rank %d: session %s from block %d on: prompt %r (prompt cache: %s)", self.rank, session.id,
                 session.block_index, prompt,
                 "unchanged" if same else "hit" if engine.prompts.hits > hits else "encoded")
        if self.on_prompts is not None:
            self.on_prompts(1, engine.prompts.hits - hits)

    def _open_all(self, opens: list[SharedSession]) -> None:
        """Open the plan's sessions here; one that fails is news for the next boundary, where every rank's
        scheduler ends it (it joins no batch before: a session runs from the boundary after its opening)."""
        for shared in opens:
            with self._lock:
                part = self.local.setdefault(shared.id, LocalPart())
            try:
                # A steered session keeps what its cached blocks were made of, for a world event's recache.
                part.engine = self.engine.open_session(shared.request, shared.geometry, shared.id, shared.owner,
                                                       keep_commits=shared.steered and self.keep_commits)
                part.opened_s = time.monotonic()
            except Exception as exc:  # e.g. out of memory for this request: the session fails, not the group
                log.warning("rank %d: opening session %s failed", self.rank, shared.id, exc_info=True)
                self._failed.put((shared.id, Ending(EndReason.REJECTED, messages.open_failed(exc))))

    def _end(self, sid: str, ending: Ending) -> None:
        """The scheduler ended a session: free its caches here; its owner answers what still waits (with the
        ending's error, or by closing the stream after its blocks)."""
        told = self._with_retry(ending.told())  # the client's answer, and a late step's
        with self._lock:
            part = self.local.pop(sid, None)
            if part is not None and part.steered_here:
                self._forget_key(part.owner.key, sid, told)
        if part is None:  # never opened here
            return
        if part.opened_s is not None and part.engine is not None and not part.engine.num_blocks:
            self.clocks.life.observe(time.monotonic() - part.opened_s)  # an open-ended session's life
        reason = ending.reason.value
        if part.owner is not None:
            if self.on_ended is not None:
                self.on_ended(reason)
            if ending.error is None:
                self.decoder.finish(part.owner.stream)  # after its last block: close what still waits
            else:
                self.decoder.error(part.owner.stream, told)
        if (session := part.engine) is not None:
            held = session.cache_bytes()
            self.engine.close_session(session)
            done = f"{session.block_index} of {session.num_blocks} blocks" if session.num_blocks else \
                f"{session.block_index} block{'' if session.block_index == 1 else 's'} (steered: no set length)"
            with self._lock:
                still_open = sum(p.engine is not None for p in self.local.values())
            log.info(
                "rank %d: session %s %s after %s; freed %d cache bytes (left: %d); open sessions: %d",
                self.rank, sid, reason, done, held, session.cache_bytes(), still_open,
            )


T = TypeVar("T")


def drain(items: queue.SimpleQueue[T]) -> list[T]:
    """What the queue holds now, in order (new sessions or steps this rank received: every rank's scheduler
    learns them at the next boundary)."""
    taken = []
    while True:
        try:
            taken.append(items.get_nowait())
        except queue.Empty:
            return taken
