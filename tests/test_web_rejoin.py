"""A page back after a drop (client/web/rejoin): the app in this process on replayed worlds (bench/replay_world: a
block every BLOCK_S), pages on its websocket playing over JPEG. A page that drops or reloads gets its world back with
its rejoin token, the blocks going on where they stopped, bit for bit; past `reconnect_s` the world ends, its last
save named; a guessed, spent, expired or another key's token is refused with its code, and refusals lock no one out."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from backend.api.codec import SnapshotNotice
from bench.replay_world import ReplaySession, panned_scene
from client.web import app as web_app
from client.web import bridge
from client.web.app import Access, make_app
from client.web.codes import REJOIN_EXPIRED, REJOIN_REFUSED
from client.web.signin import Tokens
from polling import until

pytestmark = pytest.mark.timeout(90)

ORIGIN = "http://player.example"
SIZE = 32
CLIP = panned_scene(SIZE, SIZE, 48)
BLOCK_S = 0.25
BOUND_S = 30.0
BLOCKS = 8  # blocks compared between a run with a drop and one without
LOOKAHEAD = 1


class Page:
    """A page on the app's websocket: the JSON it got, and each block's JPEG frames (bytes) by block index."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws, self.messages, self.frames = ws, [], {}
        self.arrived: list[float] = []
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        block = None
        async for msg in self.ws:
            if msg.type == aiohttp.WSMsgType.TEXT:
                message = json.loads(msg.data)
                self.messages.append(message)
                self.arrived.append(time.monotonic())
                if message["type"] == "block":
                    block = message["index"]
                    assert block not in self.frames, f"block {block} sent twice"
                    self.frames[block] = []
            elif msg.type == aiohttp.WSMsgType.BINARY:
                self.frames[block].append(msg.data)

    def of(self, kind: str) -> list[dict]:
        return [m for m in self.messages if m["type"] == kind]

    async def next(self, kind: str) -> dict:
        await until(lambda: self.of(kind) or self.ws.closed, BOUND_S, f"a {kind!r} message")
        assert self.of(kind), self.messages
        return self.of(kind)[-1]

    async def blocks(self, count: int) -> None:
        await until(lambda: len(self.of("block")) >= count, BOUND_S, f"{count} blocks")


class SavingReplay(ReplaySession):
    """A replayed world whose saves are durable at once (the server's answer: the snapshot's id)."""

    def __init__(self, clip, block_s: float, on_snapshot) -> None:
        super().__init__(clip, block_s)
        self.on_snapshot = on_snapshot

    def step(self, controls, end: bool = False, save: bool = False) -> None:
        super().step(controls, end, save)
        if save:
            self.on_snapshot(SnapshotNotice(f"{len(self.steps):032x}"))


def saving_factory(made: list[ReplaySession]):
    def make(*args: object, on_snapshot=None, **kwargs: object) -> SavingReplay:
        made.append(session := SavingReplay(CLIP, BLOCK_S, on_snapshot))
        return session
    return make


@contextlib.asynccontextmanager
async def served(monkeypatch: pytest.MonkeyPatch, made: list[ReplaySession], reconnect_s: float = BOUND_S,
                 save_every: int = 0, **access: object) -> AsyncIterator[TestClient]:
    monkeypatch.setattr(bridge, "SteeredSession", saving_factory(made))
    app = make_app("127.0.0.1:1", "lingbot_world", BOUND_S, Access(frozenset({ORIGIN}), **access),
                   lookahead=LOOKAHEAD, save_every=save_every, reconnect_s=reconnect_s)
    async with TestClient(TestServer(app)) as client:
        yield client


async def page_of(client: TestClient | aiohttp.ClientSession, url="/ws", **params: str) -> Page:
    page = Page(await client.ws_connect(url, headers={"Origin": ORIGIN}, params=params or None))
    await until(lambda: page.messages or page.ws.closed, BOUND_S, "the bridge's first word")
    return page


async def started(client: TestClient, keys: str = "w") -> Page:
    page = await page_of(client)
    assert page.messages[0]["type"] == "session", page.messages
    await page.ws.send_json({"type": "keys", "keys": keys})  # held from the first step on
    await page.ws.send_json({"type": "start", "prompt": "a street", "height": SIZE, "width": SIZE, "keys": keys})
    return page


async def stopped(page: Page) -> None:
    await page.ws.send_json({"type": "stop"})
    await page.next("ended")


def run(coroutine) -> None:
    asyncio.run(asyncio.wait_for(coroutine, BOUND_S * 2))


async def away(page: Page) -> None:
    """The page's link goes (a reload, a drop): its socket closes."""
    await page.ws.close()
    await page.reader


