"""The bridge's video over WebRTC without a server: the app in this process on a replayed world (bench/replay_world:
frames made once, a block every BLOCK_S), aiortc peers for the pages and the watchers (bench/rtc_peers), and the
parts alone (the broadcast, the encoder, an offer's checks, the receivers' feedback, the ICE settings)."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import statistics
import time
from collections.abc import AsyncIterator

import aioice.ice
import aiohttp
import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError
from aiortc.rtp import RTCP_PSFB_APP, RTCP_PSFB_PLI, RtcpPsfbPacket, pack_remb_fci

from bench.replay_world import ReplaySession, panned_scene
from client.web import bridge
from client.web.app import WATCHING, Access, RtcSettings, make_app
from client.web.broadcast import SLACK_FRAMES, Broadcast, Viewer
from client.web.codes import Refused
from client.web.encoder import (FLOOR_BITRATE, H264, MAX_BITRATE, MIN_BITRATE, VIDEO_CLOCK, VP8, VideoEncoder, ceiling,
                                target)
from client.web.rate import Rate
from client.web.rtc import (MAX_SDP_BYTES, IceServers, bind_media, follow_feedback, media_addresses, read_offer,
                           without_mdns_candidates)
from polling import until
from bench.rtc_peers import Peer, loopback_media

pytestmark = pytest.mark.timeout(60)

ORIGIN = "http://player.example"  # the page's origin, the one the test app allows
SIZE = 64
CLIP = panned_scene(SIZE, SIZE, 48)
BLOCK_S = 0.25  # a replayed block's time: 12 frames every 0.25 s, faster than they play (0.75 s)
BOUND_S = 30.0
LIMITS = RtcSettings(max_watchers=3, max_watchers_per_world=2, offers_per_minute=4)


@pytest.fixture(autouse=True)
def loopback():
    with loopback_media():
        yield


class Page:
    """A page on the app's websocket: what the bridge sent (JSON and how many binary messages) and its video peer."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws, self.messages, self.binary, self.peer = ws, [], 0, None
        self.arrived: list[float] = []  # each JSON message's arrival (time.monotonic)
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type == aiohttp.WSMsgType.TEXT:
                self.messages.append(json.loads(msg.data))
                self.arrived.append(time.monotonic())
            elif msg.type == aiohttp.WSMsgType.BINARY:
                self.binary += 1

    def of(self, kind: str) -> list[dict]:
        return [m for m in self.messages if m["type"] == kind]

    async def next(self, kind: str) -> dict:
        count = len(self.of(kind))
        await until(lambda: len(self.of(kind)) > count or self.ws.closed, BOUND_S, f"a {kind!r} message")
        return self.of(kind)[-1]

    async def offer(self, peer: Peer) -> dict:
        self.peer = peer
        await self.ws.send_json({"type": "offer", "sdp": await peer.offer()})
        answer = await self.next("answer")
        await peer.accept(answer["sdp"])
        await peer.connected()
        return answer

    async def start(self, size: int = SIZE) -> None:
        """Start the world, its first frame the test scene at `size` (the replayed frames are the clip's)."""
        await self.ws.send_json({"type": "start", "prompt": "a street", "height": size, "width": size})


@contextlib.asynccontextmanager
async def served(monkeypatch: pytest.MonkeyPatch, made: list[ReplaySession], rtc: RtcSettings = LIMITS,
                 factory=None, origins: frozenset[str] = frozenset({ORIGIN})) -> AsyncIterator[TestClient]:
    """The app on replayed worlds (`factory`'s sessions, or the clip's every BLOCK_S), pages from `origins`."""
    monkeypatch.setattr(bridge, "SteeredSession", factory or ReplaySession.factory(CLIP, BLOCK_S, made))
    app = make_app("127.0.0.1:1", "lingbot_world", BOUND_S, Access(origins), save_every=0, rtc=rtc)
    async with TestClient(TestServer(app)) as client:
        yield client


async def page_of(client: TestClient) -> Page:
    page = Page(await client.ws_connect("/ws", headers={"Origin": ORIGIN}))
    await page.next("session")
    return page


async def watch_link(page: Page) -> str:
    await page.ws.send_json({"type": "watch"})
    return (await page.next("watch"))["path"]


def run(coroutine) -> None:
    asyncio.run(asyncio.wait_for(coroutine, BOUND_S * 2))


def headers_frames(page: Page) -> int:
    return sum(block["frames"] for block in page.of("block"))


def test_a_page_plays_over_webrtc_and_steers_on_its_data_channel(monkeypatch: pytest.MonkeyPatch) -> None:
    """H.264 when offered; the frames decode at the page, none come as JPEG; keys and stop on the data channel reach
    the world; each block's first frame on the video is told on the channel; timestamps 1/16 s apart."""
    made: list[ReplaySession] = []

    async def play() -> None:
        async with served(monkeypatch, made) as client:
            page = await page_of(client)
            answer = await page.offer(peer := Peer())
            assert answer["codec"] == H264
            await page.start()
            peer.channel.send(json.dumps({"type": "keys", "keys": "w"}))
            await until(lambda: len(peer.frames) >= 30 and len(page.of("block")) >= 4, BOUND_S, "30 frames decoded")
            peer.channel.send(json.dumps({"type": "stop"}))
            await page.next("ended")
            assert page.binary == 0  # no JPEG while the page plays over WebRTC
            assert any(step.keys == "w" for step in made[0].steps)
            on_air = [m["block"] for m in peer.messages if m["type"] == "on_air"]
            # Each block told once, in order (a block whose first frame a loaded machine dropped is not told).
            assert len(on_air) >= 3 and on_air == sorted(set(on_air)), on_air
            gaps = np.diff(peer.frames[5:30])
            assert abs(statistics.median(gaps) - VIDEO_CLOCK / 16) < VIDEO_CLOCK / 16 / 10, gaps
            await peer.close()

    run(play())


