"""The group loop every rank runs: agree on one plan at each block boundary, run it together, answer.

A rank that receives a request keeps its responder, rings the doorbell and shares the request at the
next block boundary (control_plane); every rank plans the same plan from the same events with its own
scheduler; every rank opens, runs and closes the same sessions in the same order. Each rank's writer thread
decodes its band of every block (in plan order, so the ranks meet in the same decodes) while the group runs
the next block; the owning rank sends the frames. An idle group blocks on the doorbell.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import torch.distributed as dist

from ..api.errors import InputError
from ..api.contract import block_video_frames
from ..api.request import SessionRequest, StepRequest
from ..engine.rollout import Session, WorldModelEngine
from ..parallel.doorbell import Doorbell, LocalDoorbell
from . import messages
from .config import ServingConfig
from .control_plane import ControlPlane
from .loop_cpu import LoopCpu
from .response_writer import Responder, ResponseWriter
from .scheduler import Plan, RankEvents, Scheduler, StepEvent, Submission
from .steered_stream import SteeredStream
from .threads import CoreSplit, use_threads

log = logging.getLogger(__name__)


class GroupCoordinator:
    def __init__(
        self,
        engine: WorldModelEngine,
        limits: ServingConfig,
        control_group: dist.ProcessGroup | None,
        on_failure: Callable[[BaseException], None],
        doorbell: Doorbell | None = None,
        threads: CoreSplit | None = None,  # torch threads of the loop (DiT) and the writer (decode); None: as they are
        cpu: LoopCpu | None = None,
    ) -> None:
        self.engine: WorldModelEngine | None = engine
        self.limits = limits
        self.rank = engine.sp.rank
        self.world = engine.sp.degree
        self.control_group = control_group
        self.on_failure = on_failure
        self.control = ControlPlane(self.world, control_group, doorbell or LocalDoorbell(),
                                    heartbeat_s=limits.collective_timeout_s / 2)
        self.scheduler = Scheduler(limits)  # a copy on every rank: all plan alike from the same events
        self.threads = threads
        self.cpu = cpu or LoopCpu()
        self.writer = ResponseWriter(engine, threads.decode if threads else None,
                                     on_failure=lambda: self.control.doorbell.ring())
        self.sessions: dict[str, Session] = {}
        self.responders: dict[str, Responder] = {}  # this rank's requests, waiting or running
        self._closed_reason: str | None = None  # set when the loop has ended, for requests still arriving
        self._inbox: queue.SimpleQueue[tuple[Submission, Responder]] = queue.SimpleQueue()
        self._steps: queue.SimpleQueue[StepEvent] = queue.SimpleQueue()
        self.steered: dict[str, tuple[str, SteeredStream]] = {}  # sequence key -> (session id, its stream)
        self.gone: OrderedDict[str, str] = OrderedDict()  # recently ended sequence keys -> why, for late steps
        self._steer_lock = threading.Lock()
        self._ids = itertools.count()
        self._stop = threading.Event()
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
            self.limits.check_limits(request)
            geometry = engine.validate(request)
        except InputError as exc:
            responder.send_error(str(exc))
            return
        sid = f"r{self.rank}-{next(self._ids)}"
        if request.steered:
            with self._steer_lock:
                if request.session_key in self.steered:
                    responder.send_error(
                        f"session {request.session_key} is already running; send steps without the start flag, "
                        f"or end it first"
                    )
                    return
                stream = SteeredStream(request.session_key, responder)
                self.steered[request.session_key] = (sid, stream)
                self.gone.pop(request.session_key, None)
            responder = stream
        self._inbox.put((Submission(sid, request, geometry.block_shape, self.rank), responder))
        self.control.doorbell.ring()
        if self._closed_reason is not None:  # the loop is gone: nobody else will take it
            self._refuse_inbox(self._closed_reason)

    def _step(self, step: StepRequest, responder: Responder) -> None:
        """A step of a steered session this rank owns (Triton routes a sequence to one instance)."""
        with self._steer_lock:
            found = self.steered.get(step.session_key)
            if found is None:
                why = self.gone.get(step.session_key, "it never started here (send the start flag first)")
                responder.send_error(f"no running session {step.session_key}: {why}")
                return
            sid, stream = found
            if stream.ending:
                responder.send_error(f"session {step.session_key} was ended by its end flag; start a new one")
                return
            try:
                if step.controls is not None:
                    step.controls.check(block_video_frames(self.engine.config.block_frames, first=False))
            except InputError as exc:
                responder.send_error(str(exc))
                return
            stream.ending = step.end
            if step.controls is not None:
                stream.add(responder)
            else:  # an end flag alone: the request is answered when the session closes
                stream.add_closing(responder)
        self._steps.put(StepEvent(sid, step.controls, step.end))
        self.control.doorbell.ring()

    def stop(self, timeout_s: float = 120.0) -> None:
        self._stop.set()
        self.control.doorbell.ring()
        self._thread.join(timeout_s)

    # -- the loop ----------------------------------------------------------------------------------

    def _run(self) -> None:
        use_threads(self.threads.dit if self.threads else None)
        self.cpu.start()
        try:
            while True:
                if self.writer.failure is not None:  # a shared decode failed: the ranks no longer agree
                    raise RuntimeError("a block's shared decode failed") from self.writer.failure
                rings = self.control.doorbell.count()  # before collecting: a later ring ends the next wait
                plan = self.scheduler.plan(self.control.exchange(self._collect(), rings))
                if plan.stop:
                    self._close(messages.MODEL_UNLOADING)
                    return
                self._apply(plan)
                if not plan.idle:
                    continue
                if self.scheduler.active:  # every session waits for a slow client: poll the writers
                    time.sleep(self.limits.idle_poll_ms / 1000.0)
                else:
                    self.control.wait_idle()
        except BaseException as exc:  # a dead or silent peer, or a failed forward: the group is broken
            log.exception("sequence-parallel group loop failed on rank %d", self.rank)
            self._close(messages.GROUP_FAILED)
            self.on_failure(exc)

    def _close(self, reason: str) -> None:
        """The loop ends: error every local stream, then answer late arrivals directly."""
        self._closed_reason = reason
        self._take_inbox()
        for sid in list(self.responders):
            self.writer.error(self.responders.pop(sid), reason)
        for sid in list(self.sessions):
            self._end(sid, "aborted")
        self.writer.close()
        self._refuse_inbox(reason)
        self.engine = self.writer.engine = None  # the weights go now: a reload may need the memory
        self.control.doorbell = LocalDoorbell()  # close the store connections too

    def _refuse_inbox(self, reason: str) -> None:
        while True:
            try:
                _, responder = self._inbox.get_nowait()
            except queue.Empty:
                return
            responder.send_error(reason)

    def _take_inbox(self) -> list[Submission]:
        """New local requests: their responders are kept here, the submissions go to rank 0."""
        taken = []
        while True:
            try:
                sub, responder = self._inbox.get_nowait()
            except queue.Empty:
                return taken
            self.responders[sub.session_id] = responder
            taken.append(sub)

    def _take_steps(self) -> list[StepEvent]:
        steps = []
        while True:
            try:
                steps.append(self._steps.get_nowait())
            except queue.Empty:
                return steps

    def _expired(self) -> list[tuple[str, str]]:
        """This rank's steered sessions past their idle or lifetime limit (the owner's clock decides, and the
        decision travels as news, so every rank's scheduler ends them alike)."""
        now, limits, out = time.monotonic(), self.limits, []
        with self._steer_lock:
            for sid, stream in self.steered.values():
                if sid not in self.sessions or stream.expiring:
                    continue
                if now - stream.started_s > limits.max_session_s:
                    why = messages.session_too_long(limits.max_session_s)
                elif now - stream.last_step_s > limits.session_idle_timeout_s:
                    why = messages.session_idle(limits.session_idle_timeout_s)
                else:
                    continue
                stream.expiring = True
                out.append((sid, why))
        return out

    def _collect(self) -> RankEvents:
        events = RankEvents(submissions=self._take_inbox(), steps=self._take_steps(), expired=self._expired(),
                            stop=self._stop.is_set())
        events.cancelled = [sid for sid, r in self.responders.items() if r.is_cancelled()]
        delivered = self.writer.delivered
        for sid in [s for s in list(delivered) if s not in self.responders]:  # streams that ended
            delivered.pop(sid, None)
        # Delivery counts matter only to a session held back by its client (see Scheduler._next_batch):
        # report those that advanced, so a boundary where nothing changed carries no news.
        sched, ahead = self.scheduler, self.limits.max_blocks_ahead
        sent = {sid: r.sent if isinstance(r, SteeredStream) else delivered.get(sid, 0)
                for sid, r in self.responders.items()}
        events.delivered = {
            sid: n for sid, n in sent.items()
            if sid in sched.active and sched.computed[sid] - sched.delivered.get(sid, 0) >= ahead
            and n > sched.delivered.get(sid, 0)
        }
        return events

    def _apply(self, plan: Plan) -> None:
        for sid, message in plan.rejects:
            self._reply_last(sid, message)
        for sid in plan.cancels:
            self._end(sid, "cancelled")
            self._reply_last(sid)
        for sid, message in plan.expired:
            self._end(sid, "expired", message)
            self._reply_last(sid, message)
        for sid in plan.ends:
            self._end(sid, "ended by its client")
            self._reply_last(sid)
        if plan.opens:
            self._open_all(plan.opens)
        if not plan.batch:
            return
        for sid, controls in plan.controls.items():
            if controls.controls is None:
                log.info("rank %d: block %d of session %s runs on held controls (its step is late)",
                         self.rank, self.sessions[sid].block_index, sid)
        with self.cpu.run_block(len(plan.batch)):
            outputs = self.engine.run_block([self.sessions[sid] for sid in plan.batch], plan.controls)
        for output in outputs:
            sid = output.session_id
            session = self.sessions[sid]
            responder = self.responders.get(sid)
            if responder is not None or self.engine.shares_decode(session):
                self.writer.block(responder, session, output, final=session.done)
            if session.done:
                if isinstance(self.responders.pop(sid, None), SteeredStream):
                    self.writer.finish(responder)  # after its last block: close what still waits
                self._end(sid, "finished")

    def _open_all(self, subs: list[Submission]) -> None:
        failed: dict[str, str] = {}
        for sub in subs:
            try:
                self.sessions[sub.session_id] = self.engine.open_session(sub.request, sub.session_id, sub.owner)
            except Exception as exc:  # e.g. out of memory for this request: the session fails, not the group
                log.warning("rank %d: opening session %s failed", self.rank, sub.session_id, exc_info=True)
                failed[sub.session_id] = str(exc) if isinstance(exc, InputError) else messages.open_failed(exc)
        for sid, message in self._agree(failed).items():  # a session failed on any rank is dropped on all
            self._end(sid, "rejected")
            self._reply_last(sid, message)

    def _reply_last(self, sid: str, error: str | None = None) -> None:
        """This rank's stream of a session that ended: answered with `error`, or closed without data."""
        if (responder := self.responders.pop(sid, None)) is not None:
            if error is None:
                self.writer.finish(responder)
            else:
                self.writer.error(responder, error)

    def _agree(self, failed: dict[str, str]) -> dict[str, str]:
        """The union of every rank's failures (a collective: every rank calls it for the same opens)."""
        if self.world == 1:
            return failed
        everyone: list[dict[str, str]] = [{}] * self.world
        dist.all_gather_object(everyone, failed, group=self.control_group)
        return {sid: msg for per_rank in everyone for sid, msg in per_rank.items()}

    def _end(self, sid: str, reason: str, why: str | None = None) -> None:
        """Free a session's caches on this rank and its slot on rank 0."""
        self._forget_steered(sid, why or f"it {reason}")
        if (session := self.sessions.pop(sid, None)) is not None:
            held = session.cache_bytes()
            self.engine.close_session(session)
            log.info(
                "rank %d: session %s %s after %d/%d blocks; freed %d cache bytes (left: %d); open sessions: %d",
                self.rank, sid, reason, session.block_index, session.num_blocks, held,
                session.cache_bytes(), len(self.sessions),
            )
        self.scheduler.finished(sid)

    def _forget_steered(self, sid: str, why: str) -> None:
        """A steered session this rank owns ended: later steps for its key are told why."""
        with self._steer_lock:
            for key, (owned, _) in list(self.steered.items()):
                if owned == sid:
                    del self.steered[key]
                    self.gone[key] = why
            while len(self.gone) > 1024:
                self.gone.popitem(last=False)
