"""One page session on its websocket: its world (a Player), the world's video for WebRTC viewers (a Broadcast), the
page's own peer connection while it plays over WebRTC, and the world's watch link.

Page -> bridge on the websocket: the messages of `schema` ("offer" after its start when the page plays over
WebRTC; "jpeg" when its WebRTC failed); on the data channel the page opens (label "controls"): keys, event, save and stop
(CHANNEL_MESSAGES), the same JSON. Bridge -> page: what Player sends, and {"type": "answer", sdp, codec},
{"type": "watch", id, path} (id null and "revoked": the watchers told, after a revoke); on the data channel
{"type": "on_air", block, pts} when a block's first frame goes out on the video (pts: its RTP timestamp less the
stream's origin, 90 kHz). A block's frames go as JPEG on the websocket unless the page's peer connection is up (or
still connecting). While the page is away (its socket gone, client/web/rejoin) what the world tells is held for it,
in order, and sent when it is back.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from collections.abc import Callable
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, web
from aiortc import RTCDataChannel, RTCPeerConnection

from client.web.bridge import Player, start_request
from client.web.broadcast import Broadcast, Viewer
from client.web.codes import INVALID_MESSAGE, OFFERS_TOO_FAST, WATCH_REVOKED, WORLD_ENDED, Refused
from client.web.rate import Rate
from client.web.rtc import IceServers, answer, follow_feedback, read_offer
from client.web.schema import CHANNEL_MESSAGES, parse_message
from client.web.watch import Watching

CHANNEL_LABEL = "controls"
MAX_CHANNEL_CHARS = 8192  # a data channel message: a prompt event's prompt and its fields


class Page:
    def __init__(self, sid: str, ws: web.WebSocketResponse, player: dict[str, Any], watching: Watching,
                 ice: IceServers, offers_per_minute: int, may_start: Callable[[], str | None]) -> None:
        """player: the Player's settings; may_start: why a start may not go on now (a sign-in that expired), or
        None."""
        self.sid, self.ws, self.watching, self.ice, self.may_start = sid, ws, watching, ice, may_start
        self.broadcast = Broadcast(on_air=self._on_air)
        self.player = Player(**player, send=self.send, broadcast=self.broadcast, jpeg=self.jpeg)
        self.offers = Rate(offers_per_minute, 60.0)
        self.pc: RTCPeerConnection | None = None
        self.channel: RTCDataChannel | None = None
        self.watch_id: str | None = None
        self.world: asyncio.Task | None = None
        self.token = ""  # the page's rejoin token now (client/web/rejoin)
        self.refused = False  # the page broke the protocol: its world ends with its socket
        self.here = True  # the page's socket is up: what the world tells goes to it, else it is held
        self.held: deque[dict[str, Any] | bytes] = deque()  # for the page, while it is away (its blocks, in order)

    @property
    def playing(self) -> bool:
        """A world was started and has not told its end."""
        return self.world is not None and not self.world.done() and not self.player.over

    def jpeg(self) -> bool:
        """The world's frames go to the page as JPEG: it has no peer connection, or its connection failed."""
        return self.pc is None or self.pc.connectionState in ("failed", "closed")

    async def send(self, message: dict[str, Any] | bytes) -> None:
        """To the page; held for it while it is away (a send that fails: it has gone)."""
        if self.here:
            try:
                return await self._write(self.ws, message)
            except ConnectionError:
                self.away()
        self.held.append(message)

    @staticmethod
    async def _write(ws: web.WebSocketResponse, message: dict[str, Any] | bytes) -> None:
        await (ws.send_bytes(message) if isinstance(message, bytes) else ws.send_json(message))

    def away(self) -> None:
        """The page's socket went: the world sends nothing more to it, steps no more, and closes its video."""
        if self.here:
            self.here = False
            self.player.away()
            asyncio.ensure_future(self._close_peer())

    async def back(self, ws: web.WebSocketResponse, keys: str, first: dict[str, Any]) -> None:
        """The page is back on `ws` (its older socket, still open, is closed) holding `keys`: `first`, then what was
        held for it, then the world goes on (its video as JPEG until the page offers anew)."""
        old, self.ws = self.ws, ws
        self.away()
        if old is not ws:
            asyncio.ensure_future(old.close(code=WSCloseCode.GOING_AWAY, message=b"rejoined"))
        await self._close_peer()
        self.player.back(keys)
        self.held.appendleft(first)
        while self.held:  # what the world tells meanwhile joins the queue
            message = self.held.popleft()
            try:
                await self._write(ws, message)
            except ConnectionError:  # gone again
                self.held.appendleft(message)
                self.player.away()
                return
        self.here = True

    async def serve(self, ws: web.WebSocketResponse) -> None:
        """Read the page's messages on `ws` until it goes or breaks the protocol (then it is told why and closed)."""
        async for msg in ws:
            try:
                if msg.type == WSMsgType.ERROR:  # e.g. larger than MAX_MESSAGE_BYTES
                    raise ValueError(f"the bridge could not read a message ({msg.data})")
                if msg.type != WSMsgType.TEXT:
                    raise ValueError("the bridge takes JSON text messages only")
                await self.handle(parse_message(msg.data))
            except (Refused, ValueError) as exc:  # a page that breaks the protocol gets why, and the door
                if ws is self.ws:
                    await self.refuse(exc)
                break

    async def handle(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "start" and self.world is None:
            if (why := self.may_start()) is not None:
                raise ValueError(why)
            self.world = asyncio.create_task(self._play(start_request(message)))
        elif kind == "keys":
            self.player.hold(message.get("keys") or "")
        elif kind == "event":
            self.player.event(message.get("prompt") or "", bool(message.get("recache")))
        elif kind == "save":
            self.player.save()
        elif kind == "stop":
            self.player.stop()
        elif kind == "offer":
            await self._answer(message.get("sdp"))
        elif kind == "jpeg":
            await self._close_peer()
        elif kind == "watch":
            if self.broadcast.ended:
                raise Refused(WORLD_ENDED, "the world ended: there is nothing to watch")
            if self.watch_id not in self.watching.links:
                self.watch_id = self.watching.open(self.broadcast)
            await self.send({"type": "watch", "id": self.watch_id, "path": f"/watch/{self.watch_id}"})
        elif kind == "revoke":
            revoked = 0 if self.watch_id is None else await self.watching.end(
                self.watch_id, Refused(WATCH_REVOKED, "the player revoked this watch link"))
            self.watch_id = None
            await self.send({"type": "watch", "id": None, "path": None, "revoked": revoked})

    async def refuse(self, exc: Refused | ValueError) -> None:
        """Tell the page why, and close its websocket (a policy violation)."""
        refusal = exc if isinstance(exc, Refused) else Refused(INVALID_MESSAGE, str(exc))
        self.refused = True
        with contextlib.suppress(ConnectionError):
            await self.send(refusal.message())
        await self.ws.close(code=WSCloseCode.POLICY_VIOLATION, message=refusal.code.encode())

    async def close(self) -> None:
        """The page went: its world's task is cancelled (the caller closes the Player), its video and link end."""
        if self.world is not None:
            self.world.cancel()
        await self._end_video(drain=False)

    async def _play(self, request: Any) -> None:
        await self.player.play(request)  # to the world's end, told to the page (a cancel: the page went, see close)
        await self._end_video(drain=True)

    async def _end_video(self, drain: bool) -> None:
        """The world is over: its video ends (after the frames queued, with `drain`) and the page's connection
        closes, then its watchers'."""
        if drain:
            await self.broadcast.finish()
        self.broadcast.end()
        await self._close_peer()
        if self.watch_id is not None:
            watch_id, self.watch_id = self.watch_id, None
            await self.watching.end(watch_id, Refused(WORLD_ENDED, "the world ended: its player stopped or left"))

    async def _answer(self, sdp: object) -> None:
        if (wait := self.offers.take()) is not None:
            raise Refused(OFFERS_TOO_FAST, f"more than {self.offers.limit} offers a minute from this page",
                          retry_after_s=wait)
        offer = read_offer(sdp)
        await self._close_peer()  # a new offer replaces the page's connection
        viewer = Viewer(self.broadcast)
        self.pc = pc = await answer(offer, viewer, self.ice.configuration(self.sid))
        (sender,) = pc.getSenders()
        follow_feedback(sender, lambda: self.broadcast.request_keyframe(viewer.codec),
                        self.broadcast.follow)

        @pc.on("datachannel")
        def on_channel(channel: RTCDataChannel) -> None:
            if channel.label != CHANNEL_LABEL or self.channel is not None:
                channel.close()
                return
            self.channel = channel
            channel.on("message", lambda text: asyncio.ensure_future(self._from_channel(text)))

        await self.send({"type": "answer", "sdp": pc.localDescription.sdp, "codec": offer.codec})

    async def _from_channel(self, text: str | bytes) -> None:
        try:
            if not isinstance(text, str) or len(text) > MAX_CHANNEL_CHARS:
                raise ValueError(f"the data channel takes JSON text of at most {MAX_CHANNEL_CHARS} characters")
            message = parse_message(text)
            if message["type"] not in CHANNEL_MESSAGES:
                raise ValueError(f"the data channel carries {list(CHANNEL_MESSAGES)} only; {message['type']!r} goes "
                                 "on the websocket")
            await self.handle(message)
        except (Refused, ValueError) as exc:
            await self.refuse(exc)

    def _on_air(self, block: int, pts: int) -> None:
        if self.channel is not None and self.channel.readyState == "open":
            self.channel.send(json.dumps({"type": "on_air", "block": block, "pts": pts}))

    async def _close_peer(self) -> None:
        pc, self.pc, self.channel = self.pc, None, None
        if pc is not None:
            await pc.close()