LOADED = 3  # pages playing beside the one that starts
FIRST_BLOCK_S = 2.0  # the starting page's server: its first block after this long
FIRST_WORD_S = 0.5


def test_a_page_is_told_starting_at_once_whatever_its_first_block_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """With LOADED pages playing (their frames as JPEG), a page starts a world whose first frame takes a while to
    draw (the test scene at the largest size a page may ask, 2048 x 2048: seconds) on a server slow with its first
    block (FIRST_BLOCK_S): it is told {"type": "starting"} within FIRST_WORD_S of its start, before that block."""
    made: list[ReplaySession] = []

    def factory(*args: object, **kwargs: object) -> ReplaySession:
        made.append(ReplaySession(CLIP, BLOCK_S if len(made) < LOADED else FIRST_BLOCK_S))
        return made[-1]

    async def play() -> tuple[float, float]:
        async with served(monkeypatch, made, factory=factory) as client:
            loaded = [await page_of(client) for _ in range(LOADED)]
            for other in loaded:
                await other.start()
            await until(lambda: all(len(p.of("block")) >= 2 for p in loaded), BOUND_S, "the other pages to play")
            page = await page_of(client)
            began = time.monotonic()
            await page.start(size=bridge.MAX_SIDE)
            await until(lambda: page.of("block"), BOUND_S, "the first block")
            kinds = [m["type"] for m in page.messages]
            assert kinds[1] == "starting", kinds  # after "session", before anything else
            assert page.messages[1]["text"] == "the server opens the session and computes its first block"
            assert all(p.binary and len(p.of("block")) >= 4 for p in loaded)  # they played meanwhile
            return page.arrived[1] - began, page.arrived[kinds.index("block")] - began

    told_s, first_block_s = asyncio.run(asyncio.wait_for(play(), BOUND_S * 2))
    print(f"told starting after {told_s:.3f} s, first block after {first_block_s:.3f} s")
    assert told_s < FIRST_WORD_S and first_block_s >= FIRST_BLOCK_S


def test_an_offer_without_h264_gets_vp8(monkeypatch: pytest.MonkeyPatch) -> None:
    async def play() -> None:
        async with served(monkeypatch, []) as client:
            page = await page_of(client)
            answer = await page.offer(peer := Peer(codecs=(VP8,)))
            assert answer["codec"] == VP8
            await page.start()
            await until(lambda: len(peer.frames) >= 10, BOUND_S, "VP8 frames decoded")
            await peer.close()

    run(play())


def test_a_page_without_webrtc_gets_jpeg_and_one_that_gives_it_up_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """No offer: every frame as a JPEG message. An offer, then "jpeg" (the page's WebRTC failed): JPEG from then on."""
    async def play() -> None:
        async with served(monkeypatch, []) as client:
            page = await page_of(client)
            await page.start()
            await until(lambda: len(page.of("block")) >= 3, BOUND_S, "3 blocks")
            await until(lambda: page.binary >= headers_frames(page), BOUND_S, "every frame as JPEG")
            late = await page_of(client)
            await late.offer(peer := Peer())
            await late.start()
            await until(lambda: len(late.of("block")) >= 2, BOUND_S, "2 blocks over WebRTC")
            assert late.binary == 0
            await late.ws.send_json({"type": "jpeg"})
            blocks = len(late.of("block"))
            await until(lambda: late.binary >= STEP_FRAMES * 2 and len(late.of("block")) >= blocks + 3, BOUND_S,
                        "JPEG after the page gave up WebRTC")
            assert peer.pc.connectionState in ("closed", "failed") or await until(
                lambda: peer.pc.connectionState in ("closed", "failed"), BOUND_S, "the page's connection closed")

    run(play())


STEP_FRAMES = 12


