"""`python -m client serve`: the browser player, a local web app bridging pages to Triton's steered sessions.

    python -m client serve --url localhost:8001 --port 8080     # then open http://localhost:8080/
"""
from __future__ import annotations

import argparse

from aiohttp import web

from backend.api import contract
from client.web.app import make_app


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m client serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="localhost:8001", help="Triton gRPC endpoint (default: %(default)s)")
    p.add_argument("--model", default=contract.MODEL_NAME)
    p.add_argument("--host", default="127.0.0.1", help="address the page is served on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8080, help="(default: %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for any one block")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    print(f"player for {args.url} on http://{args.host}:{args.port}/", flush=True)
    web.run_app(make_app(args.url, args.model, args.timeout), host=args.host, port=args.port, print=None)
    return 0