def test_a_page_back_within_the_bound_plays_on_bit_for_bit_and_no_block_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that drops after 3 blocks for 8 block times and rejoins gives the blocks of a run without a drop: the
    same indices, none twice, the same JPEG bytes; while away the world makes only the blocks asked for, then waits."""
    async def uninterrupted() -> dict[int, list[bytes]]:
        async with served(monkeypatch, []) as client:
            page = await started(client)
            await page.blocks(BLOCKS)
            await stopped(page)
            return page.frames

    async def dropped() -> tuple[dict[int, list[bytes]], list[int], float]:
        made: list[ReplaySession] = []
        async with served(monkeypatch, made) as client:
            first = await started(client)
            await first.blocks(3)
            token, sid = first.of("session")[0]["rejoin"], first.of("session")[0]["id"]
            await away(first)
            await asyncio.sleep(BLOCK_S * 4)  # what the world makes away: the blocks asked for, no more
            steps = len(made[0].steps)
            await asyncio.sleep(BLOCK_S * 4)
            assert len(made[0].steps) == steps, "the world was stepped while its page was away"
            held = made[0]._block - len(first.of("block"))  # blocks made while away: held for the page
            assert 0 <= held <= LOOKAHEAD + 1, held
            back_at = time.monotonic()
            second = await page_of(client, rejoin=token, keys="w")
            session = second.of("session")[0]
            assert session["rejoined"] and session["id"] == sid and session["rejoin"] != token
            await second.blocks(held + 1)
            fresh_s = second.arrived[second.messages.index(second.of("block")[held])] - back_at
            await second.blocks(BLOCKS - len(first.of("block")))
            await stopped(second)
            assert all(step.keys == "w" for step in made[0].steps), made[0].steps
            indices = [b["index"] for p in (first, second) for b in p.of("block")]
            return {**first.frames, **second.frames}, indices, fresh_s

    async def both() -> None:
        want = await uninterrupted()
        got, indices, fresh_s = await dropped()
        assert indices == list(range(len(indices))), indices  # in order, none twice, none missing
        for index in range(BLOCKS):
            assert got[index] and got[index] == want[index], f"block {index} differs"
        assert fresh_s < BLOCK_S * 2 + 1.0, f"the first block made after the rejoin came {fresh_s:.2f} s after it"

    run(both())


def test_a_rejoin_while_the_old_socket_is_open_takes_the_world_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """A page whose old socket the bridge has not seen go (a link that dropped without a word) rejoins: the old
    socket is closed and the world plays on on the new one, each block on one of them, in order."""
    async def play() -> None:
        async with served(monkeypatch, made := []) as client:
            first = await started(client)
            await first.blocks(2)
            second = await page_of(client, rejoin=first.of("session")[0]["rejoin"], keys="w")
            assert second.of("session")[0]["rejoined"]
            await first.reader  # the bridge closed it
            await second.blocks(3)
            await stopped(second)
            indices = [b["index"] for p in (first, second) for b in p.of("block")]
            assert indices == list(range(len(indices))), indices
            assert len(made) == 1

    run(play())


def test_past_the_bound_the_world_ends_and_its_page_is_told_its_last_save(monkeypatch: pytest.MonkeyPatch) -> None:
    """Away past reconnect_s: the world's session is closed, its place freed (a second page gets it; before, the
    bridge of one place is busy), its token refused REJOIN_EXPIRED naming the last save, which resumes."""
    async def play() -> None:
        made: list[ReplaySession] = []
        async with served(monkeypatch, made, reconnect_s=1.0, save_every=2, max_pages=1) as client:
            page = await started(client)
            await until(lambda: page.of("snapshot"), BOUND_S, "a save")
            token = page.of("session")[0]["rejoin"]
            await away(page)
            busy = await page_of(client)
            assert busy.of("error")[0]["code"] == "PLAYER_BUSY"  # the world keeps its place while it waits
            await until(lambda: made[0]._closed, BOUND_S, "the world to end past reconnect_s")
            late = await page_of(client, rejoin=token)
            refusal = late.of("error")[0]
            last = [m["id"] for m in page.of("snapshot") if m["error"] is None][-1]
            assert refusal["code"] == REJOIN_EXPIRED and f"?resume={last}" in refusal["message"], refusal
            await late.reader  # one try a connection: the socket closes
            resumed = await page_of(client)  # its place is free
            await resumed.ws.send_json({"type": "start", "resume": last})
            await resumed.blocks(1)
            await stopped(resumed)

    run(play())


def test_guessed_spent_and_other_keys_tokens_are_refused_and_lock_no_one_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Signed-in pages: a guessed token, the token of another key's page, and a spent one are refused REJOIN_REFUSED,
    one try a connection; after 50 refused tries the page's own token still brings its world back."""
    monkeypatch.setattr(web_app, "check_key", lambda *args, **kwargs: None)  # every key opens the server's door
    monkeypatch.setattr(bridge, "SteeredSession", saving_factory(made := []))
    app = make_app("127.0.0.1:1", "lingbot_world", BOUND_S, Access(frozenset({ORIGIN})), lookahead=LOOKAHEAD,
                   save_every=0, tokens=Tokens())

    async def attack() -> None:
        async with TestClient(TestServer(app)) as alice, \
                aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as bob:
            def at(session, path: str):  # the test client takes paths, another session the server's URLs
                return path if session is alice else alice.make_url(path)

            for session, key in ((alice, "alice-key"), (bob, "bob-key")):
                async with session.post(at(session, "/signin"), json={"key": key}, headers={"Origin": ORIGIN}) as answer:
                    assert answer.status == 200, await answer.text()
            page = await started(alice)
            await page.blocks(2)
            token = page.of("session")[0]["rejoin"]
            await away(page)

            async def refused(session, token: str) -> str:
                tried = await page_of(session, at(session, "/ws"), rejoin=token)
                await tried.reader
                return tried.of("error")[0]["code"]

            assert await refused(bob, token) == REJOIN_REFUSED  # another key's page holds it: no use
            guesses = await asyncio.gather(*(refused(alice, f"{n:043d}") for n in range(50)))
            assert set(guesses) == {REJOIN_REFUSED}
            back = await page_of(alice, rejoin=token)
            assert back.of("session")[0]["rejoined"]
            await back.blocks(1)
            assert await refused(alice, token) == REJOIN_REFUSED  # spent: it worked once
            await stopped(back)
            assert len(made) == 1

    run(attack())
