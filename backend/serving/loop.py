"""The group loop every rank runs: agree on one plan at each block boundary, run it together.

The loop's thread (`lingbot-group-loop`) owns this rank's part of every session it runs (its engine session:
caches, noise, camera) and its copy of the scheduler; it is fed only by its inbox (serving/mail): the news of
this rank's clients from its intake, and its decode sender's failures. At each block boundary it exchanges its
news with every rank (control_plane), plans the same plan as every rank from the same news with its own scheduler
copy, and opens, runs and closes the same sessions in the same order. Its decode sender decodes each block while
the group runs the next one and hands the owned sessions' frames to the intake; the loop tells the intake when an
owned session opens, moves in the queue or ends, and hands it the files of its saves that the ranks report as news (the
intake publishes them: serving/saves). An idle group sleeps until the doorbell rings (news from some rank) or the
heartbeat is due.

What the loop holds of each session it knows is one record (`Here`, this rank's part of it: its engine session, its
clocks, and on its owner its client's deliveries and place); where the session stands is its shared record's
(`SharedSession.status`), whose one writer is the scheduler.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist

from ..api import contract as c
from ..api.refusal import Refusal
from ..engine.rollout import WorldModelEngine
from ..engine.session import Session
from ..engine.snapshot import sessions as snapshots
from ..engine.snapshot.manifest import SnapshotError
from ..engine.snapshot.restore import SharedState
from ..engine.validation import GLOBAL_WINDOW
from ..parallel.doorbell import Doorbell, LocalDoorbell
from . import mail, messages
from .settings import ServingSettings
from .control_plane import ControlPlane
from .decode_sender import DecodeSender
from .waits import Clocks, QueueCounts, queue_waits, retry_after_s
from .loop_cpu import LoopCpu
from .news import FilesWritten, Park, Parked, RankEvents
from .scheduler import Plan, Scheduler
from .sessions import EndReason, Ending, ResumeFrom, SharedSession
from .snapshot_writer import SnapshotWriter
from .stores import Folders
from .threads import CoreSplit, use_threads

log = logging.getLogger(__name__)


class GroupFailure(RuntimeError):
    """The group loop failed; the cause, with its traceback, is in the log."""


@dataclasses.dataclass
class LoopHooks:
    """What the loop reports to its host (the metrics port); each is called on the loop's thread."""

    on_failure: Callable[[BaseException], None] = lambda exc: None  # the group failed (the model is freed after)
    on_prompts: Callable[[int, int], None] | None = None  # (prompt events applied, prompt cache hits) since the last
    on_ended: Callable[[str], None] | None = None  # (why) when a session this rank owns ends, as logged
    on_queue: Callable[[QueueCounts], None] | None = None  # the group's sessions by state, after a plan that changed them
    # a snapshot of a session this rank owns: "saved" or "failed" (on the writer's thread), "resumed" (a session
    # opened from one)
    on_snapshot: Callable[[str], None] | None = None
    # a parked world this rank owns back on a slot: (its session, its queue wait from the boundary that saw its step,
    # the open from its park copy), in seconds
    on_unpark: Callable[[str, float, float], None] | None = None


@dataclasses.dataclass
class Here:
    """What this rank holds of one session, from its submission (its owner) or its opening (every rank) to its end."""

    owned: bool  # this rank answers its client (its intake holds its stream)
    engine: Session | None = None  # its engine session (caches, noise, camera), from its opening on
    opened_s: float | None = None  # when it was opened here: a wait estimate's clock, never a plan's
    submitted_s: float = 0.0  # owned: when it reached the loop, or its step a parked world's (its wait in the queue)
    delivered: int = 0  # owned: blocks its client received, as the intake last said
    told: int = 0  # owned: the place in the queue its client was last told (0: its slot)
    saved: SharedState | None = None  # owned and resumed: what admission read of its snapshot's shared file, until
    # it opens


