"""Who may open a session on the browser bridge (client/web/app.Access, as `python -m client serve` builds it),
against look-alikes of the origins and token it allows: a prefix, a suffix, another scheme, a port that is a prefix
of another; and the files it serves. No server: a mocked websocket request, or the app in this process."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from client.web.serve import access, parse_args


def refusal(argv: list[str], origin: str | None, host: str = "127.0.0.1:8080", query: str = "") -> str | None:
    headers = {"Host": host} | ({} if origin is None else {"Origin": origin})
    return access(parse_args(["--url", "localhost:8001", *argv])).refusal(
        make_mocked_request("GET", f"/ws{query}", headers=headers))


OWN = ["http://127.0.0.1:8080", "http://localhost:8080", "http://[::1]:8080"]
LOOK_ALIKES = [
    "http://127.0.0.1:808", "http://127.0.0.1", "http://127.0.0.1:", "http://127.0.0.1:80800",
    "http://127.0.0.1:8080.evil.example", "http://127.0.0.1:8080@evil.example", "http://127.0.0.1:8080/",
    "https://127.0.0.1:8080", "ws://127.0.0.1:8080", "http://evil.localhost:8080", "http://localhost.evil:8080",
    "http://127.0.0.10:8080", "http://27.0.0.1:8080", " http://127.0.0.1:8080", "http://127.0.0.1:8080 ",
    "http://[::1]:80", "null", "", "*",
]


@pytest.mark.parametrize("origin", OWN)
def test_the_bridge_s_own_pages_get_in(origin: str) -> None:
    assert refusal([], origin) is None


@pytest.mark.parametrize("origin", [*LOOK_ALIKES, None])
def test_a_look_alike_of_the_bridge_s_own_origin_is_refused(origin: str | None) -> None:
    assert "may not open sessions here" in refusal([], origin)


def test_a_port_that_is_a_prefix_of_another_is_another_origin() -> None:
    assert refusal(["--port", "80"], "http://127.0.0.1:8080", host="127.0.0.1:80") is not None
    assert refusal(["--port", "8080"], "http://127.0.0.1:80") is not None
    assert refusal(["--port", "80"], "http://127.0.0.1:80", host="127.0.0.1:80") is None


@pytest.mark.parametrize(("origin", "host", "allowed"), [
    ("http://203.0.113.5:8080", "203.0.113.5:8080", True),  # the name the page used to reach it
    ("http://203.0.113.5:80", "203.0.113.5:8080", False),
    ("http://203.0.113.5:80800", "203.0.113.5:8080", False),
    ("http://203.0.113.50:8080", "203.0.113.5:8080", False),
    ("http://203.0.113.5:8080.evil.example", "203.0.113.5:8080", False),
    ("https://203.0.113.5:8080", "203.0.113.5:8080", False),
    ("http://203.0.113.5:8080", "203.0.113.5:80", False),
])
def test_a_bridge_on_every_interface_takes_the_origin_its_host_header_names_exactly(origin: str, host: str,
                                                                                   allowed: bool) -> None:
    assert (refusal(["--host", "0.0.0.0", "--port", "8080"], origin, host=host) is None) is allowed


@pytest.mark.parametrize("origin", ["https://example.org.evil.com", "https://example.or", "https://sub.example.org",
                                    "http://example.org", "https://example.org:443", "https://example.org:4430"])
def test_an_allowed_origin_admits_itself_only(origin: str) -> None:
    assert refusal(["--allow-origin", "https://example.org"], "https://example.org") is None
    assert refusal(["--allow-origin", "https://example.org"], origin) is not None


@pytest.mark.parametrize("token", ["", "s3cre", "s3crett", "S3CRET", "s3cret%00", "xs3cret"])
def test_the_token_must_match_exactly(token: str) -> None:
    argv = ["--token", "s3cret"]
    assert refusal(argv, OWN[0], query="?token=s3cret") is None
    assert "needs its token" in refusal(argv, OWN[0], query=f"?token={token}")
    assert "needs its token" in refusal(argv, OWN[0])


def test_the_files_routes_serve_this_bridge_s_sessions_only(tmp_path: Path) -> None:
    """/sessions/ID/video.mp4 and recording.npz: a session of this bridge's table gets its own file, once it
    exists; an unknown ID, or a path in its place, gets 404 (the real app in this process, no Triton behind it)."""
    from client.web.app import SESSIONS, Access, make_app

    video = tmp_path / "abc123.mp4"
    outside = tmp_path / "outside.mp4"
    outside.write_bytes(b"not yours")

    async def fetch_all() -> list[tuple[int, bytes]]:
        app = make_app("127.0.0.1:1", "lingbot_world", 5.0, Access(frozenset({"*"})))
        app[SESSIONS]["abc123"] = video
        got = []
        async with TestClient(TestServer(app)) as client:
            for step, path in [("none yet", "/sessions/abc123/video.mp4"),
                               ("none yet", "/sessions/abc123/recording.npz"),
                               ("written", "/sessions/abc123/video.mp4"), ("written", "/sessions/abc123/recording.npz"),
                               ("written", "/sessions/0123456789ab/video.mp4"),
                               ("written", "/sessions/0123456789ab/recording.npz"),
                               ("written", "/sessions/" + str(tmp_path / "outside").replace("/", "%2F") + "/video.mp4")]:
                if step == "written":
                    video.write_bytes(b"the video")
                    video.with_suffix(".npz").write_bytes(b"the recording")
                async with client.get(path) as response:
                    got.append((response.status, await response.read() if response.status == 200 else b""))
        return got

    assert asyncio.run(fetch_all()) == [(404, b""), (404, b""), (200, b"the video"), (200, b"the recording"),
                                        (404, b""), (404, b""), (404, b"")]


def test_the_bridge_removes_its_videos_when_it_stops() -> None:
    from client.web.app import VIDEOS, Access, make_app

    async def serve_and_stop() -> Path:
        app = make_app("127.0.0.1:1", "lingbot_world", 5.0, Access(frozenset({"*"})))
        (app[VIDEOS] / "left.mp4").write_bytes(b"a page's video")
        async with TestClient(TestServer(app)) as client:
            async with client.get("/") as response:
                assert response.status == 200
        return app[VIDEOS]

    assert not asyncio.run(serve_and_stop()).exists()


def test_each_page_message_reaches_its_player(monkeypatch) -> None:
    """start, keys, event (with its recache) and stop, each to the page's own Player, the calls in the order sent
    (the real app in this process; the Player's methods recorded, no Triton behind it)."""
    import json

    from client.web import app as web_app
    from client.web.bridge import Player

    calls: list[tuple] = []

    async def play(self, request) -> None:
        calls.append(("play", request.prompt, request.keys))

    monkeypatch.setattr(Player, "play", play)
    monkeypatch.setattr(Player, "hold", lambda self, keys: calls.append(("hold", keys)))
    monkeypatch.setattr(Player, "event", lambda self, prompt, recache=False: calls.append(("event", prompt,
                                                                                                     recache)))
    monkeypatch.setattr(Player, "stop", lambda self: calls.append(("stop",)))
    messages = [{"type": "start", "prompt": "a castle", "keys": "w", "height": 64, "width": 64},
                {"type": "keys", "keys": "wa"}, {"type": "event", "prompt": "it snows", "recache": True},
                {"type": "event", "prompt": "rain"}, {"type": "keys"}, {"type": "stop"}]

    async def send_all() -> None:
        app = web_app.make_app("127.0.0.1:1", "lingbot_world", 5.0, web_app.Access(frozenset({"*"})))
        async with TestClient(TestServer(app)) as client:
            async with client.ws_connect("/ws") as ws:
                for message in messages:
                    await ws.send_str(json.dumps(message))
                while len(calls) < len(messages):
                    await asyncio.sleep(0.01)

    asyncio.run(asyncio.wait_for(send_all(), 15))
    assert ("play", "a castle", "w") in calls  # its own task, started on the start message
    assert [c for c in calls if c[0] != "play"] == [("hold", "wa"), ("event", "it snows", True), ("event", "rain", False),
                                                  ("hold", ""), ("stop",)]


def test_max_pages_play_at_once_one_more_is_told_busy_and_a_freed_place_is_taken() -> None:
    """Access.max_pages=2: two pages get a session, the third an error naming the limit with its code and the close
    code TRY_AGAIN_LATER; once a page leaves, the next gets in (the real app in this process, no Triton behind it)."""
    import json

    from aiohttp import WSMsgType

    from client.web.app import Access, make_app

    async def open_pages() -> list:
        app = make_app("127.0.0.1:1", "lingbot_world", 5.0, Access(frozenset({"*"}), max_pages=2))
        async with TestClient(TestServer(app)) as client:
            pages = [await client.ws_connect("/ws") for _ in range(2)]
            told = [json.loads((await page.receive(timeout=5)).data)["type"] for page in pages]
            third = await client.ws_connect("/ws")
            busy = json.loads((await third.receive(timeout=5)).data)
            closed = await third.receive(timeout=5)
            await pages[0].close()
            deadline = asyncio.get_running_loop().time() + 5
            while True:  # the bridge frees the place once it has seen the page go
                fourth = await client.ws_connect("/ws")
                after = json.loads((await fourth.receive(timeout=5)).data)["type"]
                if after == "session" or asyncio.get_running_loop().time() > deadline:
                    break
                await fourth.close()
                await asyncio.sleep(0.02)
            for page in (pages[1], fourth):
                await page.close()
            return [told, busy, (closed.type, closed.data), after]

    told, busy, closed, after = asyncio.run(asyncio.wait_for(open_pages(), 20))
    assert told == ["session", "session"] and after == "session"
    assert busy == {"type": "error", "code": "PLAYER_BUSY", "retry_after_s": None,
                    "message": "the player is busy: 2 pages are playing; retry later"}
    assert closed == (WSMsgType.CLOSE, 1013)  # TRY_AGAIN_LATER


def test_a_page_s_video_and_recording_go_with_the_page() -> None:
    """A page that leaves takes its files with it: its video and recording both, or its recording alone (it left
    before a block was written to the video)."""
    import json

    from client.web.app import VIDEOS, Access, make_app
    from client.web.bridge import recording_path

    async def leave() -> list[Path]:
        app = make_app("127.0.0.1:1", "lingbot_world", 5.0, Access(frozenset({"*"})))
        async with TestClient(TestServer(app)) as client:
            written = []
            for both in (True, False):
                page = await client.ws_connect("/ws")
                video = app[VIDEOS] / f"{json.loads((await page.receive(timeout=5)).data)['id']}.mp4"
                written += [video, recording_path(video)] if both else [recording_path(video)]
                for path in written[-2 if both else -1:]:
                    path.write_bytes(b"what the page played")
                await page.close()
            deadline = asyncio.get_running_loop().time() + 5
            while any(p.exists() for p in written) and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
            return [p for p in written if p.exists()]

    assert asyncio.run(asyncio.wait_for(leave(), 20)) == []
