"""The books of a single-host fleet: a redis-server (Debian's `redis-server`, or Valkey's under that name) that the
fleet runs as its child when it is given keys and no `--books-url` (docs/security.md).

It listens on loopback only, on a port of its own, in protected mode, behind a password made fresh for it (a file
under its folder, mode 600; its config file too, so the password is never on a command line), and keeps nothing on
disk: the books are leases that renew themselves and keys that the fleet pushes again, so a restart loses nothing
that is not written again within a lease.
"""
from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from pathlib import Path

from ..launch.server import terminate_with_parent
from ..parallel.ports import free_port
from ..serving.books import Books, BooksAddress, BooksUnavailable

REDIS_SERVER = "redis-server"
READY_S = 10.0  # a redis-server without persistence answers within milliseconds


def redis_binary() -> str:
    """The redis-server on PATH (Debian's package puts it in /usr/bin)."""
    found = shutil.which(REDIS_SERVER)
    if found is None:
        raise FileNotFoundError(f"{REDIS_SERVER} is not installed (Debian's redis-server, or valkey-server under that "
                                "name): needed for the fleet's books, or give --books-url")
    return found


def _private(path: Path, text: str) -> None:
    """`text` in a file only its owner can read, written whole."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(text)


class BooksServer:
    """A loopback redis-server for the books in `folder` (its config, password and log); start() again after it
    exits serves on the same port with the same password."""

    def __init__(self, folder: Path, port: int | None = None) -> None:
        self.folder = Path(folder)
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.folder.mkdir(parents=True, exist_ok=True)
        os.chmod(self.folder, 0o700)
        self.password_file = self.folder / "password"
        _private(self.password_file, secrets.token_urlsafe(32))
        self.config = self.folder / "redis.conf"
        _private(self.config, "\n".join([
            "bind 127.0.0.1", f"port {self.port}", "protected-mode yes",
            f"requirepass {self.password_file.read_text(encoding='utf-8')}",
            'save ""', "appendonly no", f"dir {self.folder.resolve()}", "daemonize no",
            f"logfile {(self.folder / 'redis.log').resolve()}", ""]))

    @property
    def address(self) -> BooksAddress:
        return BooksAddress(f"redis://127.0.0.1:{self.port}/0", self.password_file)

    def start(self, timeout_s: float = READY_S) -> BooksServer:
        """Run it and wait until it answers with its password."""
        self.process = subprocess.Popen([redis_binary(), str(self.config)], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, preexec_fn=terminate_with_parent)
        books, deadline = self.address.connect(), time.monotonic() + timeout_s
        while True:
            try:
                books.keys_version()
                return self
            except BooksUnavailable:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{REDIS_SERVER} did not start on 127.0.0.1:{self.port} (log "
                                       f"{self.folder / 'redis.log'})") from None
                time.sleep(0.02)

    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def connect(self) -> Books:
        return self.address.connect()

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
