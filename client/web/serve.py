"""`python -m client serve`: the browser player, a local web app bridging pages to Triton's steered sessions.

    python -m client serve --url localhost:8001 --port 8080     # then open http://localhost:8080/
    python -m client serve --url HOST:8001 --ca ca.pem --tls-cert cert.pem --tls-key key.pem --sign-in --host 0.0.0.0

Only pages this player serves may open sessions (their origin), unless --allow-origin names others; with
--token the page's address needs ?token=TOKEN (one user); with --sign-in each user signs in with their own key
and the page holds only a short-lived token (client/web/signin); at most --max-pages pages play at once; a page
whose link drops or that reloads gets its world back within --reconnect-s (client/web/rejoin). With
--tls-cert the page, its websocket and the videos are HTTPS and WSS only. The video goes over WebRTC (UDP on
--media-address, by default --host's address; STUN and TURN with --ice-server), JPEG on the websocket when the
page's WebRTC fails; a world's watchers (a watch link each world's page asks for) are bounded by --max-watchers and
--max-watchers-per-world (docs/player.md).
"""
from __future__ import annotations

import argparse
import logging
import ssl
import sys
from pathlib import Path

from aiohttp import web

from client.connection import connection_of
from client.stream import add_server_args
from client.web.app import Access, RtcSettings, make_app
from client.web.rejoin import RECONNECT_S
from client.web.rtc import WILDCARD_HOSTS, IceServers, bind_media, media_addresses
from client.web.signin import TOKEN_TTL_S, Tokens
from client.world import DEFAULT_SAVE_EVERY

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


def access(args: argparse.Namespace) -> Access:
    """The bridge's own origins (each name it answers to on its port), plus those --allow-origin adds."""
    names = set(LOOPBACK_NAMES) | ({f"[{args.host}]" if ":" in args.host else args.host} - set(WILDCARD_HOSTS))
    scheme = "https" if args.tls_cert else "http"
    origins = {f"{scheme}://{name}:{args.port}" for name in names} | set(args.allow_origin)
    return Access(frozenset(origins), host_origin=args.host in WILDCARD_HOSTS, token=args.token, max_pages=args.max_pages)


def count(text: str) -> int:
    """A count of steps or blocks: --lookahead, --save-every."""
    steps = int(text)
    if steps < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {steps}")
    return steps


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m client serve", description=__doc__.split("\n\n")[0])
    add_server_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address the page is served on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8080, help="(default: %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for any one block")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="also let pages from ORIGIN (e.g. https://example.org, or *) open sessions (repeatable)")
    p.add_argument("--token", help="pages must be opened with ?token=TOKEN to open sessions")
    p.add_argument("--lookahead", type=count, default=1,
                   help="steps sent ahead of the block on screen, as in `play` (default: %(default)s)")
    p.add_argument("--max-pages", type=int, default=16, help="pages playing at once (default: %(default)s)")
    p.add_argument("--save-every", type=count, default=DEFAULT_SAVE_EVERY, metavar="N",
                   help="save each page's world every N blocks, to resume it when the server is lost (0: only when "
                        "the page asks; default: %(default)s, docs/worlds.md)")
    p.add_argument("--reconnect-s", type=float, default=RECONNECT_S, metavar="SECONDS",
                   help="how long a page's world waits for it after its link drops or it reloads (its rejoin token "
                        "brings it back; 0: the world ends with its socket; default: %(default)s)")
    p.add_argument("--tls-cert", type=Path, help="serve HTTPS and WSS only, with this PEM certificate chain "
                   "(with --tls-key)")
    p.add_argument("--tls-key", type=Path, help="the PEM private key of --tls-cert")
    p.add_argument("--sign-in", action="store_true", help="each user signs in with their own key (checked with the "
                   "server); the page gets a short-lived token, never the key")
    p.add_argument("--token-ttl", type=float, default=TOKEN_TTL_S, help="seconds a sign-in lasts (default: "
                   "%(default)s)")
    p.add_argument("--max-watchers", type=count, default=RtcSettings.max_watchers,
                   help="watchers of every world at once (default: %(default)s)")
    p.add_argument("--max-watchers-per-world", type=count, default=RtcSettings.max_watchers_per_world,
                   help="watchers of one world at once (default: %(default)s)")
    p.add_argument("--max-offers-per-minute", type=count, default=RtcSettings.offers_per_minute,
                   help="WebRTC offers a page, or a world's watch link, may make a minute (default: %(default)s)")
    p.add_argument("--ice-server", action="append", default=[], metavar="URL",
                   help="a STUN or TURN server for WebRTC, for the bridge and the pages (stun:HOST:PORT, "
                        "turn:HOST:PORT?transport=udp, turns:...; repeatable; default: none, host candidates only)")
    p.add_argument("--turn-secret-file", type=Path, help="the TURN server's shared secret (coturn's "
                   "static-auth-secret), for the short-lived credentials each peer connection gets")
    p.add_argument("--media-address", action="append", default=[], metavar="ADDRESS",
                   help="an address WebRTC's UDP ports listen on, offered as a host candidate (repeatable; default: "
                        "--host's own address, or every interface but loopback for 0.0.0.0)")
    return p.parse_args(argv)


def tls_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_cert is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(args.tls_cert, args.tls_key)
    return context


def rtc_settings(args: argparse.Namespace) -> RtcSettings:
    secret = args.turn_secret_file.read_bytes().strip() if args.turn_secret_file else None
    return RtcSettings(IceServers(tuple(args.ice_server), secret), args.max_watchers, args.max_watchers_per_world,
                       args.max_offers_per_minute)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        context, connection, rtc = tls_context(args), connection_of(args), rtc_settings(args)
        media = args.media_address or media_addresses(args.host)
    except (ValueError, OSError, ssl.SSLError) as exc:
        print(f"error: {exc}", flush=True)
        return 2
    bind_media(media)
    log = logging.getLogger("client.web")  # the bridge's own lines; aiohttp's and aiortc's stay quiet
    log.setLevel(logging.INFO)
    log.addHandler(logging.StreamHandler(sys.stdout))
    print(f"player for {args.url} on {'https' if context else 'http'}://{args.host}:{args.port}/; WebRTC media on "
          f"{', '.join(media) if media else 'every interface but loopback'}", flush=True)
    tokens = Tokens(args.token_ttl) if args.sign_in else None
    app = make_app(args.url, args.model, args.timeout, access(args), args.lookahead, connection, tokens,
                   args.save_every, rtc, args.reconnect_s)
    web.run_app(app, host=args.host, port=args.port, print=None, ssl_context=context)
    return 0
