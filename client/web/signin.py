"""A page never holds a user's key: the user signs in with it once, the bridge checks it with the server and hands
the page a short-lived token in a cookie (HttpOnly: no script reads it; SameSite=Strict: no other site's page sends
it; Secure over HTTPS). The bridge keeps the key beside the token and sends it upstream on the page's behalf, so the
page's sessions run on that key's quotas; past its expiry the token opens nothing.
"""
from __future__ import annotations

import queue
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from backend.api import contract as c
from backend.api.refusal import Refusal
from client.connection import Connection
from client.stream import new_sequence_id, pack_inputs

COOKIE = "lingbot_session"
TOKEN_TTL_S = 3600.0  # a token's life: Reactor's tokens live at most 6 h; an hour here (serve --token-ttl)
MAX_TOKENS = 10_000  # tokens held at once (the oldest go first): sign-ins cannot grow the bridge without bound


@dataclass(frozen=True)
class Grant:
    key: str
    expires_s: float  # time.time()


class Tokens:
    """token -> the key it stands for, until its expiry (`clock`: time.time, or a test's)."""

    def __init__(self, ttl_s: float = TOKEN_TTL_S, clock: Callable[[], float] = time.time) -> None:
        self.ttl_s, self.clock = ttl_s, clock
        self._grants: dict[str, Grant] = {}

    def issue(self, key: str) -> tuple[str, Grant]:
        now = self.clock()
        self._grants = {t: g for t, g in self._grants.items() if g.expires_s > now}
        while len(self._grants) >= MAX_TOKENS:
            del self._grants[next(iter(self._grants))]
        token = secrets.token_urlsafe(32)
        self._grants[token] = grant = Grant(key, now + self.ttl_s)
        return token, grant

    def grant(self, token: str | None) -> Grant | None:
        """The live grant of a token, None for an unknown or expired one (which is forgotten)."""
        grant = self._grants.get(token or "")
        if grant is None:
            return None
        if grant.expires_s <= self.clock():
            del self._grants[token]
            return None
        return grant


def check_key(url: str, model: str, connection: Connection, timeout_s: float = 30.0) -> Refusal | None:
    """The server's door on `connection`'s key: a request with no inputs, which the door refuses for a bad key
    (AUTH_*) and the model for its missing inputs (no model work). None: the key opens the door."""
    answers: queue.Queue = queue.Queue()
    with connection.client(url) as client:
        client.start_stream(callback=lambda result, error: answers.put(error), headers=connection.headers())
        client.async_stream_infer(model, pack_inputs({c.SEED: np.array([0], np.int64)}),
                                  sequence_id=new_sequence_id(), sequence_start=True, sequence_end=True)
        try:
            error = answers.get(timeout=timeout_s)
        finally:
            client.stop_stream(cancel_requests=True)
    refusal = None if error is None else Refusal.parse(error.message())
    if error is not None and refusal is None:  # not the model's answer: the server could not be reached
        return Refusal(c.AUTH_INVALID, f"the key could not be checked: {error.message()}")
    return refusal if refusal is not None and refusal.code in (c.AUTH_REQUIRED, c.AUTH_INVALID) else None
