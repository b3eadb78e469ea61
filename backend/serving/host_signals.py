"""Signals between a tritonserver's launcher and the model instances it hosts: files in a private directory that
the launcher makes and names in the server's environment (Triton passes it on to every stub).

Four signals, one writer each: an instance whose group failed asks for a reload (`heal`; the launcher's healer
reloads the model, see launch/heal.py); the launcher, about to stop the server, asks the instances to end
every session now (`stop`), so that Triton finds nothing in flight and exits at once; the launcher, to restart or
move the group, asks the instances to drain (`drain`: take no new session, save every steered one and end it
MOVED, for its client to resume elsewhere); and the launcher publishes the keys file it checked (`keys`, at start
and on SIGHUP), which every instance reloads when it changes.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

SIGNALS_VARIABLE = "LINGBOT_HOST_SIGNALS"
STOP_POLL_S = 0.1  # how often an instance looks for the stop signal

log = logging.getLogger("backend")


class HostSignals:
    """The signal files of one server (a directory only its owner can enter)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.heal_path = self.directory / "heal"
        self.stop_path = self.directory / "stop"
        self.drain_path = self.directory / "drain"
        self.keys_path = self.directory / "keys"

    @classmethod
    def from_environment(cls) -> HostSignals | None:
        """The server's signals, where its launcher set them up (else None: nobody heals or stops it early)."""
        directory = os.environ.get(SIGNALS_VARIABLE)
        return cls(Path(directory)) if directory else None

    def environment(self) -> dict[str, str]:
        return {SIGNALS_VARIABLE: str(self.directory)}

    def ask_heal(self, why: str) -> None:
        """An instance: the group failed; reload the model."""
        _write(self.heal_path, why)

    def take_heal(self) -> str | None:
        """The launcher: why a reload was asked for (the request is consumed), or None."""
        try:
            why = self.heal_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return None
        self.heal_path.unlink(missing_ok=True)
        return why

    def ask_stop(self) -> None:
        """The launcher: the server is about to stop."""
        _write(self.stop_path, "stop")

    def stop_asked(self) -> bool:
        return self.stop_path.exists()

    def ask_drain(self) -> None:
        """The launcher: the group is being restarted or moved."""
        _write(self.drain_path, "drain")

    def drain_asked(self) -> bool:
        return self.drain_path.exists()

    def publish_keys(self, text: str) -> None:
        """The launcher: the keys file's text, checked (the instances serve these keys only)."""
        _write(self.keys_path, text)

    def keys_version(self) -> tuple[int, int] | None:
        """Which publication of the keys is there (each is a new file: its inode and time), None: no keys."""
        try:
            stat = self.keys_path.stat()
        except FileNotFoundError:
            return None
        return stat.st_ino, stat.st_mtime_ns

    def read_keys(self) -> str:
        return self.keys_path.read_text(encoding="utf-8")


def _write(path: Path, text: str) -> None:
    """Written whole, then renamed: a reader sees the signal complete or not at all."""
    partial = path.with_suffix(".partial")
    partial.write_text(text, encoding="utf-8", errors="replace")  # a stub's locale may be ASCII
    partial.replace(path)


class StopWatch:
    """An instance's watch for the launcher's drain and stop signals: `on_drain`, then `on_stop`, each runs once,
    on the watch's thread, when its signal appears."""

    def __init__(self, signals: HostSignals, on_stop: Callable[[], None], on_drain: Callable[[], None]) -> None:
        self.signals, self.on_stop, self.on_drain = signals, on_stop, on_drain
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lingbot-stop-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        drained = False
        while not self._done.wait(STOP_POLL_S):
            if not drained and self.signals.drain_asked():
                log.info("the server drains: no new session; every steered one is saved and moved")
                self.on_drain()
                drained = True
            if self.signals.stop_asked():
                log.info("the server is stopping: every session ends now")
                self.on_stop()
                return

    def close(self) -> None:
        self._done.set()
