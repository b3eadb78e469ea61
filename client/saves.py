"""`python -m client saves`: the snapshots your key saved, with their sizes, and sharing one (docs/security.md).

    python -m client saves --url HOST:8001 --key-file alice.key                 # list them
    python -m client saves --url HOST:8001 --key-file alice.key --share ID      # any key that holds ID may resume it
    python -m client saves --url HOST:8001 --key-file alice.key --unshare ID    # your key's alone again

One request of its own (request parameter `saves`, no inputs, a sequence of one request), answered with the key's
snapshots (output `saves`).
"""
from __future__ import annotations

import argparse
import queue
import sys

from backend.api import contract as c
from backend.api.codec import parse_saves, saves_parameters
from backend.api.request import SavesRequest
from client.connection import Connection, connection_of
from client.stream import StreamError, add_server_args, new_sequence_id

TIMEOUT_S = 30.0
LIST = SavesRequest("list")


def key_saves(url: str, connection: Connection, request: SavesRequest = LIST,
              model: str = c.MODEL_NAME, timeout_s: float = TIMEOUT_S) -> dict:
    """The key's snapshots after the change `request` asks for (the output `saves`, read); StreamError with the
    server's refusal otherwise."""
    answers: queue.Queue = queue.Queue()
    with connection.client(url) as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)), headers=connection.headers())
        client.async_stream_infer(model, [], sequence_id=new_sequence_id(), sequence_start=True, sequence_end=True,
                                  parameters=saves_parameters(request))
        try:
            result, error = answers.get(timeout=timeout_s)
        except queue.Empty:
            raise StreamError(f"no answer from {url} within {timeout_s:g} s") from None
        finally:
            client.stop_stream(cancel_requests=True)
    if error is not None:
        raise StreamError(f"{url} refused: {error.message()}", error.message())
    listing = parse_saves(result.as_numpy)
    if listing is None:
        raise StreamError(f"{url} answered without its '{c.SAVES}' output")
    return listing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client saves", description=__doc__.split("\n\n")[0])
    add_server_args(p)
    change = p.add_mutually_exclusive_group()
    change.add_argument("--share", metavar="ID", help="share this snapshot of yours with any key that holds its id")
    change.add_argument("--unshare", metavar="ID", help="make this snapshot of yours your key's alone again")
    args = p.parse_args(argv)
    request = SavesRequest("share", args.share) if args.share else SavesRequest("unshare", args.unshare) \
        if args.unshare else LIST
    try:
        listing = key_saves(args.url, connection_of(args), request, args.model)
    except (StreamError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    quota = listing.get("quota_bytes")
    print(f"key {listing.get('key')}: {listing.get('bytes', 0):,} bytes"
          + (f" of its snapshot_bytes={quota:,}" if quota else ""))
    for s in listing["snapshots"]:
        print(f"  {s['id']}  {s['bytes']:>15,} bytes  {'shared' if s['shared'] else 'yours alone'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