def test_watchers_share_the_world_s_one_encode_and_a_revoked_link_ends_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """A page and its 2 watchers (one joining later): one encoder, which encoded each frame that went out once;
    each watcher decodes frames. Revoke: each is told WATCH_REVOKED and its track ends; the link then serves no one."""
    async def play() -> None:
        async with served(monkeypatch, []) as client, aiohttp.ClientSession() as http:
            base = str(client.make_url("")).rstrip("/")
            page = await page_of(client)
            await page.offer(Peer())
            await page.start()
            link = await watch_link(page)
            early = Peer("watch")
            assert (await early.watch(http, base, link, ORIGIN))[0] == 200
            await until(lambda: len(early.frames) >= 12, BOUND_S, "the first watcher's frames")
            late = Peer("watch")
            assert (await late.watch(http, base, link, ORIGIN))[0] == 200
            await until(lambda: len(late.frames) >= 12, BOUND_S, "the second watcher's frames")
            broadcast = client.app[WATCHING].links[link.rsplit("/", 1)[1]].broadcast
            (encoder,) = broadcast.encoders.values()
            assert encoder.frames == broadcast.sent > len(late.frames)
            await page.ws.send_json({"type": "revoke"})
            assert (await page.next("watch")) == {"type": "watch", "id": None, "path": None, "revoked": 2}
            for watcher in (early, late):
                await until(lambda w=watcher: w.track_ended.is_set(), BOUND_S, "the watcher's track to end")
                assert [m["code"] for m in watcher.messages] == ["WATCH_REVOKED"], watcher.messages
            again = Peer("watch")
            status, body = await again.watch(http, base, link, ORIGIN)
            assert (status, body["code"]) == (404, "WATCH_UNKNOWN")
            for peer in (early, late, again):
                await peer.close()

    run(play())


def test_a_watch_link_asked_for_twice_is_revoked_with_the_world_s_one_link(monkeypatch: pytest.MonkeyPatch) -> None:
    """A player who asks for the watch link again is told a link that works; a revoke then ends every link it was
    told, the first too: no link of the world is left that a watcher could still open."""
    async def play() -> None:
        async with served(monkeypatch, []) as client, aiohttp.ClientSession() as http:
            base = str(client.make_url("")).rstrip("/")
            page = await page_of(client)
            await page.start()
            told = [await watch_link(page), await watch_link(page)]
            async with http.get(f"{base}{told[-1]}/ice") as response:
                assert response.status == 200
            await page.ws.send_json({"type": "revoke"})
            assert (await page.next("watch"))["id"] is None
            for link in told:
                async with http.post(f"{base}{link}/offer", data=b"v=0\r\n",
                                     headers={"Origin": ORIGIN, "Content-Type": "application/sdp"}) as response:
                    assert (response.status, (await response.json())["code"]) == (404, "WATCH_UNKNOWN"), link
            assert not client.app[WATCHING].links

    run(play())


