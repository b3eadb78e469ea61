"""The web app: the page, one websocket per page session (a `Player`), and each session's MP4 for download.

Page -> bridge (JSON, checked by `schema`): {"type": "start", prompt, image?, height?, width?, seed?, keys?} or
{"type": "start", resume, keys?} (a saved world), {"type": "keys", keys}, {"type": "event", prompt, recache} (a
world event), {"type": "save"}, {"type": "stop"}. Bridge -> page: {"type": "session", id, video, recording}, then
per block a {"type": "block", ...} header followed by its frames as binary JPEG messages, a {"type": "snapshot", id,
block, asked, error, released} for each save's outcome (released: the older snapshot it deleted, or ""), {"type":
"failover", block, replayed, resent, reason, took_s, attempts, differed} when the server is lost (took_s null) and
again once the world goes on, then {"type": "ended", frames, recorded} or {"type": "error", message}. A message that
does not fit the schema gets an error and the websocket closes.

Who gets in (`Access`): a page from an allowed origin (this bridge's own by default), with the token if one is
set, signed in with a user's key when the bridge asks for sign-in (client/web/signin: POST /signin {"key"} sets a
short-lived token cookie; GET /whoami says whether the page must sign in), while fewer than `max_pages` pages are
open; videos are served by session id from this bridge's own table.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from aiohttp import WSCloseCode, WSMsgType, web

from client.connection import Connection
from client.web.bridge import Player, recording_path, start_request
from client.web.schema import MAX_MESSAGE_BYTES, parse_message
from client.web.signin import COOKIE, Tokens, check_key
from client.world import DEFAULT_SAVE_EVERY

STATIC = Path(__file__).parent / "static"
VIDEOS = web.AppKey("videos", Path)
SESSIONS = web.AppKey("sessions", dict)  # session id -> its video, for the open pages' sessions (this bridge's own)
SETTINGS = web.AppKey("settings", dict)
TOKENS = web.AppKey("tokens", Tokens)  # sign-in tokens (present when the bridge asks pages to sign in)
MAX_KEY_CHARS = 256


@dataclass(frozen=True)
class Access:
    """Who may open a session: pages from `origins` ("*": any), or from the origin their Host header names when
    `host_origin` (a bridge opened on every interface has no one name); the `token` if set; `max_pages` at once."""

    origins: frozenset[str]
    host_origin: bool = False
    token: str | None = None
    max_pages: int = 16

    def refusal(self, request: web.Request) -> str | None:
        """Why this websocket request may not open a session (None: it may)."""
        if self.token is not None and not hmac.compare_digest(request.query.get("token", "").encode(),
                                                              self.token.encode()):
            return "this player needs its token: open the page's address with ?token=..."
        origin = request.headers.get("Origin", "")
        if "*" in self.origins or origin in self.origins:
            return None
        if self.host_origin and origin == f"{request.scheme}://{request.host}":
            return None
        return (f"pages from {origin or 'no origin'} may not open sessions here "
                "(start the player with --allow-origin ORIGIN to allow one)")


ACCESS = web.AppKey("access", Access)


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html")


async def favicon(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "favicon.svg", headers={"Content-Type": "image/svg+xml"})


async def video(request: web.Request) -> web.FileResponse:
    path = request.app[SESSIONS].get(request.match_info["sid"])  # an id from the table, never a path
    if path is None or not path.is_file():
        raise web.HTTPNotFound(text="no video for this session (it has no frames, or its page has closed)")
    name = f"lingbot-{request.match_info['sid']}.mp4"
    return web.FileResponse(path, headers={"Content-Disposition": f'attachment; filename="{name}"'})


async def recording(request: web.Request) -> web.FileResponse:
    path = request.app[SESSIONS].get(request.match_info["sid"])  # an id from the table, never a path
    if path is None or not recording_path(path).is_file():
        raise web.HTTPNotFound(text="no recording for this session (no block yet, or its page has closed)")
    name = f"lingbot-{request.match_info['sid']}.npz"
    return web.FileResponse(recording_path(path), headers={"Content-Disposition": f'attachment; filename="{name}"'})


def signed_in_key(request: web.Request) -> str | None:
    """The key of the page's live sign-in token; HTTPForbidden when the bridge asks for sign-in and it has none."""
    tokens = request.app.get(TOKENS)
    if tokens is None:
        return None
    grant = tokens.grant(request.cookies.get(COOKIE))
    if grant is None:
        raise web.HTTPForbidden(text="sign in with your key first (a sign-in lasts a while, then it expires)")
    return grant.key


async def whoami(request: web.Request) -> web.Response:
    tokens = request.app.get(TOKENS)
    grant = None if tokens is None else tokens.grant(request.cookies.get(COOKIE))
    return web.json_response({"sign_in": tokens is not None, "signed_in": grant is not None,
                              "expires_s": None if grant is None else grant.expires_s})


