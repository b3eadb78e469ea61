"""The owner's side of the group on one rank: every request this rank receives and every reply it sends.

One thread (`lingbot-intake`) owns it all: the streams of the sessions this rank owns, the sequence-key index of
its steered sessions, the keys whose session ended (to tell a late step why), the owner's clocks of each
session's limits, their saves with the rank's snapshot store (serving/saves), and their parks with the park tier's
store in host memory (serving/parks). Triton's execute thread hands it each request (`arrive`); the group loop and
the decode sender hand it what to answer, and the loop the saves' files (`post`); it hands the group loop its news
(the loop's `post`, which rings the doorbell). It reads the open streams' cancelled flags before each block and every
`EVERY_S` (Triton's Python backend has no cancellation callback), and wakes for the soonest limit or park of its
steered sessions. Nothing here is shared with another thread: no lock.

Where the group shares the fleet's books, it never calls them: its books thread does (serving/bookkeeper), handed
the leases to take, count and release as letters. A start of a key with limits they count waits for its lease's
answer (in this inbox) before any work; the requests of its sequence that come meanwhile are answered after it, in
their order.
"""
from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..api import contract as c
from ..api.codec import SnapshotNotice
from ..api.errors import InputError, Refused
from ..api.refusal import Refusal
from ..api.request import ResumeRequest, SavesRequest, SessionRequest, StepRequest
from ..engine.snapshot.manifest import SnapshotError
from ..engine.snapshot.restore import SharedState
from . import key_saves, mail, messages
from .admission import Admission
from .bookkeeper import Bookkeeper
from .books import Books
from .keys import ANONYMOUS, KEY_NOT_THE_SESSIONS, Principal
from .leases import counted
from .news import FilesWritten, Parked, StepEvent
from .parks import Parks
from .saves import Outcome, Purpose, Saves
from .sequences import Sequences
from .sessions import OwnerPart, SharedSession, Status, Step
from .settings import ServingSettings
from .streams import Responder, SteeredStream, WholeStream

log = logging.getLogger(__name__)

EVERY_S = 0.5  # how often the open streams' cancelled flags are read
PLACE_RENEW_S = 1.0  # how often a parked world waiting for its slot back is told its place (clients' stall floor: 2 s)
_CLOSE = object()  # the intake's last letter


@dataclass
class Taking:
    """A start the admission let in that waits for its lease in the fleet's books before any work, with the requests
    of its sequence that came meanwhile."""

    shared: SharedSession
    saved: SharedState | None
    request: SessionRequest | ResumeRequest
    responder: Responder
    principal: Principal
    later: list[mail.Arrived] = field(default_factory=list)


