"""The group loop every rank runs: agree on one plan at each block boundary, run it together, answer.

A rank that receives a request keeps its stream, rings the doorbell and shares the request at the next block
boundary (control_plane); every rank plans the same plan from the same events with its own scheduler copy and
opens, runs and closes the same sessions in the same order. Each rank's decode sender decodes its band of every
block (in plan order, so the ranks meet in the same decodes) while the group runs the next block; the owning
rank sends the frames. An idle group sleeps until the doorbell rings (a request, a step, a delivered block, a
cancellation), the heartbeat is due, or a steered session on this rank reaches its idle or lifetime limit.
"""
from __future__ import annotations

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

from ..api.errors import InputError
from ..api.contract import PARAM_PAUSE, block_video_frames
from ..api.request import SessionRequest, StepRequest
from ..engine.rollout import WorldModelEngine
from ..engine.session import Session
from ..parallel.doorbell import Doorbell, LocalDoorbell
from . import messages
from .cancel_watch import CancelWatch
from .config import ServingConfig
from .control_plane import ControlPlane
from .decode_sender import DecodeSender
from .loop_cpu import LoopCpu
from .scheduler import Plan, RankEvents, Scheduler, StepEvent
from .sessions import OwnerPart, SessionRecord, SharedSession, State
from .streams import OwnerStream, Responder, SteeredStream, WholeStream
from .threads import CoreSplit, use_threads

log = logging.getLogger(__name__)

