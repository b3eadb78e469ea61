"""The web app: the player's page, one websocket per page session (client/web/page: its world, its video, its
watch link), each session's MP4 and recording for download, and the watch page with its offer endpoint.

The page's messages and the bridge's are described in client/web/page.py and client/web/bridge.py (checked by
`schema`); a refusal of the bridge's own carries a code of client/web/codes.py.

Who gets in (`Access`): a page from an allowed origin (this bridge's own by default), with the token if one is
set, signed in with a user's key when the bridge asks for sign-in (client/web/signin: POST /signin {"key"} sets a
short-lived token cookie; GET /whoami says whether the page must sign in), while fewer than `max_pages` pages are
open; videos are served by session id from this bridge's own table. A page whose socket went opens /ws with
?rejoin=TOKEN to take its world back (client/web/rejoin). A watcher needs a watch link and an allowed
origin only (GET /watch/ID, then POST /watch/ID/offer with its SDP offer: client/web/watch); a WHEP client posts
its offer to /watch/ID/whep and deletes the resource its answer names to leave.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from aiohttp import WSCloseCode, web

from backend.api.controls import parse_keys
from client.connection import Connection
from client.web.bridge import recording_path
from client.web.codes import INVALID_MESSAGE, ORIGIN_REFUSED, PLAYER_BUSY, SDP_CONTENT_TYPE, SDP_TOO_LARGE, Refused
from client.web.page import Page
from client.web.rejoin import RECONNECT_S, Rejoins
from client.web.rtc import MAX_SDP_BYTES, IceServers
from client.web.schema import MAX_MESSAGE_BYTES
from client.web.signin import COOKIE, Tokens, check_key
from client.web.watch import Watcher, Watching, unknown_link
from client.world import DEFAULT_SAVE_EVERY

STATIC = Path(__file__).parent / "static"
VIDEOS = web.AppKey("videos", Path)
SESSIONS = web.AppKey("sessions", dict)  # session id -> its video, for the open pages' sessions (this bridge's own)
SETTINGS = web.AppKey("settings", dict)
TOKENS = web.AppKey("tokens", Tokens)  # sign-in tokens (present when the bridge asks pages to sign in)
REJOINS = web.AppKey("rejoins", Rejoins)  # the pages' rejoin tokens, and the worlds waiting for their pages
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
        return self.origin_refusal(request)

    def origin_refusal(self, request: web.Request) -> str | None:
        """Why a request from this page's origin may not be served (None: it may)."""
        origin = request.headers.get("Origin", "")
        if "*" in self.origins or origin in self.origins:
            return None
        if self.host_origin and origin == f"{request.scheme}://{request.host}":
            return None
        return (f"pages from {origin or 'no origin'} may not open sessions here "
                "(start the player with --allow-origin ORIGIN to allow one)")


ACCESS = web.AppKey("access", Access)


@dataclass(frozen=True)
class RtcSettings:
    """WebRTC: the ICE servers (none: host candidates only), the watchers allowed in all and per world, and the
    offers a page or a watch link may make a minute."""

    ice: IceServers = IceServers()
    max_watchers: int = 100
    max_watchers_per_world: int = 20
    offers_per_minute: int = 60


RTC = web.AppKey("rtc", RtcSettings)
WATCHING = web.AppKey("watching", Watching)


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
    """A page session: a new one, or with ?rejoin=TOKEN (&keys=KEYS held) the page's own world back
    (client/web/rejoin)."""
    if (refusal := request.app[ACCESS].refusal(request)) is not None:
        raise web.HTTPForbidden(text=refusal)
    key = signed_in_key(request)
    ws = web.WebSocketResponse(heartbeat=30, max_msg_size=MAX_MESSAGE_BYTES)
    await ws.prepare(request)
    rejoins = request.app[REJOINS]
    if (token := request.query.get("rejoin")) is not None:
        try:
            keys = parse_keys(request.query.get("keys") or "-")
            page = rejoins.take(token, key)
        except (Refused, ValueError) as exc:  # one try a connection
            refused = exc if isinstance(exc, Refused) else Refused(INVALID_MESSAGE, str(exc))
            await ws.send_json(refused.message())
            await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=refused.code.encode())
            return ws
        rejoined = True
    else:
        sessions, limit = request.app[SESSIONS], request.app[ACCESS].max_pages
        if len(sessions) >= limit:
            await ws.send_json(Refused(PLAYER_BUSY, f"the player is busy: {limit} pages are playing; retry later").message())
            await ws.close(code=WSCloseCode.TRY_AGAIN_LATER, message=b"busy")
            return ws
        page, keys, rejoined = new_page(request, ws, key), "", False
    page.token = rejoins.issue(page, key)
    try:
        first = session_message(request.app, page, rejoined)
        await (page.back(ws, keys, first) if rejoined else page.send(first))
        await page.serve(ws)
    finally:  # aiohttp cancels this handler when the page's connection goes: nothing below may hang on an await
        if page.ws is ws:  # (else the page came back on a newer socket)
            if page.playing and not page.refused and rejoins.reconnect_s > 0:  # its world waits for it
                page.away()
                rejoins.away(page.token, lambda: end_session(request.app, page))
            else:
                rejoins.drop(page.token)
                await asyncio.shield(end_session(request.app, page))
    return ws


