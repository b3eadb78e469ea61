"""A real redis-server for the tests of the fleet's books (Debian's redis-server, which scripts/test.sh installs), run
as the fleet runs its own (backend/fleet/books_server.py): loopback, a password, nothing on disk."""
from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

from backend.fleet.books_server import REDIS_SERVER, BooksServer
from system_tools import requires_tool

requires_redis = requires_tool(shutil.which(REDIS_SERVER) is not None, "redis-server (Debian's redis-server)")


@contextlib.contextmanager
def running_books(folder: Path) -> Iterator[BooksServer]:
    server = BooksServer(folder).start()
    try:
        yield server
    finally:
        server.stop()
