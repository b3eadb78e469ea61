"""The owner rank's part of the fleet's shared books (serving/books): a lease for each session it owns whose key has
a limit the books count (`sessions`, `queue`, `blocks_per_hour`), the blocks those sessions received, and what the
books said of them. On the books thread (serving/bookkeeper), which owns it; what it learns goes to the intake, and
enters the plan as news (a session seated, a session over its key's hour), so every rank's scheduler plans alike and
none reads the store.

- A start takes a lease: a seat (it may hold a slot), a place in its key's queue (it waits in this group's queue, its
  slot given only once the books seat it), or a refusal (USER_SESSION_LIMIT, QUOTA_EXHAUSTED): before any work.
- Every tick (the books thread's, every half second): the blocks delivered since the last are added to their key's hour, and
  a key past its blocks_per_hour ends its sessions here; each waiting lease asks for a seat; every lease is renewed
  once a third of its life has passed, so a group that dies frees its keys' counts within `lease_s`.
- A session's end releases its lease.

Each call to the store is bounded (serving/books.CALL_TIMEOUT_S). A store that does not answer refuses new sessions
of keys with limits (BOOKS_UNAVAILABLE) and is asked again after `RETRY_S`; running sessions go on, their blocks
kept to be added once it answers, their leases renewed (or taken again, should it have lost them) then.
"""
from __future__ import annotations

import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from ..api.errors import Refused
from ..api.refusal import Refusal
from . import mail, messages
from .books import Books, BooksUnavailable
from .keys import Principal, Quota

RETRY_S = 1.0  # after the store did not answer, how long new sessions are refused before it is asked again

log = logging.getLogger(__name__)


@dataclass
class Lease:
    lease_id: str
    name: str
    quota: Quota
    seated: bool


def counted(quota: Quota) -> bool:
    """Whether the books count the key's sessions (its limits that span the fleet)."""
    return quota.sessions is not None or quota.queue is not None or quota.blocks_per_hour is not None


class Leases:
    """This rank's leases in the books (None: a lone group, whose books are in process: every call here is free)."""

    def __init__(self, books: Books | None, lease_s: float, tell: Callable[[mail.Seated | mail.OverQuota], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        """tell: where the books' news goes (from `tick`): the intake's `post`, which hands it on to the group loop."""
        self.books, self.lease_s, self.tell, self.clock = books, lease_s, tell, clock
        self._leases: dict[str, Lease] = {}  # by session id
        self._blocks: Counter[str] = Counter()  # by key name: delivered, not yet added to its hour
        self._over: set[str] = set()  # sessions already told to end for their key's hour
        self._down_until = 0.0  # the store did not answer: asked again after this (monotonic)
        self._renewed_s = clock()

    def take(self, session_id: str, who: Principal) -> bool:
        """A new session's lease: True seated, False waiting in its key's queue. Refused (its refusal) past the key's
        limits across the fleet, or while the books do not answer."""
        if self.books is None or not counted(who.quota):
            return True
        if self.clock() < self._down_until:
            raise Refused(messages.BOOKS_UNAVAILABLE)
        lease = Lease(secrets.token_hex(8), who.name, who.quota, True)
        taken = self._ask(lambda: self.books.take(who.name, lease.lease_id, who.quota, self.lease_s))
        if taken is None:
            raise Refused(messages.BOOKS_UNAVAILABLE)
        if taken.kind == "full":
            raise Refused(messages.user_session_limit(who.name, who.quota.sessions, who.quota.queue))
        if taken.kind == "blocks":
            raise Refused(messages.quota_exhausted(who.name, who.quota.blocks_per_hour, taken.retry_after_s))
        lease.seated = taken.kind == "seat"
        self._leases[session_id] = lease
        return lease.seated

    def delivered(self, session_id: str) -> None:
        """A block reached the session's client: it counts in its key's hour."""
        lease = self._leases.get(session_id)
        if lease is not None and lease.quota.blocks_per_hour is not None:
            self._blocks[lease.name] += 1

    def ended(self, session_id: str) -> None:
        """The session ended: its lease goes (should the store not answer, it expires within lease_s)."""
        self._over.discard(session_id)
        lease = self._leases.pop(session_id, None)
        if lease is not None and self.clock() >= self._down_until:
            self._ask(lambda: self.books.release(lease.name, lease.lease_id))

    def tick(self) -> None:
        """What the books say of this rank's sessions is told, news for the group loop: those seated now may hold a
        slot; those whose key used its hour across the fleet end. Leases are renewed when due."""
        if self.books is None or not self._leases or self.clock() < self._down_until:
            return
        for sid, why in self._add_blocks():
            self.tell(mail.OverQuota(sid, why))
        if seated := [sid for sid, lease in self._leases.items() if not lease.seated and self._promoted(lease)]:
            self.tell(mail.Seated(tuple(seated)))
        if self.clock() - self._renewed_s >= self.lease_s / 3:
            leases = [(lease.name, lease.lease_id, lease.seated) for lease in self._leases.values()]
            if self._ask(lambda: self.books.renew(leases, self.lease_s)) is not None:
                self._renewed_s = self.clock()

    def close(self) -> None:
        """The rank serves no more: every lease goes."""
        for sid in list(self._leases):
            self.ended(sid)

    def _add_blocks(self) -> list[tuple[str, Refusal]]:
        over = []
        for name, blocks in list(self._blocks.items()):
            hour = self._ask(lambda n=name, b=blocks: self.books.add_blocks(n, b))
            if hour is None:
                return over  # kept: added once the store answers
            del self._blocks[name]
            for sid, lease in self._leases.items():
                limit = lease.quota.blocks_per_hour
                if lease.name == name and hour.used >= limit and sid not in self._over:
                    self._over.add(sid)
                    over.append((sid, messages.quota_exhausted(name, limit, hour.retry_after_s(limit))))
        return over

    def _promoted(self, lease: Lease) -> bool:
        if self._ask(lambda: self.books.promote(lease.name, lease.lease_id, lease.quota.sessions, self.lease_s)):
            lease.seated = True
        return lease.seated

    def _ask(self, call: Callable[[], object]) -> object | None:
        """The store's answer, or None when it did not answer (then it is not asked again for RETRY_S)."""
        if self.clock() < self._down_until:
            return None
        try:
            answer = call()
        except BooksUnavailable as exc:
            if not self._down_until:
                log.warning("the books do not answer (%s): new sessions of keys with limits are refused; running "
                            "ones go on", exc)
            self._down_until = self.clock() + RETRY_S
            return None
        if self._down_until:
            log.info("the books answer again")
            self._down_until = 0.0
        return answer
