"""The web app: the page, one websocket per page session (a `Player`), and each session's MP4 for download.

Page -> bridge (JSON): {"type": "start", prompt, image?, height?, width?, seed?, keys?}, {"type": "keys", keys},
{"type": "stop"}. Bridge -> page: {"type": "session", id, video}, then per block a {"type": "block", ...} header
followed by its frames as binary JPEG messages, then {"type": "ended", frames} or {"type": "error", message}.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import uuid
from pathlib import Path

from aiohttp import WSMsgType, web

from client.web.bridge import Player, start_request

STATIC = Path(__file__).parent / "static"
VIDEOS = web.AppKey("videos", Path)
SETTINGS = web.AppKey("settings", dict)


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html")


async def favicon(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "favicon.svg", headers={"Content-Type": "image/svg+xml"})


async def video(request: web.Request) -> web.FileResponse:
    path = request.app[VIDEOS] / f"{request.match_info['sid']}.mp4"
    if not path.is_file():
        raise web.HTTPNotFound(text="no video for this session (it has no frames, or its page has closed)")
    name = f"lingbot-{request.match_info['sid']}.mp4"
    return web.FileResponse(path, headers={"Content-Disposition": f'attachment; filename="{name}"'})


async def websocket(request: web.Request) -> web.WebSocketResponse:
    ws = web.WebSocketResponse(heartbeat=30)
    await ws.prepare(request)
    sid = uuid.uuid4().hex[:12]
    path = request.app[VIDEOS] / f"{sid}.mp4"

    async def send(message: dict | bytes) -> None:
        await (ws.send_bytes(message) if isinstance(message, bytes) else ws.send_json(message))

    player = Player(video_path=path, send=send, **request.app[SETTINGS])
    task: asyncio.Task | None = None
    await send({"type": "session", "id": sid, "video": f"/sessions/{sid}/video.mp4"})
    try:
        async for msg in ws:
            if msg.type != WSMsgType.TEXT:
                continue
            message = json.loads(msg.data)
            try:
                if message.get("type") == "start" and task is None:
                    task = asyncio.create_task(player.play(start_request(message)))
                elif message.get("type") == "keys":
                    player.hold(str(message.get("keys", "")))
                elif message.get("type") == "stop":
                    player.stop()
            except ValueError as exc:
                await send({"type": "error", "message": str(exc)})
    finally:  # the page went: cancel its Triton session and drop its video
        if task is not None:
            task.cancel()
        await asyncio.to_thread(player.close)
        path.unlink(missing_ok=True)
    return ws


def make_app(url: str, model: str, timeout: float) -> web.Application:
    app = web.Application()
    app[SETTINGS] = {"url": url, "model": model, "timeout": timeout}
    app[VIDEOS] = Path(tempfile.mkdtemp(prefix="lingbot-player-"))
    app.on_cleanup.append(lambda app: asyncio.to_thread(shutil.rmtree, app[VIDEOS], True))
    app.router.add_get("/", index)
    app.router.add_get("/ws", websocket)
    app.router.add_get("/favicon.ico", favicon)
    app.router.add_get("/sessions/{sid}/video.mp4", video)
    app.router.add_static("/static", STATIC)
    return app
