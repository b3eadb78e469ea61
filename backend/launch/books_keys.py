"""A launcher's keys from the fleet's books (`--books-url`): the keys the fleet pushed there (serving/books), copied
into a private keys file that the launcher's server publishes to its instances (launch/server.py), at start and
whenever the books' version changes. Polled: every group takes a change within KEYS_POLL_S, then its instances
within their own half-second watch (serving/key_watch.py), and a revoked key's sessions end at their next block
boundary.

The books are read, never trusted to be there: while they do not answer, or hold no keys (a store that restarted
before the fleet pushed them again), the keys in force stay.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..api.errors import ConfigError
from ..serving.books import Books, BooksUnavailable
from ..serving.keys import KeyRing

KEYS_POLL_S = 1.0  # how often a launcher asks the books for their keys' version

log = logging.getLogger("backend.launch")


class KeysFromBooks:
    """The books' keys in `path` (a file in a folder of its own, mode 700), kept current by a thread."""

    def __init__(self, books: Books) -> None:
        self.books = books
        self.folder = Path(tempfile.mkdtemp(prefix="lingbot-keys-"))
        self.path = self.folder / "keys"
        self.version: str | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._silent = False  # the books' silence was logged

    def wait(self, timeout_s: float) -> Path:
        """The keys file, once the books hold keys (the fleet pushes them before it starts its groups)."""
        deadline = time.monotonic() + timeout_s
        while not self.refresh():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the books held no keys after {timeout_s:g} s: start the fleet with --keys-file "
                                   "and the same --books-url, which pushes them")
            self._done.wait(KEYS_POLL_S)
        return self.path

    def refresh(self) -> bool:
        """Copy the books' keys when their version changed; whether the file holds keys."""
        try:
            if self.version is not None and self.books.keys_version() in (None, self.version):
                return True
            pushed = self.books.keys()
        except BooksUnavailable as exc:
            if not self._silent:
                log.warning("the books do not answer (%s): the keys in force stay", exc)
                self._silent = True
            return self.version is not None
        self._silent = False
        if pushed is None:
            return self.version is not None
        version, text = pushed
        try:
            KeyRing.parse(text, "the books' keys")
        except ConfigError as exc:  # the fleet checks before it pushes: someone else wrote there
            log.error("the books' keys were not taken, the keys in force stay: %s", exc)
            return self.version is not None
        partial = self.folder / "keys.partial"
        partial.write_text(text, encoding="utf-8")
        os.chmod(partial, 0o600)
        partial.replace(self.path)
        self.version = version
        return True

    def start(self, on_change: Callable[[], None]) -> KeysFromBooks:
        """Poll the books; `on_change` (the server's publication of the file) after each new version."""
        def run() -> None:
            while not self._done.wait(KEYS_POLL_S):
                before = self.version
                if self.refresh() and self.version != before:
                    on_change()
        self._thread = threading.Thread(target=run, name="lingbot-books-keys", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(5.0)
        shutil.rmtree(self.folder, ignore_errors=True)
