"""The launcher's healer: when a model instance says its group failed (serving/host_signals), wait for the model's
unload, then load it again with the admin key, a bounded number of times with backoff. Clients meanwhile read the
model not ready and get GROUP_FAILED with a retry time; the restricted APIs stay closed to them."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from ..serving.host_signals import HostSignals

ATTEMPTS = 4  # loads tried per failure: 1 + 2 + 4 s of backoff between them
FIRST_BACKOFF_S = 1.0
UNLOAD_WAIT_S = 30.0  # the failed model's unload (it reads not ready within a second: bench/README, kill matrix)
POLL_S = 0.2  # how often the healer looks for a request, and for the unload
LOAD_TIMEOUT_S = 600.0  # one load (a rendezvous and every rank's weights)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Heal:
    why: str  # what the failed instance said
    seconds: float  # from the request to ready (or to giving up)
    attempts: int
    healed: bool


class Healer:
    """Heals the model of the server at `url` on its instances' requests; `start()`, then `stop()`."""

    def __init__(self, url: str, model: str, signals: HostSignals, admin_headers: dict[str, str],
                 attempts: int = ATTEMPTS, first_backoff_s: float = FIRST_BACKOFF_S) -> None:
        self.url, self.model, self.signals, self.admin_headers = url, model, signals, admin_headers
        self.attempts, self.first_backoff_s = attempts, first_backoff_s
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

    def _heal(self, why: str) -> Heal:
        began = time.monotonic()
        log.warning("%s: its group failed (%s); reloading it", self.model, why)
        with grpcclient.InferenceServerClient(self.url) as client:
            self._wait_unloaded(client)
            backoff = self.first_backoff_s
            for attempt in range(1, self.attempts + 1):
                if self._stop.is_set():
                    break
                try:
                    client.load_model(self.model, headers=self.admin_headers, client_timeout=LOAD_TIMEOUT_S)
                    if client.is_model_ready(self.model):
                        took = time.monotonic() - began
                        log.warning("%s: healed %.1f s after its group failed (load %d of %d)", self.model, took,
                                    attempt, self.attempts)
                        return Heal(why, took, attempt, True)
                except InferenceServerException as exc:
                    log.warning("%s: reload %d of %d failed: %s", self.model, attempt, self.attempts, exc.message())
                if attempt < self.attempts and self._stop.wait(backoff):
                    break
                backoff *= 2
        took = time.monotonic() - began
        log.error("%s: not healed after %d loads (%.0f s); it stays unloaded until an operator loads it", self.model,
                  self.attempts, took)
        return Heal(why, took, self.attempts, False)

    def _wait_unloaded(self, client: grpcclient.InferenceServerClient) -> None:
        """Until the failed model reads not ready (a load before its unload would find it serving)."""
        deadline = time.monotonic() + UNLOAD_WAIT_S
        while time.monotonic() < deadline and not self._stop.is_set():
            try:
                if not client.is_model_ready(self.model):
                    return
            except InferenceServerException:
                return
            time.sleep(POLL_S)
