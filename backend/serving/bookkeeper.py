"""The owner rank's thread that talks to the fleet's books (`lingbot-books`), where its group shares them: the one
thread of the rank that calls the store, so a store slow to answer (each call bounded at books.CALL_TIMEOUT_S) never
holds the intake's thread, which sends every block.

It owns the rank's `Leases` (the books' client, a lease for each session of a key with limits, the blocks not yet
counted). The intake hands it letters (mail.Lease, mail.Block, mail.Release) in its inbox; it answers each start in
the intake's (mail.Leased), and every TICK_S tells the intake what the books say of the rank's sessions (mail.Seated,
mail.OverQuota), which the intake hands on to the group loop after the session's own news. Nothing here is shared
with another thread: no lock.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from ..api.errors import Refused
from . import mail
from .books import Books
from .leases import Leases

log = logging.getLogger(__name__)

TICK_S = 0.5  # how often the books are asked about this rank's sessions (their hour, their seats, their renewals)
_CLOSE = object()  # the books thread's last letter: every lease goes


class Bookkeeper:
    def __init__(self, books: Books, lease_s: float, to_intake: Callable[[mail.IntakeLetter], None],
                 tick_s: float = TICK_S) -> None:
        """to_intake: the intake's `post`, where the books' answers and news go."""
        self.tick_s = tick_s
        self._to_intake = to_intake
        self._leases = Leases(books, lease_s, to_intake)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="lingbot-books", daemon=True)
        self._thread.start()

    # -- any thread -------------------------------------------------------------------------------------------

    def post(self, letter: mail.BooksLetter) -> None:
        self._inbox.put(letter)

    def close(self) -> None:
        """Every lease goes, then the thread ends (letters posted after are never read)."""
        self._inbox.put(_CLOSE)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    # -- the books thread -------------------------------------------------------------------------------------

    def _run(self) -> None:
        next_tick = time.monotonic() + self.tick_s
        while True:
            try:
                letter = self._inbox.get(timeout=max(0.0, next_tick - time.monotonic()))
            except queue.Empty:
                letter = None
            if letter is _CLOSE:
                self._leases.close()
                return
            try:
                if letter is not None:
                    self._handle(letter)
                if time.monotonic() >= next_tick:  # the next TICK_S after this one ends: letters between
                    self._leases.tick()
                    next_tick = time.monotonic() + self.tick_s
            except Exception:  # one call's failure must not stop the others'
                log.exception("the books thread failed to handle %r", letter)

    def _handle(self, letter: mail.BooksLetter) -> None:
        match letter:
            case mail.Lease(sid, who):
                try:
                    self._to_intake(mail.Leased(sid, self._leases.take(sid, who)))
                except Refused as exc:
                    self._to_intake(mail.Leased(sid, False, exc.refusal))
            case mail.Block(sid):
                self._leases.delivered(sid)
            case mail.Release(sid):
                self._leases.ended(sid)