async def signin(request: web.Request) -> web.Response:
    """A user's key, checked with the server once, for a token cookie: the page never sees the key again."""
    if (refusal := request.app[ACCESS].refusal(request)) is not None:
        raise web.HTTPForbidden(text=refusal)
    try:
        key = (await request.json(loads=_loads_small)).get("key")
    except ValueError:
        key = None
    if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS:
        raise web.HTTPBadRequest(text="send your key as {\"key\": \"...\"}")
    settings = request.app[SETTINGS]
    refused = await asyncio.to_thread(check_key, settings["url"], settings["model"],
                                      settings["connection"].with_key(key))
    if refused is not None:
        raise web.HTTPForbidden(text=refused.sentence)
    token, grant = request.app[TOKENS].issue(key)
    response = web.json_response({"signed_in": True, "expires_s": grant.expires_s})
    response.set_cookie(COOKIE, token, max_age=int(request.app[TOKENS].ttl_s), httponly=True, samesite="Strict",
                        secure=request.secure, path="/")
    return response


def _loads_small(text: str) -> dict:
    if len(text) > 4 * MAX_KEY_CHARS:
        raise ValueError("too long")
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("not an object")
    return value


async def websocket(request: web.Request) -> web.WebSocketResponse:
    if (refusal := request.app[ACCESS].refusal(request)) is not None:
        raise web.HTTPForbidden(text=refusal)
    key = signed_in_key(request)
    ws = web.WebSocketResponse(heartbeat=30, max_msg_size=MAX_MESSAGE_BYTES)
    await ws.prepare(request)

    async def send(message: dict | bytes) -> None:
        await (ws.send_bytes(message) if isinstance(message, bytes) else ws.send_json(message))

    sessions, limit = request.app[SESSIONS], request.app[ACCESS].max_pages
    if len(sessions) >= limit:
        await send({"type": "error", "message": f"the player is busy: {limit} pages are playing; retry later"})
        await ws.close(code=WSCloseCode.TRY_AGAIN_LATER, message=b"busy")
        return ws
    sid = secrets.token_hex(16)
    path = request.app[VIDEOS] / f"{sid}.mp4"
    sessions[sid] = path
    settings = request.app[SETTINGS]
    player = Player(video_path=path, send=send, **settings | {"connection": settings["connection"].with_key(key)
                                                              if key else settings["connection"]})
    task: asyncio.Task | None = None
    try:
        await send({"type": "session", "id": sid, "video": f"/sessions/{sid}/video.mp4",
                    "recording": f"/sessions/{sid}/recording.npz"})
        async for msg in ws:
            try:
                if msg.type == WSMsgType.ERROR:  # e.g. larger than MAX_MESSAGE_BYTES
                    raise ValueError(f"the bridge could not read a message ({msg.data})")
                if msg.type != WSMsgType.TEXT:
                    raise ValueError("the bridge takes JSON text messages only")
                message = parse_message(msg.data)
                if message["type"] == "start" and task is None:
                    if key is not None and request.app[TOKENS].grant(request.cookies.get(COOKIE)) is None:
                        raise ValueError("your sign-in expired: sign in again")  # a socket kept past it starts nothing
                    task = asyncio.create_task(player.play(start_request(message)))
                elif message["type"] == "keys":
                    player.hold(message.get("keys") or "")
                elif message["type"] == "event":
                    player.event(message.get("prompt") or "", bool(message.get("recache")))
                elif message["type"] == "save":
                    player.save()
                elif message["type"] == "stop":
                    player.stop()
            except ValueError as exc:  # a page that breaks the protocol gets why, and the door
                with contextlib.suppress(ConnectionError):
                    await send({"type": "error", "message": str(exc)})
                await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=b"invalid message")
                break
    finally:  # the page went: its place is free, its Triton session cancelled and its files dropped
        # aiohttp cancels this handler when the page's connection goes, so nothing below may hang on an await.
        sessions.pop(sid, None)
        if task is not None:
            task.cancel()
        try:
            await asyncio.shield(asyncio.to_thread(player.close))
        finally:
            path.unlink(missing_ok=True)
            recording_path(path).unlink(missing_ok=True)
    return ws


def make_app(url: str, model: str, timeout: float, access: Access, lookahead: int = 1,
             connection: Connection = Connection(), tokens: Tokens | None = None,
             save_every: int = DEFAULT_SAVE_EVERY) -> web.Application:
    """connection: how the bridge reaches the server (TLS, its own key); tokens: pages must sign in with a key;
    save_every: each page's world is saved every this many blocks (client/world)."""
    app = web.Application()
    app[SETTINGS] = {"url": url, "model": model, "timeout": timeout, "lookahead": lookahead, "connection": connection,
                     "save_every": save_every}
    app[ACCESS], app[SESSIONS] = access, {}
    if tokens is not None:
        app[TOKENS] = tokens
    app[VIDEOS] = Path(tempfile.mkdtemp(prefix="lingbot-player-"))
    app.on_cleanup.append(lambda app: asyncio.to_thread(shutil.rmtree, app[VIDEOS], True))
    app.router.add_get("/", index)
    app.router.add_get("/ws", websocket)
    app.router.add_get("/whoami", whoami)
    app.router.add_post("/signin", signin)
    app.router.add_get("/favicon.ico", favicon)
    app.router.add_get("/sessions/{sid}/video.mp4", video)
    app.router.add_get("/sessions/{sid}/recording.npz", recording)
    app.router.add_static("/static", STATIC)
    return app