class Intake:
    def __init__(self, rank: int, settings: ServingSettings, admission: Admission, saves: Saves,
                 to_loop: Callable[[mail.LoopLetter], None], inbox: queue.SimpleQueue | None = None,
                 every_s: float = EVERY_S, on_request: Callable[[str], None] = lambda name: None,
                 books: Books | None = None, parks: Parks | None = None) -> None:
        """saves: the ledger of this rank's saves (with its snapshot store); to_loop: the group loop's `post` (its
        inbox, then the doorbell); inbox: this intake's, made by the caller when the group loop must know it first;
        on_request: told the key's name of each request its door let in (the metrics by key); books: a client of the
        fleet's shared books, for this rank's books thread (None: the group's books are in process); parks: the
        ledger of this rank's parked worlds (None: one over `saves` alone, with no tier in memory)."""
        self.rank, self.settings, self.every_s = rank, settings, every_s
        self._on_request = on_request
        self._admission: Admission | None = admission
        self._saves = saves
        self._parks = parks or Parks(rank, settings, saves, None)
        self._to_loop = to_loop
        self._inbox: queue.SimpleQueue = inbox if inbox is not None else queue.SimpleQueue()
        self._books = None if books is None else Bookkeeper(books, settings.books_lease_s, self._inbox.put)
        self._parts: dict[str, OwnerPart] = {}  # the sessions this rank owns that have not ended, by id
        self._taking: dict[str, Taking] = {}  # starts waiting for their lease's answer, by session id
        self._sequences = Sequences()  # which session each Triton sequence steers, and how the last ones ended
        self._closed: Refusal | None = None  # the group loop has ended: what every request gets
        self._draining = False  # no new session is taken: the group moves its worlds elsewhere
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="lingbot-intake", daemon=True)
        self._thread.start()

    # -- any thread -------------------------------------------------------------------------------------------

    def arrive(self, key: str, request: SessionRequest | StepRequest | None, responder: Responder,
               refusal: Refusal | None = None, principal: Principal = ANONYMOUS) -> None:
        """A request as Triton handed it over (Triton's execute thread) with whose key it carries, or its refusal
        at the door or at parse."""
        self._inbox.put(mail.Arrived(key, request, responder, refusal, principal))

    def post(self, letter: mail.IntakeLetter) -> None:
        """What to answer, from the group loop or the decode sender."""
        self._inbox.put(letter)

    def close(self, timeout_s: float = 10.0) -> None:
        """Answer what is in the inbox, then end the thread (after the group loop has ended), and the books
        thread once it released every lease."""
        self._inbox.put(_CLOSE)
        self._thread.join(timeout_s)
        if self._books is not None:
            self._books.close()
            self._books.join(timeout_s)

    # -- the intake's thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        next_watch = time.monotonic() + self.every_s
        while True:
            timeout = max(0.0, min(next_watch, self._next_deadline()) - time.monotonic())
            try:
                letter = self._inbox.get(timeout=timeout)
            except queue.Empty:
                letter = None
            if letter is _CLOSE:
                return
            try:
                if letter is not None:
                    self._handle(letter)
                now = time.monotonic()
                if now >= next_watch:
                    self._watch_cancellations()
                    next_watch = now + self.every_s
                self._watch_limits(now)
                for park in () if self._draining else self._parks.start_due(self._parts, now):
                    self._to_loop(park)  # the group takes the world off its slot once its copy is durable
            except Exception:  # one client's reply channel failing must not stop the others'
                log.exception("rank %d: the intake failed to handle %r", self.rank, letter)

    def _handle(self, letter: mail.IntakeLetter) -> None:
        match letter:
            case mail.Arrived():
                self._arrived(letter)
            case mail.Decoded(sid, output, frames, decode_ms, final):
                if (part := self._parts.get(sid)) is not None and not self._cancelled(sid, part):
                    sent = part.stream.sent
                    part.stream.send_block(output, frames, decode_ms, final)
                    if part.leased:
                        self._books.post(mail.Block(sid))
                    self._delivered(sid, part, sent)
            case mail.Placed(sid, place, wait_s):
                if (part := self._parts.get(sid)) is not None:
                    part.stream.send_place(place, wait_s)
                    part.place = (place, wait_s, time.monotonic()) if place else None
            case mail.Opened(sid):
                if (part := self._parts.get(sid)) is not None:
                    part.opened = True
                    self._parks.back(sid)  # a parked world is on its slot again: its copy goes
            case mail.Ended(sid, error, told):
                if (part := self._parts.get(sid)) is not None:
                    part.ending = (error, told)
                    self._finish(sid, part)
            case FilesWritten():
                self._told(self._saves.written(letter))
            case mail.Unsaved(snapshot_id):
                self._told(self._saves.unsaved(snapshot_id))
            case mail.ParkRefused(snapshot_id, why):
                self._told(self._parks.refused(snapshot_id, why))
            case mail.Leased(sid, seated, refusal):
                self._leased(sid, seated, refusal)
            case mail.Seated(sids):  # after each one's Submitted (its lease's answer came first)
                if seated := tuple(sid for sid in sids if sid in self._parts):
                    self._to_loop(mail.Seated(seated))
            case mail.OverQuota(sid):
                if sid in self._parts:
                    self._to_loop(letter)
            case mail.Drain():
                self._drain()
            case mail.Closed(reason):
                self._close(reason)

    def _arrived(self, letter: mail.Arrived) -> None:
        key, request, responder, who = letter.key, letter.request, letter.responder, letter.principal
        if key and (taking := self._taking_of(key)) is not None:  # its sequence's start waits for the books
            taking.later.append(letter)
            return
        if who.name:  # its door let it in
            self._on_request(who.name)
        part = self._steered(key) if key else None
        if part is not None and part.principal.tag != who.tag:  # another key's sequence: it touches nothing
            responder.send_error(KEY_NOT_THE_SESSIONS)
            return
        if part is not None:  # a pause of this sequence is answered first
            part.stream.end_pause()
        if self._closed is not None:
            responder.send_error(self._closed)
        elif letter.refusal is not None:
            responder.send_error(letter.refusal)
        elif isinstance(request, StepRequest):
            self._step(request, responder)
        elif isinstance(request, SavesRequest):
            key_saves.answer(self._saves.store, request, who, responder)
        elif self._draining:
            responder.send_error(messages.DRAINING)
        else:
            self._submit(request, responder, who)

    def _submit(self, request: SessionRequest | ResumeRequest, responder: Responder, who: Principal) -> None:
        key = request.sequence_id
        if request.steered and self._sequences.session_of(key) is not None:
            responder.send_error(messages.session_exists(key))
            return
        sid = f"r{self.rank}-{next(self._ids)}"
        try:
            shared, saved = (self._admission.resume(request, sid, self.rank, who) if isinstance(request, ResumeRequest)
                             else (self._admission.session(request, sid, self.rank, who), None))
        except (InputError, SnapshotError, Refused) as exc:
            responder.send_error(exc.refusal)
            return
        taking = Taking(shared, saved, request, responder, who)
        if self._books is None or not counted(who.quota):
            self._start(sid, taking, seated=True, leased=False)
        else:  # the key's limits across the fleet, last before any work: the books thread asks them
            self._taking[sid] = taking
            self._books.post(mail.Lease(sid, who))

    def _leased(self, sid: str, seated: bool, refusal: Refusal | None) -> None:
        """The books' answer to a start's lease: it starts (seated, or waiting in its key's queue for its seat) or
        is refused; then the requests of its sequence that came meanwhile are answered, in order."""
        if (taking := self._taking.pop(sid, None)) is None:  # the group ended meanwhile: its lease went with it
            return
        if refusal is None and self._draining:  # no new session is taken
            self._books.post(mail.Release(sid))
            refusal = messages.DRAINING
        if refusal is not None:
            taking.responder.send_error(refusal)
        else:
            self._start(sid, taking, seated, leased=True)
        for letter in taking.later:
            self._arrived(letter)

    def _start(self, sid: str, taking: Taking, seated: bool, leased: bool) -> None:
        """An admitted session that its key's limits across the fleet let in is shared with the group (its first
        block's save reserved first, or the start is refused)."""
        shared, request, who = taking.shared, taking.request, taking.principal
        if not seated:
            shared.status = Status.WAITING_SEAT  # its first status, as its owner shares it
        first = shared.steps[0].controls if shared.steps else None
        if first is not None and first.save:
            try:
                shared.steps[0] = Step(first, self._saves.reserve(sid, shared.request, shared.geometry,
                                                                  Purpose.ASKED, first.release, who, first.share))
            except (InputError, SnapshotError) as exc:
                if leased:
                    self._books.post(mail.Release(sid))
                taking.responder.send_error(exc.refusal)
                return
        # A resumed session's blocks count on from its snapshot's, as the group loop's backpressure counts them.
        key = request.sequence_id
        stream = SteeredStream(taking.responder, shared.delivered) if request.steered else WholeStream(taking.responder)
        part = OwnerPart(stream, key if request.steered else None, principal=who, leased=leased,
                         request=shared.request, geometry=shared.geometry)
        self._parts[sid] = part
        if request.steered:
            self._sequences.start(key, sid)
        self._to_loop(mail.Submitted(shared, taking.saved))

    def _step(self, step: StepRequest, responder: Responder) -> None:
        """A step of a steered session this rank owns (Triton routes a sequence to one instance)."""
        key = step.sequence_id
        part = self._steered(key)
        if part is None:
            responder.send_error(messages.no_session(key, self._sequences.ending_of(key), step.pause))
            return
        if part.ending is not None:  # it ended; its saves' outcomes are not all told yet
            if step.pause:  # held open for them (a save's outcome is told on it), then closed with the ending
                part.stream.pause(responder)
            else:  # told how it ended, once they are
                part.late.append(responder)
            return
        stream: SteeredStream = part.stream
        if step.pause:  # no news for the scheduler: it changes no block
            stream.pause(responder)
            return
        sid = self._sequences.session_of(key)
        snapshot_id = None
        try:
            self._admission.step(step)
            if step.controls is not None and step.controls.save:  # reserved now, or the step is refused whole
                snapshot_id = self._saves.reserve(sid, part.request, part.geometry, Purpose.ASKED, step.controls.release,
                                                  part.principal, step.controls.share)
        except (InputError, SnapshotError) as exc:
            responder.send_error(exc.refusal)
            return
        if step.controls is not None:  # it plays: a park under way is dropped, a parked world comes back
            self._parks.asked(sid)
        if step.end:  # no step may follow: the sequence's next request is told so
            self._sequences.end(part.sequence_id, sid, messages.ENDED_BY_FLAG)
        sent = stream.sent
        if step.controls is not None:
            stream.add(responder)  # answered at once by a block computed ahead (held)
        else:  # an end flag alone: the request is answered when the session closes
            stream.add_closing(responder)
        self._to_loop(mail.Stepped(StepEvent(sid, step.controls, step.end, snapshot_id)))
        self._delivered(sid, part, sent)

    def _delivered(self, sid: str, part: OwnerPart, sent_before: int) -> None:
        """Tell the group loop when the client received blocks (a session held back by its client may run)."""
        if part.stream.sent > sent_before:
            self._to_loop(mail.Delivered(sid, part.stream.sent))

    def _told(self, outcome: Outcome | None) -> None:
        """A save is over (published, or dropped): its client is told (on a request it has open, else its next), a
        session the group drained ends MOVED only once its snapshot is durable (else it only ends)."""
        if outcome is None or (part := self._parts.get(outcome.session_id)) is None:
            return
        if outcome.purpose is Purpose.PARK:  # never told: the group takes the world off its slot, or it stays
            manifest = self._parks.saved(outcome, part.ending is not None)
            self._to_loop(Parked(outcome.session_id, outcome.snapshot_id, manifest))
        elif outcome.purpose is Purpose.ASKED:  # a move's id comes with MOVED
            error = None if outcome.error is None else outcome.error.message
            part.stream.send_notice(SnapshotNotice(outcome.snapshot_id, error))
        elif outcome.error is not None:
            part.move_dropped = True
        if part.ending is not None:
            self._finish(outcome.session_id, part)

    def _finish(self, sid: str, part: OwnerPart) -> None:
        """An ended session's stream closes, and its sequence's later requests are told how it ended, once its
        client has been told of every save it asked for: the one place a session's end is told, so a snapshot it
        names (MOVED's) is durable."""
        if self._saves.pending(sid):
            return
        error, told = part.ending
        if part.move_dropped and told.code == c.MOVED:  # nothing to resume: it only ends
            error = told = messages.DRAINING
        del self._parts[sid]
        if part.leased:
            self._books.post(mail.Release(sid))
        self._parks.forget(sid)  # a parked world's copy goes with it (unless MOVED names it)
        self._sequences.end(part.sequence_id, sid, told)
        part.stream.finish() if error is None else part.stream.send_error(error)
        self._answer_late(part, told)

    def _answer_late(self, part: OwnerPart, told: Refusal) -> None:
        """The steps of an ended session's sequence that came after its end: told how it ended."""
        for responder in part.late:
            responder.send_error(messages.no_session(part.sequence_id, told))
        part.late.clear()

    def _drain(self) -> None:
        """The server drains: no new session is taken, and every steered session this rank owns is saved where it
        stands (its snapshot reserved here) and moved: it ends MOVED with its snapshot's id. A whole trajectory
        runs to its end."""
        self._draining = True
        for sid, part in self._parts.items():
            if not part.steered or part.ending is not None:
                continue
            if (snapshot_id := self._parks.moved_from(sid)) is None:  # else a parked world's copy on disk
                try:
                    snapshot_id = self._saves.reserve(sid, part.request, part.geometry, Purpose.MOVE,
                                                      who=part.principal)
                except (InputError, SnapshotError) as exc:  # no store, or no room: it only ends
                    log.warning("rank %d: session %s cannot be saved as the server drains: %s", self.rank, sid,
                                exc.refusal)
            self._to_loop(mail.Moving(sid, snapshot_id))

    def _watch_cancellations(self) -> None:
        """Every `every_s`: the clients that went away; and a parked world that waits for its slot back is told its
        place again every PLACE_RENEW_S (its client's stall bound counts from its last response)."""
        now = time.monotonic()
        for sid, part in self._parts.items():
            if part.ending is None:
                self._cancelled(sid, part)
            if part.place is not None and now - part.place[2] >= PLACE_RENEW_S and self._parks.of(sid) is not None:
                place, wait_s, _ = part.place
                part.stream.send_place(place, wait_s)
                part.place = (place, wait_s, now)

    def _cancelled(self, sid: str, part: OwnerPart) -> bool:
        """Whether the session's client went away (read before each block it would be sent, and every
        `every_s`); the group loop is told once."""
        if part.cancel_told:
            return True
        if not part.stream.is_cancelled():
            return False
        part.cancel_told = True
        self._to_loop(mail.Cancelled(sid))
        return True

    def _watch_limits(self, now: float) -> None:
        """The owner's clock decides a steered session's limits; the decision travels as news, so every rank's
        scheduler ends it alike."""
        for sid, part in self._parts.items():
            if part.opened and part.steered and not part.expiry_told and part.ending is None and (
                    why := part.expiry(self.settings, now)) is not None:
                part.expiry_told = True
                self._to_loop(mail.Expired(sid, why))

    def _next_deadline(self) -> float:
        """The soonest idle or lifetime limit or park of the open steered sessions (monotonic seconds; inf: none)."""
        limits = (part.deadline(self.settings) for part in self._parts.values()
                  if part.opened and part.steered and not part.expiry_told and part.ending is None)
        parks = math.inf if self._draining else self._parks.next_due_of(self._parts)
        return min((*limits, parks), default=math.inf)

    def _taking_of(self, key: str) -> Taking | None:
        """The steered start of Triton sequence `key` that waits for its lease's answer."""
        return next((t for t in self._taking.values() if t.request.steered and t.request.sequence_id == key), None)

    def _steered(self, key: str) -> OwnerPart | None:
        """The steered session that takes the steps of Triton sequence `key`."""
        sid = self._sequences.session_of(key)
        return None if sid is None else self._parts[sid]

    def _close(self, reason: Refusal) -> None:
        """The group loop ended: every open stream gets `reason`, and so does every later request. The admission
        (the engine's spec) goes with it."""
        self._closed, self._admission = reason, None
        if self._books is not None:
            self._books.close()  # every lease goes
        takings, self._taking = list(self._taking.values()), {}
        for taking in takings:
            taking.responder.send_error(reason)
            for letter in taking.later:
                self._arrived(letter)
        for sid, part in self._parts.items():
            # A parked world whose copy is on disk goes on from it elsewhere: the copy is a durable snapshot.
            told = reason if (copy := self._parks.moved_from(sid)) is None else messages.moved(copy)
            self._sequences.end(part.sequence_id, sid, told)
            part.stream.send_error(told)
            self._answer_late(part, told)
            self._parks.forget(sid)
        self._parts.clear()
