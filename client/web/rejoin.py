"""A page's way back to its world after its link drops or it reloads.

Each page session holds one rejoin token (random, 256 bits, in the "session" message; the page keeps it in its
sessionStorage), bound to the page's sign-in key where the bridge asks for one. When the page's websocket goes, its
world waits `reconnect_s` for it; a websocket opened with `?rejoin=TOKEN` within that time takes the world back (a
still open older socket of the same page is closed) and gets a new token: each works once. Past `reconnect_s` the
world ends; its token is remembered (at most MAX_ENDED of them) so that its page is told so, with its last save.
"""
from __future__ import annotations

import asyncio
import hmac
import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from client.web.codes import REJOIN_EXPIRED, REJOIN_REFUSED, Refused

RECONNECT_S = 60.0  # how long a world waits for its page (serve --reconnect-s); Reactor keeps a session 30 s
MAX_ENDED = 1000  # tokens of worlds that ended while their page was away, remembered to say so

Held = TypeVar("Held")


@dataclass
class _Seat(Generic[Held]):
    held: Held
    key: str | None
    end: Callable[[], Awaitable[str | None]] | None = None  # while the page is away: the world's end...
    timer: asyncio.TimerHandle | None = None  # ... and when it comes


def _same_key(a: str | None, b: str | None) -> bool:
    return (a is None) == (b is None) and hmac.compare_digest((a or "").encode(), (b or "").encode())


class Rejoins(Generic[Held]):
    """token -> the world (`Held`: a page session) its page may take back, and its key."""

    def __init__(self, reconnect_s: float = RECONNECT_S) -> None:
        self.reconnect_s = reconnect_s
        self._seats: dict[str, _Seat[Held]] = {}
        self._ended: OrderedDict[str, tuple[str | None, str]] = OrderedDict()  # token -> its key, the sentence

    def issue(self, held: Held, key: str | None) -> str:
        """A new token for `held`, a page of `key` (None: the bridge asks for no sign-in)."""
        token = secrets.token_urlsafe(32)
        self._seats[token] = _Seat(held, key)
        return token

    def take(self, token: str, key: str | None) -> Held:
        """The world of `token` for a page of `key`; the token is spent. Refused: REJOIN_EXPIRED for a world that
        ended while its page was away, else REJOIN_REFUSED (guessed, spent, or another key's: one sentence)."""
        seat = self._seats.get(token)
        if seat is None or not _same_key(seat.key, key):
            ended = self._ended.get(token)
            if ended is not None and _same_key(ended[0], key):
                raise Refused(REJOIN_EXPIRED, ended[1])
            raise Refused(REJOIN_REFUSED, "this rejoin token opens no world here (a token works once, for its own "
                          "page): start a new world")
        del self._seats[token]
        if seat.timer is not None:
            seat.timer.cancel()
        return seat.held

    def away(self, token: str, end: Callable[[], Awaitable[str | None]]) -> None:
        """The page of `token` went: its world ends `reconnect_s` from now unless the token is taken first (`end`
        ends it and returns the id of its last save, or None)."""
        seat = self._seats[token]
        seat.end = end
        seat.timer = asyncio.get_running_loop().call_later(self.reconnect_s,
                                                          lambda: asyncio.ensure_future(self._expire(token)))

    def drop(self, token: str) -> None:
        """The world of `token` ended with its page there: nothing to rejoin."""
        seat = self._seats.pop(token, None)
        if seat is not None and seat.timer is not None:
            seat.timer.cancel()

    async def close(self) -> None:
        """The bridge stops: every world waiting for its page ends now."""
        for token in [t for t, seat in self._seats.items() if seat.end is not None]:
            await self._expire(token)

    async def _expire(self, token: str) -> None:
        seat = self._seats.pop(token, None)
        if seat is None or seat.end is None:
            return
        if seat.timer is not None:
            seat.timer.cancel()
        ended = f"your world ended: its page was away longer than {self.reconnect_s:g} s"
        self._ended[token] = (seat.key, ended)
        while len(self._ended) > MAX_ENDED:
            self._ended.popitem(last=False)
        if (last := await seat.end()) is not None:
            self._ended[token] = (seat.key, f"{ended}; its last save {last} resumes it (open the page with "
                                            f"?resume={last})")