class GroupLoop:
    def __init__(self, engine: WorldModelEngine, settings: ServingSettings, control_group: dist.ProcessGroup | None,
                 to_intake: Callable[[mail.IntakeLetter], None], hooks: LoopHooks | None = None,
                 doorbell: Doorbell | None = None, threads: CoreSplit | None = None, cpu: LoopCpu | None = None) -> None:
        """to_intake: the intake's inbox; threads: torch threads of the loop (DiT) and the decode, None leaves them
        as they are."""
        self.engine: WorldModelEngine | None = engine
        self.settings = settings
        self.rank = engine.sp.rank
        self.keep_commits = engine.window_frames != GLOBAL_WINDOW  # what a recache needs (a sliding window)
        self.hooks = hooks or LoopHooks()
        self.control = ControlPlane(engine.sp.degree, control_group, doorbell or LocalDoorbell(),
                                    heartbeat_s=settings.collective_timeout_s / 2)
        self.scheduler = Scheduler(settings)  # a copy on every rank: all plan alike from the same events
        self.threads = threads
        self.cpu = cpu or LoopCpu()
        self.clocks = Clocks()  # the queue's wait estimates
        self._to_intake = to_intake
        self._inbox: queue.SimpleQueue[mail.LoopLetter] = queue.SimpleQueue()
        self.decoder = DecodeSender(engine.vae, self.rank, to_intake, self.post, threads.decode if threads else None)
        # Saved and parked worlds (docs/worlds.md, docs/serving.md "Parking"): this rank writes its parts in the
        # background into the snapshot store (snapshot_dir) or the park tier in host memory.
        self.folders = Folders.of(settings)
        self.writer = SnapshotWriter(self.rank, self.post) if self.folders.snapshots or self.folders.parks else None
        self.here: dict[str, Here] = {}  # every session this rank holds, until it ends
        self._failed: list[tuple[str, Ending]] = []  # sessions that failed to open here: news for the next boundary
        self._last_counts: QueueCounts | None = None
        self._thread = threading.Thread(target=self._run, name="lingbot-group-loop", daemon=True)
        self._thread.start()

    # -- any thread ------------------------------------------------------------------------------------------

    def post(self, letter: mail.LoopLetter) -> None:
        """News for the next block boundary: into the inbox, then the doorbell."""
        self._inbox.put(letter)
        self.ring()

    def ring(self) -> None:
        self.control.doorbell.ring()

    def stop(self, timeout_s: float = 120.0) -> None:
        """End every session and the loop (this rank's stop travels as news: the whole group stops with it)."""
        self.post(mail.Stop())
        self._thread.join(timeout_s)

    # -- the loop's thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        use_threads(self.threads.dit if self.threads else None)
        self.cpu.start()
        try:
            while True:
                rings = self.control.doorbell.count()  # before collecting: a later ring ends the next wait
                events = self.control.exchange(self._collect(), rings)
                plan = self.scheduler.plan(events)
                self._hand_on_saves([w for e in events for w in e.written], plan)
                if plan.stop:
                    self._close(messages.MODEL_UNLOADING)
                    return
                self._apply(plan)
                self._tell_places(plan)
                if plan.idle:
                    self.control.wait_idle()
        except BaseException as exc:  # a dead or silent peer, or a failed forward: the group is broken
            log.exception("sequence-parallel group loop failed on rank %d", self.rank)
            failure = GroupFailure(repr(exc))
        # Past the handler: its traceback's frames (a forward's, holding the engine and its tensors) are gone,
        # so the failure handler can free the model's memory.
        self._close(messages.GROUP_FAILED)
        self.hooks.on_failure(failure)

    def _collect(self) -> RankEvents:
        """This rank's news for the boundary, from its inbox."""
        events = RankEvents(failed=self._failed, clock_s=time.time())  # the boundary's clock: a key's blocks per hour
        self._failed = []
        now = time.monotonic()
        for letter in take_all(self._inbox):
            match letter:
                case mail.Submitted(shared, saved):
                    events.submissions.append(shared)
                    self.here[shared.id] = Here(owned=True, submitted_s=now, saved=saved)
                case mail.Stepped(step):
                    events.steps.append(step)
                    if (s := self.scheduler.table.get(step.session_id)) is not None and s.in_park:
                        self.here[step.session_id].submitted_s = now  # a parked world's wait for a slot begins
                case mail.Cancelled(sid):
                    events.cancelled.append(sid)
                case mail.Expired(sid, why):
                    events.expired.append((sid, why))
                case mail.Delivered(sid, blocks):
                    if (here := self.here.get(sid)) is not None:
                        here.delivered = blocks
                case mail.DecodeFailed(sid):
                    events.failed.append((sid, Ending(EndReason.FAILED, messages.DECODE_FAILED)))
                case mail.SharedDecodeFailed(error):
                    raise RuntimeError(f"a block's shared decode failed: {error}")
                case mail.Revoked(tags):
                    events.revoked.extend(sorted(tags))
                case FilesWritten():
                    events.written.append(letter)
                case mail.Moving(sid, snapshot_id):
                    events.moving.append((sid, snapshot_id))
                case mail.Seated(sids):
                    events.seated.extend(sids)
                case mail.OverQuota(sid, why):
                    events.over_quota.append((sid, why))
                case Park():
                    events.parking.append(letter)
                case Parked():
                    events.parked.append(letter)
                case mail.Stop():
                    events.stop = True
        # Delivery counts matter only to a session held back by its client (see Scheduler._next_batch): report
        # those that advanced, so a boundary where nothing changed carries no news.
        table = self.scheduler.table
        events.delivered = {sid: here.delivered for sid, here in self.here.items()
                            if here.owned and (s := table.get(sid)) is not None
                            and s.lags(self.settings.max_blocks_ahead) and here.delivered > s.delivered}
        return events

    def _apply(self, plan: Plan) -> None:
        for sid, snapshot_id in plan.moves:  # saved where they stand, then ended (below) with MOVED
            self._save(sid, snapshot_id, self.folders.snapshots)
        for owner, snapshot_id, parked in plan.copies:  # parked worlds moved from their copy, then ended with MOVED
            self._copy(owner, snapshot_id, parked)
        for park in plan.parks:  # idle worlds saved where they stand into their park copy (they keep their slot)
            self._save(park.session_id, park.snapshot_id, self.folders.root(park.tier))
        for sid, ending in plan.ended:
            self._end(sid, ending)
        for sid in plan.parked:  # their copy is durable: off their slot
            self._park(sid)
        if plan.opens:
            self._open_all(plan.opens)
        for sid, prompt in plan.recaches:  # a boundary of its own (the scheduler plans no batch beside it)
            session = self.here[sid].engine
            self._set_prompt(session, prompt)
            with self.cpu.run_block(1):
                self.engine.recache(session)
            log.info("rank %d: session %s recomputed its cached frames under its new prompt", self.rank, sid)
        if plan.batch:
            self._run_batch(plan)

    def _run_batch(self, plan: Plan) -> None:
        sessions = [self.here[sid].engine for sid in plan.batch]
        for sid, controls in plan.controls.items():
            session = self.here[sid].engine
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
            owned = self.here[sid].owned
            if owned or session.decoding.split:
                self.decoder.block(session.decoding, output, final=sid in finishing, owned=owned)
        for sid, snapshot_id in plan.saves:  # after their block, asked for by its step
            self._save(sid, snapshot_id, self.folders.snapshots)
        for sid, ending in plan.finishing:
            self._end(sid, ending)

    def _save(self, sid: str, snapshot_id: str, root: Path) -> None:
        """A session's snapshot at this block boundary, into the store at `root`: this rank copies its parts out now
        (the group's pause) and writes them in the background, its decoder's after the decode of its last block; the
        owner's intake publishes the snapshot once every rank's files are in (serving/saves)."""
        session = self.here[sid].engine
        start = time.perf_counter()
        parts = snapshots.session_parts(self.engine, session)
        log.info("rank %d: session %s saved at block %d into snapshot %s (pause %.1f ms)", self.rank, sid,
                 session.block_index, snapshot_id, (time.perf_counter() - start) * 1000.0)
        owner, writer = session.owner, self.writer
        self.decoder.snapshot(session.decoding, parts, lambda all_parts: writer.write(root, snapshot_id, owner,
                                                                                      all_parts))

    def _copy(self, owner: int, snapshot_id: str, parked: ResumeFrom) -> None:
        """A parked world (of rank `owner`) moved by a drain: this rank's files of its park copy are copied into the
        snapshot in the background (no block runs); the owner publishes it as any save."""
        copy = self.folders.opened(parked)
        self.writer.copy(self.folders.snapshots, snapshot_id, owner, copy.folder,
                         [e for e in copy.manifest.files if e.rank == self.rank])

    def _park(self, sid: str) -> None:
        """A world whose park copy is durable leaves its slot: its caches are freed here (its record stays)."""
        here = self.here[sid]
        session, here.engine, here.opened_s = here.engine, None, None
        held = session.cache_bytes()
        self.engine.close_session(session)
        log.info("rank %d: session %s parked off its slot after block %d; freed %d cache bytes", self.rank, sid,
                 session.block_index, held)

    def _hand_on_saves(self, written: list[FilesWritten], plan: Plan) -> None:
        """To this rank's intake, about the saves of the sessions it owns: every rank's files of them (news every
        rank sees), the saves whose block never runs, and the parks the group would not take."""
        for report in written:
            if report.owner == self.rank:
                self._to_intake(report)
        for owner, _, snapshot_id in plan.unsaved:
            if owner == self.rank:
                self._to_intake(mail.Unsaved(snapshot_id))
        for owner, _, snapshot_id, why in plan.refused_parks:
            if owner == self.rank:
                self._to_intake(mail.ParkRefused(snapshot_id, why))

    def _tell_places(self, plan: Plan) -> None:
        """After a plan: each session this rank owns whose place in the queue changed is told its new place (0: it has
        its slot) and its estimated wait; the group's counts go to the metrics hook when they changed."""
        now = time.monotonic()
        places = {s.id: n for n, s in enumerate(self.scheduler.waiting(), start=1)}
        moved = [(sid, here, places.get(sid, 0)) for sid, here in self.here.items() if here.owned]
        moved = [(sid, here, place) for sid, here, place in moved if place != here.told]
        if moved:
            waits = queue_waits(self.scheduler, self.clocks, self._opened_s(), now)
            for sid, here, place in moved:
                here.told = place
                self._to_intake(mail.Placed(sid, place, waits[place - 1] if place else 0.0))
        if self.hooks.on_queue is not None:
            opened = {s.id for s in plan.opens}
            waited = [now - here.submitted_s for sid, here in self.here.items() if here.owned and sid in opened]
            counts = QueueCounts.of(self.scheduler, self.settings, waited)
            if waited or counts != self._last_counts:
                self._last_counts = counts
                self.hooks.on_queue(counts)

    def _with_retry(self, refusal: Refusal) -> Refusal:
        """A full queue's refusal gets its retry time here, from this rank's measured block times: the wait of the
        place behind the line's last (the plan carries none: no plan depends on a clock)."""
        if refusal.code != c.CAPACITY_EXHAUSTED:
            return refusal
        wait = queue_waits(self.scheduler, self.clocks, self._opened_s(), time.monotonic(), extra=1)[-1]
        return dataclasses.replace(refusal, retry_after_s=retry_after_s(wait))

    def _opened_s(self) -> dict[str, float]:
        """When each session this rank holds was opened here."""
        return {sid: here.opened_s for sid, here in self.here.items() if here.opened_s is not None}

    def _set_prompt(self, session: Session, prompt: str) -> None:
        """A prompt event, at the same block on every rank (its step travelled to all as news)."""
        engine = self.engine
        hits, same = engine.prompts.hits, prompt == session.prompt
        try:
            engine.set_prompt(session, prompt)
        except Exception:  # the encode failed: every rank learns it in the same broadcast; the old prompt stays
            log.warning("rank %d: the prompt event of session %s failed; its prompt stays", self.rank, session.id,
                        exc_info=True)
            return
        log.info("rank %d: session %s from block %d on: prompt %r (prompt cache: %s)", self.rank, session.id,
                 session.block_index, prompt,
                 "unchanged" if same else "hit" if engine.prompts.hits > hits else "encoded")
        if self.hooks.on_prompts is not None:
            self.hooks.on_prompts(1, engine.prompts.hits - hits)

    def _open_all(self, opens: list[SharedSession]) -> None:
        """Open the plan's sessions here (a parked world from its park copy); one that fails is news for the next
        boundary, where every rank's scheduler ends it (it joins no batch before: a session runs from the boundary
        after its opening)."""
        for shared in opens:
            here = self.here.setdefault(shared.id, Here(owned=False))
            start = time.monotonic()
            try:
                here.engine = self._open(shared, here.saved)
                here.opened_s = time.monotonic()
                here.saved = None
            except SnapshotError as exc:  # refused by every rank alike (a damaged file, other settings)
                log.warning("rank %d: resuming session %s failed: %s", self.rank, shared.id, exc.refusal)
                self._failed.append((shared.id, Ending(EndReason.REJECTED, exc.refusal)))
                continue
            except Exception as exc:  # e.g. out of memory for this request: the session fails, not the group
                log.warning("rank %d: opening session %s failed", self.rank, shared.id, exc_info=True)
                self._failed.append((shared.id, Ending(EndReason.REJECTED, messages.open_failed(exc))))
                continue
            if not here.owned:
                continue
            self._to_intake(mail.Opened(shared.id))
            if shared.resume is not None and shared.resume.park is not None:
                log.info("rank %d: session %s unparked from %s after %.2f s in the queue, opened in %.2f s", self.rank,
                         shared.id, shared.resume.park.value, start - here.submitted_s, here.opened_s - start)
                if self.hooks.on_unpark is not None:
                    self.hooks.on_unpark(shared.id, start - here.submitted_s, here.opened_s - start)
            elif shared.resume is not None and self.hooks.on_snapshot is not None:
                self.hooks.on_snapshot("resumed")

    def _open(self, shared: SharedSession, saved: SharedState | None) -> Session:
        """A new session, or one resumed from its snapshot (a collective either way; `saved`: its shared file as its
        owner's admission read it, else read here)."""
        if (resume := shared.resume) is None:
            # A steered session keeps what its cached blocks were made of, for a prompt event's recache.
            return self.engine.open_session(shared.request, shared.geometry, shared.id, shared.owner,
                                            keep_commits=shared.steered and self.keep_commits)
        session = snapshots.resume(self.engine, self.folders.opened(resume), shared.geometry, shared.id, shared.owner,
                                   resume.fork_seed, saved)
        session.request = shared.request  # the snapshot's, with this connection's own (its sequence, outputs)
        return session

    def _end(self, sid: str, ending: Ending) -> None:
        """The scheduler ended a session: free its caches here; if this rank owns it, its intake answers what
        still waits (with the ending's error, or by closing the stream after its blocks)."""
        here = self.here.pop(sid, None)
        if here is None:  # neither owned nor opened here
            return
        if here.owned:
            told = self._with_retry(ending.told())  # the client's answer, and a late step's
            if self.hooks.on_ended is not None:
                self.hooks.on_ended(ending.reason.value)
            self.decoder.end(sid, None if ending.error is None else told, told)
        session = here.engine
        if session is None:  # never opened here
            return
        if not session.num_blocks:
            self.clocks.life.observe(time.monotonic() - here.opened_s)  # an open-ended session's life
        held = session.cache_bytes()
        self.engine.close_session(session)
        done = f"{session.block_index} of {session.num_blocks} blocks" if session.num_blocks else \
            f"{session.block_index} block{'' if session.block_index == 1 else 's'} (steered: no set length)"
        open_sessions = sum(h.engine is not None for h in self.here.values())
        log.info("rank %d: session %s %s after %s; freed %d cache bytes (left: %d); open sessions: %d", self.rank,
                 sid, ending.reason.value, done, held, session.cache_bytes(), open_sessions)

    def _close(self, reason: Refusal) -> None:
        """The loop ends: every session ends here; the intake answers every open stream and later request with
        `reason`, after the blocks the decode sender still holds."""
        self.scheduler.abort(Ending(EndReason.ABORTED, reason))
        for here in self.here.values():
            if here.owned and self.hooks.on_ended is not None:
                self.hooks.on_ended(EndReason.ABORTED.value)
            if here.engine is not None:
                self.engine.close_session(here.engine)
        self.here.clear()
        self.decoder.close()
        if self.writer is not None:  # what was handed over is written; a snapshot left unpublished expires
            self.writer.close()
        self._to_intake(mail.Closed(reason))
        self.engine = self.decoder.vae = None  # the weights go now: a reload may need the memory
        self.control.doorbell = LocalDoorbell()  # close the store connections too
        self.control.group = None  # and the control group's sockets


T = TypeVar("T")


def take_all(items: queue.SimpleQueue[T]) -> list[T]:
    """What the queue holds now, in order."""
    taken = []
    while True:
        try:
            taken.append(items.get_nowait())
        except queue.Empty:
            return taken
