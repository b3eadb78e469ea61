"""The fleet's one set of books (docs/security.md): a store every local group's launcher is given (`--books-url`),
and the fleet's keys pushed into it, so a key's quotas count across the groups and a change of the keys reaches
every group from one place.

With `--keys-file` and local groups, the fleet runs its own store (fleet/books_server.py: loopback, a password of its
own) unless `--books-url` names one (Redis or Valkey, with TLS and a password). It pushes the keys at start, on
SIGHUP (checked first: a bad file is named and the keys in force stay), and again whenever the store has lost them
(a restart); it restarts a store of its own that exits.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..api.errors import ConfigError
from ..serving.books import Books, BooksAddress, BooksUnavailable
from ..serving.keys import KeyRing
from .books_server import BooksServer

log = logging.getLogger("backend.fleet")


class FleetBooks:
    def __init__(self, address: BooksAddress, server: BooksServer | None, keys_file: Path | None) -> None:
        """server: the store the fleet runs (None: one it was given at `address`); keys_file: the keys it pushes."""
        self.address, self.server, self.keys_file = address, server, keys_file
        self.books: Books | None = None

    @classmethod
    def of(cls, args: argparse.Namespace) -> FleetBooks | None:
        """The books of the fleet's command line (None: its groups keep their books in process)."""
        if args.books_url is not None:
            return cls(BooksAddress(args.books_url, args.books_password_file, args.books_ca), None, args.keys_file)
        if args.books_password_file is not None or args.books_ca is not None:
            raise ValueError("--books-password-file and --books-ca go with --books-url")
        if args.keys_file is None or not args.groups:
            return None
        server = BooksServer(args.out / "books")
        return cls(server.address, server, args.keys_file)

    def start(self) -> FleetBooks:
        """The fleet's own store running, and the keys pushed (before any launcher waits for them)."""
        if self.server is not None:
            self.server.start()
            print(f"books: {self.address.url} (a redis-server of the fleet's own; its password in "
                  f"{self.address.password_file})", flush=True)
        self.books = self.address.connect()
        if self.keys_file is not None:
            self.push_keys("start")
        return self

    def launcher_args(self) -> list[str]:
        """What each local launcher is given to share them (paths, never the password)."""
        args = ["--books-url", self.address.url]
        if self.address.password_file is not None:
            args += ["--books-password-file", str(Path(self.address.password_file).resolve())]
        if self.address.ca is not None:
            args += ["--books-ca", str(Path(self.address.ca).resolve())]
        return args

    def push_keys(self, why: str) -> bool:
        """The keys file, checked, into the books; whether it was pushed (else the keys in force stay)."""
        try:
            ring = KeyRing.parse(self.keys_file.read_text(encoding="utf-8"), str(self.keys_file))
            version = self.books.push_keys(ring)
        except (ConfigError, OSError, BooksUnavailable) as exc:
            print(f"{why}: the keys were not pushed to the books, the keys in force stay: {exc}", file=sys.stderr,
                  flush=True)
            return False
        print(f"{why}: {len(ring.entries)} key(s) pushed to the books (version {version[:12]}); every group takes "
              "them within a second or two", flush=True)
        return True

    def supervise(self) -> None:
        """A store of the fleet's own that exited is started again on its port; keys the store lost are pushed."""
        if self.server is not None and self.server.exited() is not None:
            log.warning("the books' redis-server exited with %s; starting it again (log %s)", self.server.exited(),
                        self.server.folder / "redis.log")
            try:
                self.server.start()
            except RuntimeError as exc:
                log.error("%s", exc)
                return
        if self.keys_file is None:
            return
        try:
            lost = self.books.keys_version() is None
        except BooksUnavailable:
            return
        if lost:
            self.push_keys("the books lost their keys")

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