KEEP_DONE = 1024  # ended steered sessions remembered, to tell a late step why


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
        send_lock: AbstractContextManager | None = None,  # reentrant: the lock responders send under (see streams)
    ) -> None:
        self.engine: WorldModelEngine | None = engine
        self.settings = settings
        self.rank = engine.sp.rank
        self.world = engine.sp.degree
        self.control_group = control_group
        self.on_failure = on_failure
        self.control = ControlPlane(self.world, control_group, doorbell or LocalDoorbell(),
                                    heartbeat_s=settings.collective_timeout_s / 2)
        self.scheduler = Scheduler(settings)  # a copy on every rank: all plan alike from the same events
        self.threads = threads
        self.cpu = cpu or LoopCpu()
        self.on_prompts = on_prompts
        self.on_ended = on_ended
        self.send_lock = send_lock
        self.decoder = DecodeSender(engine, threads.decode if threads else None, on_failure=self._ring)
        # Every session this rank knows: the ones it owns from their request on, the others from their opening;
        # ended steered sessions it owned stay a while (state done) to answer late steps.
        self.sessions: OrderedDict[str, SessionRecord] = OrderedDict()
        self._lock = threading.Lock()  # `sessions` is shared with Triton's thread and the cancel watch
        self._closed_reason: str | None = None  # set when the loop has ended, for requests still arriving
        self._inbox: queue.SimpleQueue[SharedSession] = queue.SimpleQueue()
        self._steps: queue.SimpleQueue[StepEvent] = queue.SimpleQueue()
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
            self.settings.check_limits(request)
            geometry = engine.validate(request)
        except InputError as exc:
            responder.send_error(str(exc))
            return
        shared = SharedSession.submitted(f"r{self.rank}-{next(self._ids)}", request, geometry.block_shape, self.rank)
        stream: OwnerStream = (SteeredStream(responder, self._ring, self.send_lock) if request.steered
                               else WholeStream(responder, self._ring, self.send_lock))
        with self._lock:
            if request.steered and self._running(request.session_key) is not None:
                responder.send_error(
                    f"session {request.session_key} is already running; send steps without the start flag, "
                    f"or end it first"
                )
                return
            self.sessions[shared.id] = SessionRecord(shared, OwnerPart(stream, request.session_key))
        self._inbox.put(shared)
        self._ring()
        if self._closed_reason is not None:  # the loop is gone: nobody else will take it
            self._refuse_inbox(self._closed_reason)

    def end_pause(self, key: str) -> None:
        """A request of Triton sequence `key` arrived: its session's open pause is answered before it is handled."""
        with self._lock:
            record = self._running(key)
            ended = record is not None and record.owner.stream.end_pause()
        if ended:  # the idle clock runs again: wake the loop to wait for its new deadline
            self._ring()

    def _step(self, step: StepRequest, responder: Responder) -> None:
        """A step of a steered session this rank owns (Triton routes a sequence to one instance)."""
        with self._lock:
            record = self._running(step.session_key) or self._last_ended(step.session_key)
            pause = f"request parameter '{PARAM_PAUSE}': " if step.pause else ""
            if record is None or record.state is State.DONE:
                why = record.why if record is not None else "it never started here (send the start flag first)"
                responder.send_error(f"{pause}no running session {step.session_key}: {why}")
                return
            stream: SteeredStream = record.owner.stream
            if stream.sealed:
                responder.send_error(f"{pause}session {step.session_key} was ended by its end flag; start a new one")
                return
            if step.pause:  # no news for the scheduler: it changes no block
                stream.pause(responder)
                return
            try:
                if step.controls is not None:
                    step.controls.check(block_video_frames(self.engine.config.block_frames, first=False))
            except InputError as exc:
                responder.send_error(str(exc))
                return
            if step.controls is not None:
                stream.add(responder, step.end)
            else:  # an end flag alone: the request is answered when the session closes
                stream.add_closing(responder)
        self._steps.put(StepEvent(record.id, step.controls, step.end))
        self._ring()

    def stop(self, timeout_s: float = 120.0) -> None:
        self._stop.set()
        self._ring()
        self._thread.join(timeout_s)
        self._cancels.stop()

    def _ring(self) -> None:
        self.control.doorbell.ring()

    def _running(self, key: str | None) -> SessionRecord | None:
        """This rank's steered session on Triton sequence `key` that has not ended (under the lock)."""
        return next((r for r in self.sessions.values() if r.steered_key == key and r.state is not State.DONE), None)

    def _last_ended(self, key: str) -> SessionRecord | None:
        return next((r for r in reversed(self.sessions.values()) if r.steered_key == key), None)

    def _owned_streams(self) -> list[OwnerStream]:
        return [r.owner.stream for r in self._owned()]

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
                if plan.idle:
                    self.control.wait_idle(self._next_deadline())
        except BaseException as exc:  # a dead or silent peer, or a failed forward: the group is broken
            log.exception("sequence-parallel group loop failed on rank %d", self.rank)
            failure = GroupFailure(repr(exc))
        # Past the handler: its traceback's frames (a forward's, holding the engine and its tensors) are gone,
        # so the failure handler can release the model's memory.
        self._close(messages.GROUP_FAILED)
        self.on_failure(failure)

    def _owned(self) -> list[SessionRecord]:
        """This rank's sessions that have not ended."""
        with self._lock:
            return [r for r in self.sessions.values() if r.owner is not None and r.state is not State.DONE]

    def _next_deadline(self) -> float | None:
        """The soonest idle or lifetime limit of this rank's open steered sessions (monotonic seconds)."""
        deadlines = [r.owner.deadline(self.settings) for r in self._owned() if r.shared.steered and r.engine]
        return min(deadlines, default=None)

    def _close(self, reason: str) -> None:
        """The loop ends: error every local stream, then answer late arrivals directly."""
        self._closed_reason = reason
        drain(self._inbox)  # sessions not shared yet: their owned records get the error below
        for record in self._owned():
            self.decoder.error(record.owner.stream, reason)
        for sid in list(self.sessions):
            self._end(sid, "aborted")
        self.decoder.close()
        self._cancels.stop()
        self._refuse_inbox(reason)
        self.engine = self.decoder.engine = None  # the weights go now: a reload may need the memory
        self.control.doorbell = LocalDoorbell()  # close the store connections too
        self.control.group = self.control_group = None  # and the control group's sockets

    def _refuse_inbox(self, reason: str) -> None:
        for shared in drain(self._inbox):
            with self._lock:
                record = self.sessions.pop(shared.id, None)
            if record is not None:
                record.owner.stream.send_error(reason)

    def _collect(self) -> RankEvents:
        """This rank's news for the boundary: what its clients did, and what its clocks decided."""
        owned = self._owned()
        now = time.monotonic()
        events = RankEvents(submissions=drain(self._inbox), steps=drain(self._steps), stop=self._stop.is_set())
        events.cancelled = [r.id for r in owned if r.owner.stream.is_cancelled()]
        # The owner's clock decides a steered session's limits; the decision travels as news, so every rank's
        # scheduler ends it alike.
        events.expired = [(r.id, why) for r in owned if r.shared.steered and r.engine is not None
                          and (why := r.owner.expiry(self.settings, now)) is not None]
        # Delivery counts matter only to a session held back by its client (see Scheduler._next_batch):
        # report those that advanced, so a boundary where nothing changed carries no news.
        events.delivered = {
            r.id: r.owner.stream.sent for r in owned
            if r.shared.lags(self.settings.max_blocks_ahead) and r.owner.stream.sent > r.shared.delivered
        }
        return events

    def _apply(self, plan: Plan) -> None:
        for sid, message in plan.rejects:
            self._end(sid, "rejected", message)
        for sid in plan.cancels:
            self._end(sid, "cancelled")
        for sid, message in plan.expired:
            self._end(sid, "expired", message)
        for sid in plan.ends:
            self._end(sid, "ended by its client")
        if plan.opens:
            self._open_all(plan.opens)
        if not plan.batch:
            return
        records = [self.sessions[sid] for sid in plan.batch]
        for sid, controls in plan.controls.items():
            if controls.controls is None:
                log.info("rank %d: block %d of session %s runs on held controls (its step is late)",
                         self.rank, self.sessions[sid].engine.block_index, sid)
            elif controls.controls.prompt is not None:
                self._set_prompt(self.sessions[sid].engine, controls.controls.prompt)
        with self.cpu.run_block(len(plan.batch)):
            outputs = self.engine.run_block([r.engine for r in records], plan.controls)
        for record, output in zip(records, outputs):
            session = record.engine
            stream = record.owner.stream if record.owner is not None else None
            if stream is not None or session.split_decode:
                self.decoder.block(stream, session, output, final=session.done)
            if session.done:
                self._end(record.id, "finished")

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
        failed: dict[str, str] = {}
        for shared in opens:
            with self._lock:
                record = self.sessions.setdefault(shared.id, SessionRecord(shared))
                record.shared = shared  # the scheduler's copy from now on
            try:
                record.engine = self.engine.open_session(shared.request, shared.id, shared.owner)
            except Exception as exc:  # e.g. out of memory for this request: the session fails, not the group
                log.warning("rank %d: opening session %s failed", self.rank, shared.id, exc_info=True)
                failed[shared.id] = str(exc) if isinstance(exc, InputError) else messages.open_failed(exc)
        for sid, message in self._agree(failed).items():  # a session failed on any rank is dropped on all
            self._end(sid, "rejected", message)

    def _agree(self, failed: dict[str, str]) -> dict[str, str]:
        """The union of every rank's failures (a collective: every rank calls it for the same opens)."""
        if self.world == 1:
            return failed
        everyone: list[dict[str, str]] = [{}] * self.world
        dist.all_gather_object(everyone, failed, group=self.control_group)
        return {sid: msg for per_rank in everyone for sid, msg in per_rank.items()}

    def _end(self, sid: str, reason: str, error: str | None = None) -> None:
        """A session ended on every rank: free its caches and slot here; its owner answers what still waits
        (with `error`, or by closing the stream after its blocks)."""
        self.scheduler.finished(sid)
        with self._lock:
            record = self.sessions.get(sid)
            if record is None or record.why is not None:  # unknown here, or ended already
                return
            record.shared.state = State.DONE  # the scheduler's copy, or a submission it never planned
            record.why = error or f"it {reason}"
            if record.steered_key is None:
                del self.sessions[sid]
            else:  # remembered for late steps
                self.sessions.move_to_end(sid)
                done = [k for k, r in self.sessions.items() if r.state is State.DONE]
                for old in done[: max(0, len(done) - KEEP_DONE)]:
                    del self.sessions[old]
        if record.owner is not None:
            if self.on_ended is not None:
                self.on_ended(reason)
            if error is None:
                self.decoder.finish(record.owner.stream)  # after its last block: close what still waits
            else:
                self.decoder.error(record.owner.stream, error)
        if (session := record.engine) is not None:
            record.engine = None
            held = session.cache_bytes()
            self.engine.close_session(session)
            done = f"{session.block_index} of {session.num_blocks} blocks" if session.num_blocks else \
                f"{session.block_index} block{'' if session.block_index == 1 else 's'} (steered: no set length)"
            log.info(
                "rank %d: session %s %s after %s; freed %d cache bytes (left: %d); open sessions: %d",
                self.rank, sid, reason, done, held,
                session.cache_bytes(), sum(r.engine is not None for r in self.sessions.values()),
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