def new_page(request: web.Request, ws: web.WebSocketResponse, key: str | None) -> Page:
    """A new page session on `ws`, of a page signed in with `key` (None: the bridge asks for none)."""
    sid = secrets.token_hex(16)
    path = request.app[VIDEOS] / f"{sid}.mp4"
    request.app[SESSIONS][sid] = path
    settings, rtc = request.app[SETTINGS], request.app[RTC]

    def may_start() -> str | None:  # a socket kept past its sign-in starts nothing
        expired = key is not None and request.app[TOKENS].grant(request.cookies.get(COOKIE)) is None
        return "your sign-in expired: sign in again" if expired else None

    player = settings | {"video_path": path,
                         "connection": settings["connection"].with_key(key) if key else settings["connection"]}
    return Page(sid, ws, player, request.app[WATCHING], rtc.ice, rtc.offers_per_minute, may_start)


def session_message(app: web.Application, page: Page, rejoined: bool) -> dict:
    """What a page hears first: its session, its files, its WebRTC servers and its rejoin token."""
    sid = page.sid
    return {"type": "session", "id": sid, "video": f"/sessions/{sid}/video.mp4",
            "recording": f"/sessions/{sid}/recording.npz", "webrtc": {"ice_servers": app[RTC].ice.for_page(sid)},
            "rejoin": page.token, "reconnect_s": app[REJOINS].reconnect_s, "rejoined": rejoined}


async def end_session(app: web.Application, page: Page) -> str | None:
    """The page's world ends: its place is free, its Triton session cancelled, its video ended and its files
    dropped. Returns the id of its last save (None: none)."""
    app[SESSIONS].pop(page.sid, None)
    try:
        await page.close()
        await asyncio.to_thread(page.player.close)
    finally:
        page.player.video_path.unlink(missing_ok=True)
        page.player.recording_path.unlink(missing_ok=True)
    return page.player.last_save


async def watch_page(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "watch.html")


async def watch_ice(request: web.Request) -> web.Response:
    """The ICE servers a watcher's peer connection uses (a TURN credential of its own), for a link that works."""
    link_id = request.match_info["wid"]
    if link_id not in request.app[WATCHING].links:
        return refusal_response(unknown_link())
    return web.json_response({"ice_servers": request.app[RTC].ice.for_page(f"watch-{link_id[:8]}")})


async def watch_offer(request: web.Request) -> web.Response:
    """A watcher's SDP offer for the world of /watch/ID: {"sdp", "codec"} of the answer, or a refusal {"code",
    "message", "retry_after_s"} with its HTTP status."""
    try:
        watcher = await answer_watcher(request, sdp_only=False)
        return web.json_response({"sdp": watcher.pc.localDescription.sdp, "codec": watcher.codec})
    except Refused as refused:
        return refusal_response(refused)


async def whep_offer(request: web.Request) -> web.Response:
    """WHEP: a watcher's SDP offer (Content-Type application/sdp) for the world of /watch/ID/whep: 201 Created, the
    SDP answer, and its watcher's resource in Location (DELETE it to leave); a refusal as watch_offer's."""
    try:
        watcher = await answer_watcher(request, sdp_only=True)
    except Refused as refused:
        return refusal_response(refused)
    return web.Response(status=201, text=watcher.pc.localDescription.sdp, content_type="application/sdp",
                        headers={"Location": f"/watch/{request.match_info['wid']}/whep/{watcher.resource}"})


