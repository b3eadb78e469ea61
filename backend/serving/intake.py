"""The owner's side of the group on one rank: every request this rank receives and every reply it sends.

One thread (`lingbot-intake`) owns it all: the streams of the sessions this rank owns, the sequence-key index of
its steered sessions, the keys whose session ended (to tell a late step why), and the owner's clocks of each
session's limits. Triton's execute thread hands it each request (`arrive`); the group loop and the decode sender
hand it what to answer (`post`); it hands the group loop its news (the loop's `post`, which rings the doorbell).
It reads the open streams' cancelled flags before each block and every `EVERY_S` (Triton's Python backend has no
cancellation callback), and wakes for the soonest limit of its steered sessions. Nothing here is shared with
another thread: no lock.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from ..api.codec import SnapshotNotice
from ..api.errors import InputError
from ..api.refusal import Refusal
from ..api.request import Controls, ResumeRequest, SessionRequest, StepRequest
from ..engine.snapshot.manifest import SnapshotError
from . import mail, messages
from .admission import Admission
from .settings import ServingSettings
from .keys import ANONYMOUS, KEY_NOT_THE_SESSIONS, Principal
from .scheduler import StepEvent
from .sessions import OwnerPart
from .streams import Responder, SteeredStream, WholeStream

log = logging.getLogger(__name__)

EVERY_S = 0.5  # how often the open streams' cancelled flags are read
KEEP_ENDED = 1024  # sequence keys whose session ended, remembered to tell a late step why
_CLOSE = object()  # the intake's last letter


class Intake:
    def __init__(self, rank: int, settings: ServingSettings, admission: Admission,
                 to_loop: Callable[[mail.LoopLetter], None], inbox: queue.SimpleQueue | None = None,
                 every_s: float = EVERY_S) -> None:
        """to_loop: the group loop's `post` (its inbox, then the doorbell); inbox: this intake's, made by the caller
        when the group loop must know it first."""
        self.rank, self.settings, self.every_s = rank, settings, every_s
        self._admission: Admission | None = admission
        self._to_loop = to_loop
        self._inbox: queue.SimpleQueue = inbox if inbox is not None else queue.SimpleQueue()
        self._parts: dict[str, OwnerPart] = {}  # the sessions this rank owns that have not ended, by id
        self._running: dict[str, str] = {}  # Triton sequence key -> its steered session that takes the steps
        self._ended_keys: OrderedDict[str, Refusal] = OrderedDict()  # key -> what a late step of it is told
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
        """Answer what is in the inbox, then end the thread (after the group loop has ended)."""
        self._inbox.put(_CLOSE)
        self._thread.join(timeout_s)

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
                    self._delivered(sid, part, sent)
            case mail.Placed(sid, place, wait_s):
                if (part := self._parts.get(sid)) is not None:
                    part.stream.send_place(place, wait_s)
            case mail.Opened(sid):
                if (part := self._parts.get(sid)) is not None:
                    part.opened = True
            case mail.Ended(sid, error, told):
                if (part := self._parts.get(sid)) is not None:
                    part.ending = (error, told)
                    self._finish(sid, part)
            case mail.Saved(sid, snapshot_id, error):
                if (part := self._parts.get(sid)) is not None:
                    self._saved(sid, part, snapshot_id, error)
            case mail.Drain():
                self._drain()
            case mail.Closed(reason):
                self._close(reason)

    def _arrived(self, letter: mail.Arrived) -> None:
        key, request, responder, who = letter.key, letter.request, letter.responder, letter.principal
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
        elif self._draining:
            responder.send_error(messages.DRAINING)
        else:
            self._submit(request, responder, who)

    def _submit(self, request: SessionRequest | ResumeRequest, responder: Responder, who: Principal) -> None:
        key = request.session_key
        if request.steered and key in self._running:
            responder.send_error(messages.session_exists(key))
            return
        sid = f"r{self.rank}-{next(self._ids)}"
        try:
            shared = (self._admission.resume(request, sid, self.rank, who) if isinstance(request, ResumeRequest)
                      else self._admission.session(request, sid, self.rank, who))
            first = shared.steps[0] if shared.steps else None
            saving = first.save if first is not None else False
            if saving:  # the first block's save: its snapshot is reserved now, or the start is refused
                first.snapshot_id = self._admission.reserve(shared.request, shared.geometry)
        except (InputError, SnapshotError) as exc:
            responder.send_error(exc.refusal)
            return
        # A resumed session's blocks count on from its snapshot's, as the group loop's backpressure counts them.
        stream = SteeredStream(responder, shared.delivered) if request.steered else WholeStream(responder)
        part = OwnerPart(stream, key if request.steered else None, principal=who, request=shared.request,
                         geometry=shared.geometry)
        if saving:
            self._saving(part, first)
        self._parts[sid] = part
        if request.steered:
            self._running[key] = sid
        self._to_loop(mail.Submitted(shared))

    def _step(self, step: StepRequest, responder: Responder) -> None:
        """A step of a steered session this rank owns (Triton routes a sequence to one instance)."""
        key = step.session_key
        part = self._steered(key)
        if part is None:
            responder.send_error(messages.no_session(key, self._ended_keys.get(key, messages.NEVER_STARTED),
                                                     step.pause))
            return
        if part.ending is not None:  # it ended; its saves' outcomes are not all told: answered once they are
            part.late.append((responder, step.pause))
            return
        stream: SteeredStream = part.stream
        if step.pause:  # no news for the scheduler: it changes no block
            stream.pause(responder)
            return
        try:
            self._admission.step(step)
            if step.controls is not None and step.controls.save:  # reserved now, or the step is refused whole
                step.controls.snapshot_id = self._admission.reserve(part.request, part.geometry)
        except (InputError, SnapshotError) as exc:
            responder.send_error(exc.refusal)
            return
        sid = self._running[key]
        if step.controls is not None and step.controls.snapshot_id is not None:
            self._saving(part, step.controls)
        if step.end:  # no step may follow: the sequence's next request is told so
            self._forget_key(part, sid, messages.ENDED_BY_FLAG)
        sent = stream.sent
        if step.controls is not None:
            stream.add(responder)  # answered at once by a block computed ahead (held)
        else:  # an end flag alone: the request is answered when the session closes
            stream.add_closing(responder)
        self._to_loop(mail.Stepped(StepEvent(sid, step.controls, step.end)))
        self._delivered(sid, part, sent)

    def _delivered(self, sid: str, part: OwnerPart, sent_before: int) -> None:
        """Tell the group loop when the client received blocks (a session held back by its client may run)."""
        if part.stream.sent > sent_before:
            self._to_loop(mail.Delivered(sid, part.stream.sent))

    def _saving(self, part: OwnerPart, controls: Controls) -> None:
        """A save under way; the older snapshot it releases goes once it is durable."""
        part.saves.add(controls.snapshot_id)
        if controls.release:
            part.releases[controls.snapshot_id] = controls.release

    def _saved(self, sid: str, part: OwnerPart, snapshot_id: str, error: Refusal | None) -> None:
        """A save of the session is over: its client is told (on a request it has open, else its next); a session
        the group drained ends with MOVED only when its snapshot is durable."""
        part.saves.discard(snapshot_id)
        if (older := part.releases.pop(snapshot_id, None)) is not None and error is None:
            self._admission.release(older)
        if snapshot_id != part.moved_to:  # a save its client asked for (a move's id comes with MOVED)
            part.stream.send_notice(SnapshotNotice(snapshot_id, None if error is None else error.message))
        elif error is not None and part.ending is not None:  # nothing to resume: it only ends
            part.ending = (messages.DRAINING, messages.DRAINING)
        if part.ending is not None:
            self._finish(sid, part)

    def _finish(self, sid: str, part: OwnerPart) -> None:
        """An ended session's stream closes, and its sequence's later requests are told how it ended, once its
        client has been told of every save it asked for: the one place a session's end is told, so a snapshot it
        names (MOVED's) is durable."""
        if part.saves:
            return
        error, told = part.ending
        del self._parts[sid]
        self._forget_key(part, sid, told)
        part.stream.finish() if error is None else part.stream.send_error(error)
        self._answer_late(part, told)

    def _answer_late(self, part: OwnerPart, told: Refusal) -> None:
        """The requests of an ended session's sequence that came after its end: told how it ended."""
        for responder, pause in part.late:
            responder.send_error(messages.no_session(part.sequence_key, told, pause))
        part.late.clear()

    def _drain(self) -> None:
        """The server drains: no new session is taken, and every steered session this rank owns is saved where it
        stands (its snapshot reserved here) and moved: it ends MOVED with its snapshot's id. A whole trajectory
        runs to its end."""
        self._draining = True
        for sid, part in self._parts.items():
            if not part.steered or part.ending is not None:
                continue
            try:
                snapshot_id = self._admission.reserve(part.request, part.geometry)
            except (InputError, SnapshotError) as exc:  # no store, or no room: it only ends
                log.warning("rank %d: session %s cannot be saved as the server drains: %s", self.rank, sid,
                            exc.refusal)
                snapshot_id = None
            if snapshot_id is not None:
                part.saves.add(snapshot_id)
                part.moved_to = snapshot_id
            self._to_loop(mail.Moving(sid, snapshot_id))

    def _watch_cancellations(self) -> None:
        for sid, part in self._parts.items():
            if part.ending is None:
                self._cancelled(sid, part)

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
        """The soonest idle or lifetime limit of the open steered sessions (monotonic seconds; inf: none)."""
        return min((part.deadline(self.settings) for part in self._parts.values()
                    if part.opened and part.steered and not part.expiry_told and part.ending is None),
                   default=float("inf"))

    def _steered(self, key: str) -> OwnerPart | None:
        """The steered session that takes the steps of Triton sequence `key`."""
        sid = self._running.get(key)
        return None if sid is None else self._parts[sid]

    def _forget_key(self, part: OwnerPart, sid: str, ending: Refusal) -> None:
        """Sequence `part.sequence_key` no longer steers session `sid`; a late request is told `ending`."""
        key = part.sequence_key
        if key is None:
            return
        if self._running.get(key) == sid:
            del self._running[key]
        self._ended_keys[key] = ending
        self._ended_keys.move_to_end(key)
        while len(self._ended_keys) > KEEP_ENDED:
            self._ended_keys.popitem(last=False)

    def _close(self, reason: Refusal) -> None:
        """The group loop ended: every open stream gets `reason`, and so does every later request. The admission
        (the engine's spec) goes with it."""
        self._closed, self._admission = reason, None
        for sid, part in self._parts.items():
            self._forget_key(part, sid, reason)
            part.stream.send_error(reason)
            self._answer_late(part, reason)
        self._parts.clear()
