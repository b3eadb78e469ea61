"""aiortc peers standing in for browser pages (the player's or a watcher's), for the tests of the bridge's video and
bench.delivery's watchers: each offers to receive the world's video with a data channel, decodes what comes and
keeps what the bridge says on the channel. Host candidates on loopback (`loopback_media`), as the bridge's."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import aioice.ice
import aiohttp
import aiortc.rtcrtpreceiver
from aiortc import RTCPeerConnection, RTCRtpSender, RTCSessionDescription
from aiortc.jitterbuffer import JitterFrame
from aiortc.mediastreams import MediaStreamError

BOUND_S = 30.0
T = TypeVar("T")


@contextlib.contextmanager
def loopback_media() -> Iterator[None]:
    """This process's aiortc peers (the bridge's too, in process) gather host candidates on 127.0.0.1 only."""
    before = aioice.ice.get_host_addresses
    aioice.ice.get_host_addresses = lambda use_ipv4, use_ipv6: ["127.0.0.1"]
    try:
        yield
    finally:
        aioice.ice.get_host_addresses = before


@dataclass(frozen=True)
class ReceivedFrame:
    """A video frame received whole, not decoded (`undecoded`)."""

    pts: int


class _Undecoded:
    def decode(self, encoded: JitterFrame) -> list[ReceivedFrame]:
        return [ReceivedFrame(encoded.timestamp)]


@contextlib.contextmanager
def undecoded() -> Iterator[None]:
    """This process's aiortc receivers hand on each video frame they receive whole without decoding it: peers that
    stand for other machines, whose decoding is their own (aiortc's receiver takes its decoder from this one
    function)."""
    before = aiortc.rtcrtpreceiver.get_decoder
    aiortc.rtcrtpreceiver.get_decoder = lambda codec: _Undecoded()
    try:
        yield
    finally:
        aiortc.rtcrtpreceiver.get_decoder = before


class Peer:
    def __init__(self, label: str = "controls", codecs: tuple[str, ...] | None = None) -> None:
        """codecs: the video codecs offered (None: aiortc's, H.264 and VP8)."""
        self.pc = RTCPeerConnection()
        transceiver = self.pc.addTransceiver("video", direction="recvonly")
        if codecs is not None:
            transceiver.setCodecPreferences([c for c in RTCRtpSender.getCapabilities("video").codecs
                                             if c.mimeType in (*codecs, "video/rtx")])
        self.channel = self.pc.createDataChannel(label)
        self.messages: list[dict] = []
        self.frames: list[int] = []  # the pts of each frame decoded (received, `undecoded`)
        self.track_ended = asyncio.Event()
        self.channel.on("message", lambda text: self.messages.append(json.loads(text)))
        self.pc.on("track", lambda track: asyncio.ensure_future(self._pull(track)))

    async def _pull(self, track) -> None:
        try:
            while True:
                self.frames.append((await track.recv()).pts)
        except MediaStreamError:
            self.track_ended.set()

    async def offer(self) -> str:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        return self.pc.localDescription.sdp

    async def accept(self, answer: str) -> None:
        await self.pc.setRemoteDescription(RTCSessionDescription(answer, "answer"))

    async def connected(self) -> None:
        """Until the connection is up and the channel open (TimeoutError after BOUND_S)."""
        up = asyncio.Event()

        def check() -> None:
            if self.pc.connectionState == "connected" and self.channel.readyState == "open":
                up.set()

        self.pc.on("connectionstatechange", check)
        self.channel.on("open", check)
        check()
        await asyncio.wait_for(up.wait(), BOUND_S)

    async def watch(self, session: aiohttp.ClientSession, base: str, link: str,
                    origin: str | None = "same") -> tuple[int, dict]:
        """Offer to watch `link` (/watch/ID) on the bridge at `base`: the HTTP status and the JSON answer; connected
        when the answer is one."""
        headers = {"Content-Type": "application/sdp"} | ({} if origin is None else
                                                           {"Origin": base if origin == "same" else origin})
        async with session.post(f"{base}{link}/offer", data=await self.offer(), headers=headers) as response:
            body = await response.json()
        if response.status == 200:
            await self.accept(body["sdp"])
            await self.connected()
        return response.status, body

    async def close(self) -> None:
        await self.pc.close()


class LoopThread:
    """An event loop on a thread of its own, for aiortc peers beside a synchronous test (Playwright's): `run` a
    coroutine on it and wait for its result. `nice`: the thread's niceness, which the threads it starts (aiortc's
    decoders) inherit."""

    def __init__(self, nice: int = 0) -> None:
        self.loop = asyncio.new_event_loop()
        self.nice = nice
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)  # Linux: a thread's own
        self.loop.run_forever()

    def __enter__(self) -> LoopThread:
        self._thread.start()
        return self

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float = BOUND_S * 2) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def __exit__(self, *exc_info: object) -> None:
        self.run(_cancel_the_rest())  # aiortc's tasks of closed peers (consent checks, DTLS), before the loop goes
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(BOUND_S)
        self.loop.close()


async def _cancel_the_rest() -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