async def whep_delete(request: web.Request) -> web.Response:
    """WHEP: a watcher leaves (DELETE of its resource): 200; a resource of no watcher of the link, 404."""
    try:
        if (refusal := request.app[ACCESS].origin_refusal(request)) is not None:
            raise Refused(ORIGIN_REFUSED, refusal)
        await request.app[WATCHING].leave(request.match_info["wid"], request.match_info["resource"])
    except Refused as refused:
        return refusal_response(refused)
    return web.Response(status=200)


async def answer_watcher(request: web.Request, sdp_only: bool) -> Watcher:
    """The watcher answered for a request's offer (its body, at most MAX_SDP_BYTES; with `sdp_only`, of Content-Type
    application/sdp); Refused naming why not. Every check comes before the body is read."""
    if (refusal := request.app[ACCESS].origin_refusal(request)) is not None:
        raise Refused(ORIGIN_REFUSED, refusal)
    if sdp_only and request.content_type != "application/sdp":
        raise Refused(SDP_CONTENT_TYPE, f"a WHEP offer is application/sdp, not {request.content_type}")
    if (request.content_length or 0) > MAX_SDP_BYTES:
        raise Refused(SDP_TOO_LARGE, f"the offer is longer than {MAX_SDP_BYTES} bytes")
    watching = request.app[WATCHING]
    link = watching.check(request.match_info["wid"])
    body = b""
    while len(body) <= MAX_SDP_BYTES and (chunk := await request.content.read(MAX_SDP_BYTES + 1 - len(body))):
        body += chunk
    if len(body) > MAX_SDP_BYTES:
        raise Refused(SDP_TOO_LARGE, f"the offer is longer than {MAX_SDP_BYTES} bytes")
    return await watching.add(link, body.decode("utf-8", "replace"))


def refusal_response(refused: Refused) -> web.Response:
    return web.json_response(refused.answer(), status=refused.http)


def make_app(url: str, model: str, timeout: float, access: Access, lookahead: int = 1,
             connection: Connection = Connection(), tokens: Tokens | None = None,
             save_every: int = DEFAULT_SAVE_EVERY, rtc: RtcSettings = RtcSettings(),
             reconnect_s: float = RECONNECT_S) -> web.Application:
    """connection: how the bridge reaches the server (TLS, its own key); tokens: pages must sign in with a key;
    save_every: each page's world is saved every this many blocks (client/world); rtc: WebRTC's settings;
    reconnect_s: how long a world waits for its page after its socket goes (0: it ends at once)."""
    app = web.Application()
    app[SETTINGS] = {"url": url, "model": model, "timeout": timeout, "lookahead": lookahead, "connection": connection,
                     "save_every": save_every}
    app[ACCESS], app[SESSIONS], app[RTC], app[REJOINS] = access, {}, rtc, Rejoins(reconnect_s)
    app[WATCHING] = Watching(rtc.max_watchers, rtc.max_watchers_per_world, rtc.offers_per_minute, rtc.ice)
    if tokens is not None:
        app[TOKENS] = tokens
    app[VIDEOS] = Path(tempfile.mkdtemp(prefix="lingbot-player-"))
    app.on_shutdown.append(lambda app: app[REJOINS].close())
    app.on_cleanup.append(lambda app: asyncio.to_thread(shutil.rmtree, app[VIDEOS], True))
    app.router.add_get("/", index)
    app.router.add_get("/ws", websocket)
    app.router.add_get("/whoami", whoami)
    app.router.add_post("/signin", signin)
    app.router.add_get("/favicon.ico", favicon)
    app.router.add_get("/sessions/{sid}/video.mp4", video)
    app.router.add_get("/sessions/{sid}/recording.npz", recording)
    app.router.add_get("/watch/{wid}", watch_page)
    app.router.add_get("/watch/{wid}/ice", watch_ice)
    app.router.add_post("/watch/{wid}/offer", watch_offer)
    app.router.add_post("/watch/{wid}/whep", whep_offer)
    app.router.add_delete("/watch/{wid}/whep/{resource}", whep_delete)
    app.router.add_static("/static", STATIC)
    return app
