"""An instance's keys: what its launcher published (serving/host_signals), at load and whenever it publishes again
(the operator's SIGHUP). The door (`keys.Gate`) takes each new version at once; the keys it no longer holds are
revoked, and their sessions end (`on_revoked`: their tags, for the group loop's news)."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..api.errors import ConfigError
from .host_signals import HostSignals
from .keys import Gate, KeyRing

KEYS_POLL_S = 0.5  # how often an instance looks for a new publication of the keys

log = logging.getLogger("backend")


def gate_of(signals: HostSignals | None) -> Gate:
    """The door of an instance: the launcher's published keys, or open (no keys file, or no launcher)."""
    if signals is None or signals.keys_version() is None:
        return Gate(None)
    ring = KeyRing.parse(signals.read_keys(), "the published keys file")
    log.info("serving %d key(s): a request without one of them is refused", len(ring.entries))
    return Gate(ring)


class KeyWatch:
    """Applies every new publication of the keys to `gate` (the watch is the ring's one writer) and names the keys
    it revoked to `on_revoked`, on the watch's thread."""

    def __init__(self, signals: HostSignals, gate: Gate,
                 on_revoked: Callable[[set[str]], None] = lambda tags: None) -> None:
        self.signals, self.gate, self.on_revoked = signals, gate, on_revoked
        self._version = signals.keys_version()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lingbot-key-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(KEYS_POLL_S):
            version = self.signals.keys_version()
            if version is not None and version != self._version:
                self._version = version
                self._apply()

    def _apply(self) -> None:
        try:
            ring = KeyRing.parse(self.signals.read_keys(), "the published keys file")
        except (ConfigError, OSError) as exc:  # the launcher checks before it publishes: a torn copy, at worst
            log.error("the keys were not reloaded, the keys in force stay: %s", exc)
            return
        old = self.gate.ring or KeyRing([])
        revoked = ring.revoked_since(old)
        self.gate.ring = ring
        names = sorted(e.name for e in old.entries if e.principal.tag in revoked)
        log.info("keys reloaded: %d key(s); revoked: %s", len(ring.entries), ", ".join(names) or "none")
        if revoked:
            self.on_revoked(revoked)

    def close(self) -> None:
        self._done.set()
