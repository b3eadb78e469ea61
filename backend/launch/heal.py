"""The launcher's healer: when a model instance says its group failed (serving/host_signals), wait for the model's
unload, then load it again with the admin key, a bounded number of times with backoff. Clients meanwhile read the
model not ready and get GROUP_FAILED with a retry time; the restricted APIs stay closed to them.

A stub that dies with no peer left to say so (an SP1 group, or the last instance of a host) is seen by the stub
watch: Triton 2.51 neither restarts it nor marks the model not ready (every request then fails with "Stub process
... is not healthy"), so the healer unloads the model itself, then loads it as above. A stub that dies before the
watch first saw it is seen too: the model then reads ready with no stub process left on this server.

Every heal is bounded: the unload's wait, then the failed load's stubs' end (each lets its rank's claim go as it
leaves; one stuck past STUBS_GONE_S, whose claim would refuse the new load, and those that linger are killed), then
at most `attempts` loads, each its own timeout. A heal that does not take ends the launcher (`on_unhealed`): it exits
EXIT_UNHEALED, for its supervisor (the fleet, or the operator's) to start the group afresh."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..parallel.host_claim import MEMBER
from ..serving.host_signals import HostSignals
from ..serving.parent_watch import alive
from .control import ControlError, ModelControl
from .procfs import unix_socket_names

ATTEMPTS = 4  # loads tried per failure: 1 + 2 + 4 s of backoff between them
FIRST_BACKOFF_S = 1.0
UNLOAD_WAIT_S = 30.0  # the failed model's unload (it reads not ready within a second: bench/README, kill matrix)
POLL_S = 0.2  # how often the healer looks for a request, and for the unload
LOAD_TIMEOUT_S = 600.0  # one load (a rendezvous and every rank's weights)
# A stub found dead while the model still reads ready this long after is healed by unloading (a group whose survivors
# saw it reads not ready 0.3-0.4 s after the kill and asks for its own heal: bench/README, kill matrix).
DEAD_STUB_GRACE_S = 1.5
ADOPT_EVERY_S = 1.0  # how often the stub watch asks whether a model it watches no stubs of reads ready
# A stub of the failed load lets its rank's claim go once it has left its group and freed the model (its process
# may linger after, its Triton instance never finalised). One that still holds its claim this long after the unload is
# stuck (in an exchange or a join with a dead peer), and a load would be refused (RELOAD_REFUSED) or wait for it in the
# rendezvous: the healer kills it before it loads.
STUBS_GONE_S = 10.0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Heal:
    why: str  # what the failed instance said
    seconds: float  # from the request to ready (or to giving up)
    attempts: int
    healed: bool


class StubWatch:
    """The loaded model's stub processes: `adopt` them while the model reads ready, `dead()` names the ranks whose
    stub has died since (then the watch waits for the next load)."""

    def __init__(self, find: Callable[[], dict[int, int]]) -> None:
        self.find = find  # rank -> pid of the server's live stubs now (TritonServer.stub_pids)
        self.stubs: dict[int, int] = {}

    def adopt(self) -> bool:
        """Watch the stubs alive now; False when there is none (a model that reads ready has lost them all)."""
        self.stubs = self.find()
        return bool(self.stubs)

    def dead(self) -> list[int]:
        dead = [rank for rank, pid in self.stubs.items() if not alive(pid)]
        if dead:
            self.stubs = {}
        return dead


class Healer:
    """Heals the model of the server that `control` reaches on its instances' requests, and when one of its stubs
    (`stubs`: a rank -> pid finder) dies while it reads ready; `start()`, then `stop()`. A heal that does not take
    within its loads calls `on_unhealed` (the launcher then ends, for its supervisor to start the group afresh)."""

    def __init__(self, control: ModelControl, model: str, signals: HostSignals, attempts: int = ATTEMPTS,
                 first_backoff_s: float = FIRST_BACKOFF_S, stubs: Callable[[], dict[int, int]] | None = None,
                 on_unhealed: Callable[[Heal], None] = lambda heal: None) -> None:
        self.control, self.model, self.signals = control, model, signals
        self.attempts, self.first_backoff_s = attempts, first_backoff_s
        self.stubs, self.on_unhealed = stubs, on_unhealed
        self.watch = None if stubs is None else StubWatch(stubs)
        self._next_adopt_s = 0.0
        self._dead: tuple[float, list[int]] | None = None  # when the watch saw stubs die, and their ranks
        self.heals: list[Heal] = []  # every heal so far, in order
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lingbot-healer", daemon=True)

    def start(self) -> Healer:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 1.0) -> None:
        """No new load is started; one in progress fails with the server's stop."""
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            why = self.signals.take_heal()
            if why is not None:
                self.heals.append(self._heal(why))
            elif self.watch is not None and (why := self._dead_stub(self.control)):
                self.heals.append(self._heal(why, unload=True))
            else:
                continue
            if not self.heals[-1].healed and not self._stop.is_set():
                self.on_unhealed(self.heals[-1])
                return
            if self.watch is not None:
                self.watch.stubs, self._dead = {}, None  # the reload's stubs are adopted once it reads ready
            if (late := self.signals.take_heal()) is not None:  # the same failure, told while it was healed
                log.info("%s: dropped a heal request made during the heal (%s)", self.model, late)

    def _ready(self, client: ModelControl) -> bool:
        return client.is_model_ready(self.model)

    def _dead_stub(self, client: ModelControl) -> str | None:
        """Why to heal a model whose stub died with nobody to tell: it still reads ready DEAD_STUB_GRACE_S after the
        death was seen (a survivor's own request, read first by _run, wins meanwhile); else None. A model that reads
        ready with no stub at all (they died before the watch saw them) counts as a death of every rank."""
        assert self.watch is not None
        if self._dead is None:
            if self.watch.stubs:
                if dead := self.watch.dead():
                    self._dead = (time.monotonic(), dead)
            elif time.monotonic() >= self._next_adopt_s:  # a model not loaded is asked about once a second
                self._next_adopt_s = time.monotonic() + ADOPT_EVERY_S
                if self._ready(client) and not self.watch.adopt():
                    self._dead = (time.monotonic(), [])
            return None
        seen_s, dead = self._dead
        if time.monotonic() - seen_s < DEAD_STUB_GRACE_S:
            return None
        self._dead = None
        if not self._ready(client):
            return None  # unloaded by its group or its operator
        if not dead:
            if self.watch.adopt():
                return None  # its stubs are there after all: watched from now on
            return "no stub of the model is alive and it still read ready"
        return f"the stub of rank {', '.join(map(str, dead))} died and the model still read ready"

    def _heal(self, why: str, unload: bool = False) -> Heal:
        began = time.monotonic()
        log.warning("%s: its group failed (%s); reloading it", self.model, why)
        client = self.control
        if unload:
            try:
                client.unload_model(self.model)
            except ControlError as exc:
                log.warning("%s: unloading it failed: %s", self.model, exc)
        self._wait_unloaded(client)
        self._end_stubs()
        backoff = self.first_backoff_s
        for attempt in range(1, self.attempts + 1):
            if self._stop.is_set():
                break
            try:
                client.load_model(self.model, LOAD_TIMEOUT_S)
                if client.is_model_ready(self.model):
                    took = time.monotonic() - began
                    log.warning("%s: healed %.1f s after its group failed (load %d of %d)", self.model, took,
                                attempt, self.attempts)
                    return Heal(why, took, attempt, True)
            except ControlError as exc:
                log.warning("%s: reload %d of %d failed: %s", self.model, attempt, self.attempts, exc)
            if attempt < self.attempts and self._stop.wait(backoff):
                break
            backoff *= 2
        took = time.monotonic() - began
        log.error("%s: not healed after %d loads (%.0f s)", self.model, self.attempts, took)
        return Heal(why, took, self.attempts, False)

    def _end_stubs(self) -> None:
        """Before a load: no stub of the failed load is left. Each lets its rank's claim go as it leaves its group;
        one that still holds it STUBS_GONE_S after the unload is stuck. Then every stub still alive (none of the new
        load is yet) is killed (SIGKILL: a stuck one may be blocked where no signal handler runs; one that left its
        group lingers with its model's instance never finalised), so the new load's stubs are the server's only
        ones."""
        if self.stubs is None:
            return
        deadline = time.monotonic() + STUBS_GONE_S
        while (holding := self._holding()) and time.monotonic() < deadline and not self._stop.wait(POLL_S):
            pass
        for rank, pid in holding.items():
            log.warning("%s: the stub of rank %d (pid %d) still held its rank %g s after the unload; killing it",
                        self.model, rank, pid, STUBS_GONE_S)
        for pid in self.stubs().values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + STUBS_GONE_S  # gone once their server reaps them
        while self.stubs() and time.monotonic() < deadline and not self._stop.wait(POLL_S):
            pass

    def _holding(self) -> dict[int, int]:
        """The server's stubs (rank -> pid) that hold a member's claim on their rank."""
        return {rank: pid for rank, pid in self.stubs().items()
                if any(name.startswith(f"@{MEMBER}-") for name in unix_socket_names(pid))}

    def _wait_unloaded(self, client: ModelControl) -> None:
        """Until the failed model reads not ready (a load before its unload would find it serving)."""
        deadline = time.monotonic() + UNLOAD_WAIT_S
        while time.monotonic() < deadline and not self._stop.is_set():
            if not client.is_model_ready(self.model):
                return
            time.sleep(POLL_S)
