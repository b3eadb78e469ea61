"""The bridge's own refusals and endings: one table, each code with its HTTP status, whether it carries a retry time,
when it is sent and what a program does about it. docs/player.md shows it as `render()` writes it (a test checks
that); the server's codes, which the page also shows, are in docs/api.md.

A refusal travels as {"type": "error", "code", "message", "retry_after_s"} on the page's websocket or a data channel,
and as the same object without "type" in an HTTP answer of its status.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BridgeCode:
    name: str
    http: int  # the status of an HTTP answer with this code
    retry: bool  # carries retry_after_s
    when: str
    then: str  # what the page or program does


PLAYER_BUSY = "PLAYER_BUSY"
INVALID_MESSAGE = "INVALID_MESSAGE"
ORIGIN_REFUSED = "ORIGIN_REFUSED"
SDP_TOO_LARGE = "SDP_TOO_LARGE"
SDP_CONTENT_TYPE = "SDP_CONTENT_TYPE"
OFFER_INVALID = "OFFER_INVALID"
OFFERS_TOO_FAST = "OFFERS_TOO_FAST"
WATCH_UNKNOWN = "WATCH_UNKNOWN"
WATCHERS_FULL = "WATCHERS_FULL"
WATCHER_UNKNOWN = "WATCHER_UNKNOWN"
WATCH_REVOKED = "WATCH_REVOKED"
WATCH_READ_ONLY = "WATCH_READ_ONLY"
WORLD_ENDED = "WORLD_ENDED"
REJOIN_REFUSED = "REJOIN_REFUSED"
REJOIN_EXPIRED = "REJOIN_EXPIRED"

CODES: tuple[BridgeCode, ...] = (
    BridgeCode(PLAYER_BUSY, 503, False, "`--max-pages` pages are open on this bridge", "retry later"),
    BridgeCode(INVALID_MESSAGE, 400, False, "a page's message does not fit the schema (client/web/schema.py) or the "
               "bridge cannot act on it (a start without a prompt, a picture it cannot read); the websocket closes",
               "fix the message"),
    BridgeCode(ORIGIN_REFUSED, 403, False, "a watcher's offer (or its WHEP DELETE) from a page of another origin, or "
               "with no Origin header, as a WHEP client outside a browser sends (`--allow-origin`)",
               "open the watch link on this bridge's own page, or start the bridge with `--allow-origin`"),
    BridgeCode(SDP_TOO_LARGE, 413, False, "an offer longer than `MAX_SDP_BYTES` (client/web/rtc.py); nothing of it "
               "was parsed",
               "send a smaller offer"),
    BridgeCode(SDP_CONTENT_TYPE, 415, False, "a WHEP offer whose Content-Type is not `application/sdp`",
               "send the offer as application/sdp"),
    BridgeCode(OFFER_INVALID, 400, False, "an offer that is not SDP, or asks for no video the bridge sends "
               "(H.264 or VP8)", "fix the offer; the page plays JPEG over its websocket"),
    BridgeCode(OFFERS_TOO_FAST, 429, True, "more offers than `--max-offers-per-minute` from one page or on one "
               "watch link", "retry after retry_after_s"),
    BridgeCode(WATCH_UNKNOWN, 404, False, "no world is watched with this id: it was never given out, its player "
               "revoked it, or the world ended", "ask the player for a new link"),
    BridgeCode(WATCHERS_FULL, 503, False, "the world has `--max-watchers-per-world` watchers, or the bridge "
               "`--max-watchers` in all", "retry later"),
    BridgeCode(WATCHER_UNKNOWN, 404, False, "a WHEP DELETE of a watcher resource this bridge does not hold: that "
               "watcher ended already (its DELETE, its link's end) or the resource was never given out", "none"),
    BridgeCode(WATCH_REVOKED, 410, False, "to a watcher: the player revoked the link; the stream ends",
               "ask the player for a new link"),
    BridgeCode(WATCH_READ_ONLY, 403, False, "a watcher sent a message on its data channel (watchers cannot steer); "
               "logged, and the watcher's connection closes", "none: watch only"),
    BridgeCode(WORLD_ENDED, 410, False, "to a watcher: the world's player stopped or closed its page; the stream ends",
               "none"),
    BridgeCode(REJOIN_REFUSED, 403, False, "a page's `?rejoin=TOKEN` names no world this bridge holds for it: a "
               "guessed token, one used already (each rejoin gets a new one), or one issued to another key; the "
               "websocket closes, one try a connection", "start a new world (or resume a saved one)"),
    BridgeCode(REJOIN_EXPIRED, 410, False, "a page's `?rejoin=TOKEN` of a world that ended because its page was away "
               "longer than `--reconnect-s`; the sentence names its last save where there is one; the websocket "
               "closes", "resume the last save (`?resume=ID`) or start a new world"),
)
BY_NAME: dict[str, BridgeCode] = {c.name: c for c in CODES}


class Refused(Exception):
    """A refusal of the bridge's: a code of CODES and its sentence (retry_after_s where the code carries one)."""

    def __init__(self, code: str, sentence: str, retry_after_s: float | None = None) -> None:
        spec = BY_NAME[code]
        if (retry_after_s is not None) != spec.retry:
            raise ValueError(f"{code} {'needs' if spec.retry else 'takes no'} retry_after_s")
        super().__init__(sentence)
        self.code, self.sentence, self.http = code, sentence, spec.http
        self.retry_after_s = None if retry_after_s is None else max(1, math.ceil(retry_after_s))

    def answer(self) -> dict[str, Any]:
        """The refusal as an HTTP answer's JSON body."""
        return {"code": self.code, "message": self.sentence, "retry_after_s": self.retry_after_s}

    def message(self) -> dict[str, Any]:
        """The refusal as a message to a page."""
        return {"type": "error"} | self.answer()


def render() -> str:
    """The table of codes, as docs/player.md holds it."""
    rows = ["| code | HTTP | retry | when | what the client does |", "| --- | --- | --- | --- | --- |"]
    rows += [f"| `{c.name}` | {c.http} | {'yes' if c.retry else ''} | {c.when} | {c.then} |" for c in CODES]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # python -m client.web.codes: the table to paste into docs/player.md
    sys.stdout.write(render())
