"""`python -m client serve`: the browser player, a local web app bridging pages to Triton's steered sessions.

    python -m client serve --url localhost:8001 --port 8080     # then open http://localhost:8080/
    python -m client serve --url HOST:8001 --ca ca.pem --tls-cert cert.pem --tls-key key.pem --sign-in --host 0.0.0.0

Only pages this player serves may open sessions (their origin), unless --allow-origin names others; with
--token the page's address needs ?token=TOKEN (one user); with --sign-in each user signs in with their own key
and the page holds only a short-lived token (client/web/signin); at most --max-pages pages play at once. With
--tls-cert the page, its websocket and the videos are HTTPS and WSS only.
"""
from __future__ import annotations

import argparse
import ssl
from pathlib import Path

from aiohttp import web

from client.connection import connection_of
from client.stream import add_server_args
from client.web.app import Access, make_app
from client.web.signin import TOKEN_TTL_S, Tokens
from client.world import DEFAULT_SAVE_EVERY

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
WILDCARDS = ("0.0.0.0", "::", "")


def access(args: argparse.Namespace) -> Access:
    """The bridge's own origins (each name it answers to on its port), plus those --allow-origin adds."""
    names = set(LOOPBACK_NAMES) | ({f"[{args.host}]" if ":" in args.host else args.host} - set(WILDCARDS))
    scheme = "https" if args.tls_cert else "http"
    origins = {f"{scheme}://{name}:{args.port}" for name in names} | set(args.allow_origin)
    return Access(frozenset(origins), host_origin=args.host in WILDCARDS, token=args.token, max_pages=args.max_pages)


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
    p.add_argument("--tls-cert", type=Path, help="serve HTTPS and WSS only, with this PEM certificate chain "
                   "(with --tls-key)")
    p.add_argument("--tls-key", type=Path, help="the PEM private key of --tls-cert")
    p.add_argument("--sign-in", action="store_true", help="each user signs in with their own key (checked with the "
                   "server); the page gets a short-lived token, never the key")
    p.add_argument("--token-ttl", type=float, default=TOKEN_TTL_S, help="seconds a sign-in lasts (default: "
                   "%(default)s)")
    return p.parse_args(argv)


def tls_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_cert is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(args.tls_cert, args.tls_key)
    return context


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        context, connection = tls_context(args), connection_of(args)
    except (ValueError, OSError, ssl.SSLError) as exc:
        print(f"error: {exc}", flush=True)
        return 2
    print(f"player for {args.url} on {'https' if context else 'http'}://{args.host}:{args.port}/", flush=True)
    tokens = Tokens(args.token_ttl) if args.sign_in else None
    app = make_app(args.url, args.model, args.timeout, access(args), args.lookahead, connection, tokens,
                   args.save_every)
    web.run_app(app, host=args.host, port=args.port, print=None, ssl_context=context)
    return 0