def test_a_watcher_cannot_steer(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A crafted message on a watcher's data channel: refused with WATCH_READ_ONLY, logged, its connection closed;
    the world never ran the watcher's keys."""
    made: list[ReplaySession] = []

    async def play() -> None:
        async with served(monkeypatch, made) as client, aiohttp.ClientSession() as http:
            page = await page_of(client)
            await page.start()
            link = await watch_link(page)
            watcher = Peer("watch")
            assert (await watcher.watch(http, str(client.make_url("")).rstrip("/"), link, ORIGIN))[0] == 200
            watcher.channel.send(json.dumps({"type": "keys", "keys": "s"}))
            await until(lambda: watcher.messages, BOUND_S, "the refusal")
            assert watcher.messages == [{"type": "error", "code": "WATCH_READ_ONLY", "retry_after_s": None,
                                         "message": "watchers cannot steer: this link is read-only"}]
            await until(lambda: watcher.pc.connectionState in ("closed", "failed") or watcher.track_ended.is_set(),
                        BOUND_S, "the watcher's connection to close")
            await watcher.close()

    with caplog.at_level(logging.WARNING, logger="client.web"):
        run(play())
    assert "sent a message on its data channel: refused (WATCH_READ_ONLY)" in caplog.text
    assert not any("s" in (step.keys or "") for step in made[0].steps)


def test_watch_offers_are_refused_with_a_code_before_any_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """A guessed link, another origin, an offer too long (told by its length, or by its bytes; one at the limit in
    pieces is answered), one that is not SDP,
    watchers past the world's limit and the bridge's, an offer past the link's rate: each refused with its code and
    status; the world and its page play on and the bridge serves a new page."""
    async def attack() -> None:
        async with served(monkeypatch, []) as client, aiohttp.ClientSession() as http:
            base = str(client.make_url("")).rstrip("/")
            page = await page_of(client)
            await page.start()
            link = await watch_link(page)

            async def post(path: str, body: bytes, origin: str = ORIGIN, chunked: bool = False) -> tuple[int, dict]:
                async def chunks():  # no Content-Length: the body as it comes, in pieces
                    for at in range(0, len(body), 4096):
                        yield body[at:at + 4096]

                async with http.post(f"{base}{path}/offer", data=chunks() if chunked else body,
                                     headers={"Origin": origin, "Content-Type": "application/sdp"}) as response:
                    return response.status, await response.json()

            sdp = (await Peer("watch").offer()).encode()
            refused = [
                await post("/watch/" + "0" * 32, sdp), await post(link, sdp, origin="http://evil.example"),
                await post(link, b"v" * (MAX_SDP_BYTES + 1)), await post(link, b"v" * (MAX_SDP_BYTES + 1), chunked=True),
                await post(link, b"v=0\r\nnot sdp at all"),
            ]
            assert [(status, body["code"]) for status, body in refused] == [
                (404, "WATCH_UNKNOWN"), (403, "ORIGIN_REFUSED"), (413, "SDP_TOO_LARGE"), (413, "SDP_TOO_LARGE"),
                (400, "OFFER_INVALID")]
            assert all(body["message"] for _, body in refused)
            offer = (await (taker := Peer("watch")).offer()).encode()
            padded = offer + b"a=x-pad:" + b"p" * (MAX_SDP_BYTES - len(offer) - len(b"a=x-pad:\r\n")) + b"\r\n"
            assert (await post(link, padded, chunked=True))[0] == 200  # at the limit, in pieces: answered
            await taker.close()
            # A new link (its own 4 offers a minute): two watchers (the world's limit), two more refused as too many
            # for the world, a fifth as one offer too many for the minute. A second world's first watcher makes the
            # bridge's 3, its second is refused as one too many in all.
            await page.ws.send_json({"type": "revoke"})
            link = await watch_link(page)
            watchers = [Peer("watch") for _ in range(7)]
            answers = [await w.watch(http, base, link, ORIGIN) for w in watchers[:5]]
            assert [(s, b.get("code")) for s, b in answers] == [
                (200, None), (200, None), (503, "WATCHERS_FULL"), (503, "WATCHERS_FULL"), (429, "OFFERS_TOO_FAST")]
            assert "this world has its 2 watchers" in answers[2][1]["message"]
            assert 1 <= answers[4][1]["retry_after_s"] <= 60
            other = await page_of(client)
            await other.start()
            other_link = await watch_link(other)
            answers = [await w.watch(http, base, other_link, ORIGIN) for w in watchers[5:]]
            assert [(s, b.get("code")) for s, b in answers] == [(200, None), (503, "WATCHERS_FULL")]
            assert "this player has its 3 watchers" in answers[1][1]["message"]
            blocks = len(page.of("block"))
            await until(lambda: len(page.of("block")) >= blocks + 2, BOUND_S, "the world to play on")
            assert (await page_of(client)).of("session")
            for w in watchers:
                await w.close()

    run(attack())


class WhepClient:
    """A WHEP client (not the page: no data channel, no JSON): aiortc's RTCPeerConnection, its offer posted as
    application/sdp, the answer taken from the 201, the watching ended by a DELETE of the resource it names."""

    def __init__(self, http: aiohttp.ClientSession, base: str, audio: bool = False) -> None:
        """audio: it asks for sound beside the video, as WHEP players do."""
        self.http, self.base = http, base
        self.pc = RTCPeerConnection()
        if audio:
            self.pc.addTransceiver("audio", direction="recvonly")
        self.pc.addTransceiver("video", direction="recvonly")
        self.frames: list[np.ndarray] = []  # decoded, RGB
        self.resource: str | None = None
        self.pc.on("track", lambda track: asyncio.ensure_future(self._pull(track)))

    async def _pull(self, track) -> None:
        with contextlib.suppress(MediaStreamError):
            while True:
                self.frames.append((await track.recv()).to_ndarray(format="rgb24"))

    async def post(self, path: str, body: bytes | None = None, content_type: str = "application/sdp",
                   origin: str | None = ORIGIN) -> tuple[int, str, dict]:
        """POST an offer (its own, or `body`) to `path`: the status, the Content-Type and the body (the answer's
        SDP as {"sdp"}, or the refusal's JSON); a 201's answer taken and its resource kept."""
        if body is None:
            await self.pc.setLocalDescription(await self.pc.createOffer())
            body = self.pc.localDescription.sdp.encode()
        headers = {"Content-Type": content_type} | ({} if origin is None else {"Origin": origin})
        async with self.http.post(self.base + path, data=body, headers=headers) as response:
            text = await response.text()
            if response.status != 201:
                return response.status, response.content_type, json.loads(text)
            self.resource = response.headers["Location"]
        await self.pc.setRemoteDescription(RTCSessionDescription(text, "answer"))
        return response.status, response.content_type, {"sdp": text}

    async def delete(self, resource: str | None = None, origin: str | None = ORIGIN) -> tuple[int, dict | None]:
        headers = {} if origin is None else {"Origin": origin}
        async with self.http.delete(self.base + (resource or self.resource), headers=headers) as response:
            return response.status, await response.json() if response.status != 200 else None


def whep(link: str) -> str:
    return link + "/whep"


def closest_frame_error(frame: np.ndarray) -> float:
    """The mean absolute error of a decoded frame against the clip's frame it is nearest (0-255)."""
    return min(float(np.abs(frame.astype(int) - clip.astype(int)).mean()) for clip in CLIP)


def test_a_whep_client_watches_the_world_and_leaves_with_a_delete(monkeypatch: pytest.MonkeyPatch) -> None:
    """A standard WHEP exchange: POST of an application/sdp offer (audio and video, as WHEP players ask), 201 with
    the answer as application/sdp (its audio inactive: a world has no sound) and a Location; the client decodes the
    world's own frames; its DELETE ends its watching (200), the bridge's count of watchers goes back down, and a
    second DELETE of the resource is 404 WATCHER_UNKNOWN."""
    async def play() -> None:
        async with served(monkeypatch, []) as client, aiohttp.ClientSession() as http:
            base = str(client.make_url("")).rstrip("/")
            page = await page_of(client)
            await page.start()
            link = await watch_link(page)
            viewer = WhepClient(http, base, audio=True)
            status, content_type, body = await viewer.post(whep(link))
            assert (status, content_type) == (201, "application/sdp") and body["sdp"].startswith("v=0")
            media = [line for line in body["sdp"].splitlines()
                     if line.startswith("m=") or line in ("a=inactive", "a=sendonly")]
            assert [m.split()[0] for m in media] == ["m=audio", "a=inactive", "m=video", "a=sendonly"], media
            assert viewer.resource.startswith(whep(link) + "/") and len(viewer.resource.rsplit("/", 1)[1]) == 32
            assert client.app[WATCHING].watchers == 1
            await until(lambda: len(viewer.frames) >= 5, BOUND_S, "5 decoded frames at the WHEP client")
            assert viewer.frames[0].shape == (SIZE, SIZE, 3)
            assert max(closest_frame_error(f) for f in viewer.frames[:5]) < 12  # the world's picture, as encoded
            assert await viewer.delete() == (200, None)
            await until(lambda: client.app[WATCHING].watchers == 0, BOUND_S, "the watcher to be gone")
            status, refusal = await viewer.delete()
            assert (status, refusal["code"]) == (404, "WATCHER_UNKNOWN") and refusal["message"]
            blocks = len(page.of("block"))
            await until(lambda: len(page.of("block")) >= blocks + 2, BOUND_S, "the world to play on")
            await viewer.pc.close()

    run(play())


def test_whep_refusals_have_their_codes_and_a_guessed_resource_ends_no_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the WHEP endpoint the watch offer's limits, each with its code: an unknown link, another origin and
    none (a client outside a browser sends none: the bridge's origins only, as the watch offer), a wrong Content-Type,
    an offer too long, the world's watchers full; a DELETE of a guessed resource, or on another link, ends no one:
    the watcher it guessed at keeps its frames coming; a PATCH (trickled candidates) is 405; a revoked link serves no
    WHEP client; the world plays on."""
    async def attack() -> None:
        async with served(monkeypatch, []) as client, aiohttp.ClientSession() as http:
            base = str(client.make_url("")).rstrip("/")
            page = await page_of(client)
            await page.start()
            link = await watch_link(page)
            sdp = (await Peer("watch").offer()).encode()
            refused = [
                await WhepClient(http, base).post(whep("/watch/" + "0" * 32)),
                await WhepClient(http, base).post(whep(link), origin="http://evil.example"),
                await WhepClient(http, base).post(whep(link), origin=None),
                await WhepClient(http, base).post(whep(link), sdp, content_type="application/json"),
                await WhepClient(http, base).post(whep(link), sdp, content_type="text/plain"),
                await WhepClient(http, base).post(whep(link), b"v" * (MAX_SDP_BYTES + 1)),
            ]
            assert [(status, body["code"]) for status, _, body in refused] == [
                (404, "WATCH_UNKNOWN"), (403, "ORIGIN_REFUSED"), (403, "ORIGIN_REFUSED"), (415, "SDP_CONTENT_TYPE"),
                (415, "SDP_CONTENT_TYPE"), (413, "SDP_TOO_LARGE")]
            assert all(body["message"] for _, _, body in refused)
            viewers = [WhepClient(http, base) for _ in range(3)]
            answers = [(await v.post(whep(link)))[::2] for v in viewers]
            assert [(s, b.get("code")) for s, b in answers] == [(201, None), (201, None), (503, "WATCHERS_FULL")]
            watched = viewers[0]
            await until(lambda: len(watched.frames) >= 3, BOUND_S, "the first WHEP client's frames")
            own = watched.resource.rsplit("/", 1)[1]
            guesses = [whep(link) + "/" + "0" * 32, whep(link) + "/" + own[:-1] + ("0" if own[-1] != "0" else "1"),
                       whep(link) + "/" + own.upper(), whep("/watch/" + "0" * 32) + "/" + own,
                       whep(link) + "/" + viewers[1].resource.rsplit("/", 1)[1] + "x"]
            assert [(await watched.delete(g))[1]["code"] for g in guesses] == [
                "WATCHER_UNKNOWN", "WATCHER_UNKNOWN", "WATCHER_UNKNOWN", "WATCHER_UNKNOWN", "WATCHER_UNKNOWN"]
            assert (await watched.delete(origin="http://evil.example"))[1]["code"] == "ORIGIN_REFUSED"
            async with http.patch(base + watched.resource, data=b"a=ice-ufrag:x\r\n", headers={
                    "Origin": ORIGIN, "Content-Type": "application/trickle-ice-sdpfrag"}) as response:
                assert response.status == 405  # no trickled candidates: the offer comes whole
            assert client.app[WATCHING].watchers == 2
            frames = len(watched.frames)
            await until(lambda: len(watched.frames) >= frames + 5, BOUND_S, "the guessed-at watcher's frames")
            await page.ws.send_json({"type": "revoke"})
            assert (await page.next("watch"))["revoked"] == 2
            status, _, body = await WhepClient(http, base).post(whep(link))
            assert (status, body["code"]) == (404, "WATCH_UNKNOWN")
            assert (await watched.delete())[1]["code"] == "WATCHER_UNKNOWN"  # its link's end ended it
            blocks = len(page.of("block"))
            await until(lambda: len(page.of("block")) >= blocks + 2, BOUND_S, "the world to play on")
            for v in viewers:
                await v.pc.close()

    run(attack())


def test_a_whep_client_without_an_origin_watches_where_the_bridge_allows_any(monkeypatch: pytest.MonkeyPatch) -> None:
    """A WHEP client outside a browser sends no Origin: on a bridge that allows any (--allow-origin '*') it is
    answered, gets frames and leaves with its DELETE."""
    async def play() -> None:
        async with served(monkeypatch, [], origins=frozenset({"*"})) as client, aiohttp.ClientSession() as http:
            page = await page_of(client)
            await page.start()
            viewer = WhepClient(http, str(client.make_url("")).rstrip("/"))
            assert (await viewer.post(whep(await watch_link(page)), origin=None))[0] == 201
            await until(lambda: len(viewer.frames) >= 3, BOUND_S, "the WHEP client's frames")
            assert await viewer.delete(origin=None) == (200, None)
            await viewer.pc.close()

    run(play())


def test_whep_offers_and_watch_offers_share_a_link_s_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """The link's offers a minute count both kinds: 4 (the test's limit) across the two endpoints, then one more of
    either is refused with OFFERS_TOO_FAST and its retry time."""
    async def flood() -> None:
        async with served(monkeypatch, []) as client, aiohttp.ClientSession() as http:
            base = str(client.make_url("")).rstrip("/")
            page = await page_of(client)
            await page.start()
            link = await watch_link(page)
            garbage = b"v=0\r\nnot sdp"
            told = []
            for path in (whep(link), link + "/offer") * 2 + (whep(link), link + "/offer"):
                async with http.post(base + path, data=garbage, headers={"Origin": ORIGIN,
                                                                         "Content-Type": "application/sdp"}) as r:
                    told.append((r.status, (await r.json())["code"]))
            assert told == [(400, "OFFER_INVALID")] * 4 + [(429, "OFFERS_TOO_FAST")] * 2

    run(flood())


@pytest.mark.parametrize(("offer", "code"), [
    ("v" * (MAX_SDP_BYTES + 1), "SDP_TOO_LARGE"), ("not sdp", "OFFER_INVALID"), (None, "INVALID_MESSAGE")],
    ids=["oversized", "garbage", "not_text"])
def test_a_page_s_bad_offer_closes_its_socket_with_a_code(monkeypatch: pytest.MonkeyPatch, offer, code: str) -> None:
    async def attack() -> None:
        async with served(monkeypatch, []) as client:
            page = await page_of(client)
            await page.ws.send_json({"type": "offer", "sdp": offer if offer is not None else ["sdp"]})
            await until(lambda: page.ws.closed, BOUND_S, "the socket to close")
            assert page.of("error")[-1]["code"] == code and page.ws.close_code == aiohttp.WSCloseCode.POLICY_VIOLATION
            assert (await page_of(client)).of("session")  # the bridge serves on

    run(attack())


def test_a_flood_of_offers_from_a_page_is_cut_at_its_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    """4 offers a minute: each answered (a new one replaces the page's connection), the fifth refused with
    OFFERS_TOO_FAST and the socket closed; the bridge serves a new page."""
    async def flood() -> None:
        async with served(monkeypatch, []) as client:
            page = await page_of(client)
            sdp = await Peer().offer()
            for _ in range(5):
                await page.ws.send_json({"type": "offer", "sdp": sdp})
            await until(lambda: page.ws.closed, BOUND_S, "the socket to close")
            assert [m["type"] for m in page.messages[1:]] == ["answer"] * 4 + ["error"]
            assert page.of("error")[0]["code"] == "OFFERS_TOO_FAST"
            assert (await page_of(client)).of("session")

    run(flood())


# ---------------------------------------------------------------- the parts


def test_the_queue_holds_the_newest_block_and_slack_frames() -> None:
    async def push() -> Broadcast:
        broadcast = Broadcast()
        for block in range(3):
            broadcast.push(block, CLIP[:STEP_FRAMES])
        broadcast.push(3, CLIP[:0])  # a block without frames skips none
        broadcast.end()
        return broadcast

    assert asyncio.run(push()).skipped == 3 * STEP_FRAMES - (STEP_FRAMES + SLACK_FRAMES)


def test_viewers_start_at_a_keyframe_and_frames_go_out_at_16_fps() -> None:
    """One viewer from the start, one joining after 12 frames: each viewer's first packet is a keyframe, the one
    its join asked for, which the other gets too (the same packet); 24 frames take 23/16 s at least; the world's
    end ends every viewer's track."""
    async def watch() -> tuple[list, list, float]:
        loop = asyncio.get_running_loop()
        broadcast = Broadcast()
        first, second = Viewer(broadcast), Viewer(broadcast)
        first.codec = second.codec = H264
        broadcast.push(0, CLIP)
        began = loop.time()
        got_first = [await first.recv() for _ in range(12)]
        got_second = [await second.recv() for _ in range(6)]
        got_first += [await first.recv() for _ in range(12)]
        took = loop.time() - began
        broadcast.end()
        for viewer in (first, second):
            with pytest.raises(MediaStreamError):
                while True:  # what was queued, then the end
                    await viewer.recv()
        return got_first, got_second, took

    first, second, took = asyncio.run(asyncio.wait_for(watch(), BOUND_S))
    keyframes = [i for i, packet in enumerate(first) if packet.is_keyframe]
    assert keyframes[0] == 0 and len(keyframes) == 2, keyframes  # the start's, and the one the join asked for
    assert first[keyframes[1]] is second[0]  # the same packet: one encode for both
    assert not any(packet.is_keyframe for packet in second[1:])
    assert took >= 23 / 16


def test_after_a_wait_for_the_server_the_next_block_goes_out_at_the_world_s_pace() -> None:
    """A block, then the server is a second late with the next: the next block's frames go out 1/16 s apart again
    (its 12 take 11/16 s at least, their timestamps as far apart), not at once to catch up the time waited; its
    first frame's timestamp is the wait's length after the block before."""
    wait_s = 1.0

    async def watch() -> tuple[list[float], list[int], list[float], list[int]]:
        loop = asyncio.get_running_loop()
        broadcast = Broadcast()
        viewer = Viewer(broadcast)
        viewer.codec = H264

        async def block(index: int) -> tuple[list[float], list[int]]:
            broadcast.push(index, CLIP[:STEP_FRAMES])
            packets, times = [], []
            for _ in range(STEP_FRAMES):
                packets.append(await viewer.recv())
                times.append(loop.time())
            return times, [p.pts for p in packets]

        first_times, first_pts = await block(0)
        await asyncio.sleep(wait_s)  # the bridge waits for the server's next block
        times, pts = await block(1)
        broadcast.end()
        return first_times, first_pts, times, pts

    first_times, first_pts, times, pts = asyncio.run(asyncio.wait_for(watch(), BOUND_S))
    frame_ticks = VIDEO_CLOCK / 16
    assert times[-1] - times[0] >= (STEP_FRAMES - 1) / 16 * 0.95, times
    # Paced: the 12 frames' timestamps span 11 frame times and most are a frame apart (a catch-up sends them about 0
    # apart; on a busy machine a late wake-up brings one frame nearer the next, which keeps its time).
    gaps = sorted(b - a for a, b in zip(pts, pts[1:]))
    assert pts[-1] - pts[0] >= (STEP_FRAMES - 1) * frame_ticks * 0.95, pts
    assert gaps[len(gaps) // 2] >= frame_ticks * 0.9 and gaps[2] >= frame_ticks * 0.5, pts
    assert pts[0] - first_pts[-1] >= wait_s * VIDEO_CLOCK * 0.95


def test_a_lower_bitrate_makes_smaller_frames_and_a_change_starts_a_keyframe() -> None:
    """On frames that need every bit (noise), the floor makes less than half the bytes of the picture's ceiling (a
    higher estimate is held to it); the target moving by more than a tenth reopens the encoder (a keyframe), by a
    tenth or less it does not."""
    encoder = VideoEncoder(H264, 16)
    clip = np.random.default_rng(0).integers(0, 256, (71, 512, 512, 3), dtype=np.uint8)

    def run_at(bitrate: int, frames: range) -> tuple[int, list[bool]]:
        packets = [encoder.encode(clip[i], i * 5625, False, bitrate) for i in frames]
        return sum(p.size for ps in packets for p in ps), [any(p.is_keyframe for p in ps) for ps in packets]

    high, keys = run_at(MAX_BITRATE, range(0, 32))
    low, lowered = run_at(MIN_BITRATE, range(32, 64))  # held to the floor
    assert keys[0] and lowered[0] and not any(lowered[1:])
    assert low < high / 2 and high < 1.5 * ceiling(512, 512, 16) / 8 * 2  # 2 s of frames, within its ceiling
    assert not any(run_at(int(FLOOR_BITRATE * 1.1), range(64, 70))[1])
    assert encoder.encode(clip[0], 70 * 5625, True, FLOOR_BITRATE)[0].is_keyframe  # asked for


def test_a_picture_s_target_is_the_estimate_between_its_floor_and_its_ceiling() -> None:
    assert ceiling(832, 480, 16) == 1_916_928 and ceiling(1280, 720, 16) == 4_423_680
    assert ceiling(64, 64, 16) == MIN_BITRATE and ceiling(2048, 2048, 16) == MAX_BITRATE
    assert [target(estimate, 832, 480, 16) for estimate in (0, 700_000, 9_000_000)] == [
        FLOOR_BITRATE, 700_000, 1_916_928]
    assert target(9_000_000, 64, 64, 16) == target(0, 64, 64, 16) == MIN_BITRATE  # a tiny picture: its ceiling


def test_a_receiver_s_estimate_and_loss_reach_the_world_s_encoder(caplog: pytest.LogCaptureFixture) -> None:
    """REMB for this sender's SSRC sets the bitrate (another SSRC's does not), logged as it moves by more than a
    tenth; PLI asks for a keyframe."""
    async def feed() -> tuple[list, int]:
        pc = RTCPeerConnection()
        broadcast = Broadcast()
        viewer = Viewer(broadcast)
        sender = pc.addTransceiver(viewer, direction="sendonly").sender
        keyframes: list[int] = []
        follow_feedback(sender, lambda: keyframes.append(1), broadcast.follow)
        remb = RtcpPsfbPacket(fmt=RTCP_PSFB_APP, ssrc=1, media_ssrc=0)
        for bitrate, ssrc in ((750_000, sender._ssrc), (9_000_000, sender._ssrc + 1)):
            remb.fci = pack_remb_fci(bitrate, [ssrc])
            await sender._handle_rtcp_packet(remb)
        await sender._handle_rtcp_packet(RtcpPsfbPacket(fmt=RTCP_PSFB_PLI, ssrc=1, media_ssrc=sender._ssrc))
        await pc.close()
        broadcast.end()
        return keyframes, broadcast.bitrate

    with caplog.at_level(logging.INFO, logger="client.web"):
        assert asyncio.run(feed()) == ([1], 750_000)
    assert [r.getMessage() for r in caplog.records if "estimate" in r.getMessage()] == ["link estimate 750 kbit/s"]


def offer_of(codecs: tuple[str, ...] | None = None, audio: bool = False) -> str:
    """An aiortc page's offer (H.264 and VP8, or `codecs`); with `audio`, an audio line beside the video."""
    async def make() -> str:
        peer = Peer(codecs=codecs)
        if audio:
            peer.pc.addTransceiver("audio", direction="recvonly")
        sdp = await peer.offer()
        await peer.close()
        return sdp

    return asyncio.run(make())


def test_an_offer_is_checked_before_any_peer_connection() -> None:
    offer = offer_of()
    assert read_offer(offer).codec == H264 and read_offer(offer_of((VP8,))).codec == VP8
    padded = offer + "a=x-pad:" + "p" * (MAX_SDP_BYTES - len(offer) - len("a=x-pad:\r\n")) + "\r\n"
    assert len(padded) == MAX_SDP_BYTES and read_offer(padded).codec == H264  # at its limit
    for sdp, code in [(padded + "p", "SDP_TOO_LARGE"), (offer_of(audio=True), "OFFER_INVALID"),
                      (offer.replace("recvonly", "sendonly"), "OFFER_INVALID"),
                      ("m=video 9\r\na=rtpmap:x", "OFFER_INVALID"), (42, "OFFER_INVALID")]:
        with pytest.raises(Refused) as refused:
            read_offer(sdp)
        assert refused.value.code == code, sdp[:80] if isinstance(sdp, str) else sdp
    assert read_offer(offer_of(audio=True), audio=True).codec == H264  # a watcher's, sound asked for beside
    video, sound = offer_of(audio=True).split("m=audio")
    for sent in ("sendrecv", "sendonly"):  # ... but never sound sent to the bridge
        with pytest.raises(Refused, match=f"the offer's audio may only be received, not {sent}"):
            read_offer(video + "m=audio" + sound.replace("a=recvonly", f"a={sent}"), audio=True)


def test_a_page_s_mdns_candidates_are_left_out_and_then_its_end_of_candidates() -> None:
    """The bridge resolves no NAME.local (a multicast socket on every interface, a second's wait): it takes the
    page's address from its checks, and waits for them (no end of candidates) when it dropped any."""
    mdns = "a=candidate:1 1 udp 2113937151 0f3c-4a.local 50000 typ host generation 0\r\n"
    address = "a=candidate:2 1 udp 2113937151 192.0.2.9 50001 typ host generation 0\r\n"
    end = "a=end-of-candidates\r\n"
    assert without_mdns_candidates("v=0\r\n" + mdns + address + end) == "v=0\r\n" + address
    assert without_mdns_candidates("v=0\r\n" + address + end) == "v=0\r\n" + address + end
    taken = read_offer(offer_of().replace(end, mdns + end, 1)).sdp  # an offer with a page's mDNS candidate
    assert ".local" not in taken and "a=end-of-candidates" not in taken and "a=candidate:" in taken


def test_a_turn_credential_is_coturn_s_and_expires() -> None:
    ice = IceServers(("stun:stun.example:3478", "turn:turn.example:3478"), b"s3cret")
    stun, turn = ice.for_page("abc", now=1000.0)
    assert stun == {"urls": ["stun:stun.example:3478"]}
    assert turn["username"] == "44200:abc"  # valid for 12 h
    assert turn["credential"] == base64.b64encode(hmac.new(b"s3cret", b"44200:abc", hashlib.sha1).digest()).decode()
    with pytest.raises(ValueError, match="--turn-secret-file"):
        IceServers(("turn:turn.example:3478",))
    assert IceServers().for_page("abc") == []


def test_media_listens_on_the_bridge_s_address(monkeypatch: pytest.MonkeyPatch) -> None:
    assert media_addresses("127.0.0.1") == ["127.0.0.1"] and media_addresses("[::1]") == ["::1"]
    assert media_addresses("0.0.0.0") is None and "127.0.0.1" in media_addresses("localhost")
    monkeypatch.setattr(aioice.ice, "get_host_addresses", aioice.ice.get_host_addresses)
    bind_media(["127.0.0.1", "::1"])
    assert aioice.ice.get_host_addresses(True, False) == ["127.0.0.1"]
    assert aioice.ice.get_host_addresses(True, True) == ["127.0.0.1", "::1"]


def test_a_rate_takes_its_limit_then_says_when_it_takes_more() -> None:
    now = [0.0]
    rate = Rate(2, 60.0, clock=lambda: now[0])
    assert rate.take() is None and rate.take() is None and rate.take() == 60.0
    now[0] = 59.5
    assert rate.take() == pytest.approx(0.5)
    now[0] = 60.0
    assert rate.take() is None
