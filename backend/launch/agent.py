"""A group's capacity agent: HAProxy's `agent-check` text protocol on a TCP port, so a balancer in front of several
groups sends new sessions to those with free slots (the fleet: backend/fleet/).

Each connection gets one line and is closed; what the peer sends is never read. The queue is built from what the
group itself publishes: the model's readiness (HTTP `/v2/models/<model>/ready`), `max_sessions` from its model
config (`described_max_sessions`, api/description) and the free slots from its metrics port
(`lingbot_world_free_slots`, which rank 0 publishes: adapter/metrics.py):

- `ready up 75%`: free slots over max_sessions as the server's weight (1% at least while one is free); `ready`
  also ends a drain (a restarted launcher's, or one an operator set by hand).
- `ready up 0%`: every slot is held: weight 0, so no new session is sent here while another group has room (a
  session that meets every group full reaches one through its backup line and waits in that group's queue:
  balancer.py).
- `drain`: the group drains (its launcher's SIGTERM: launch/drain.py): HAProxy's DRAIN state, which its backup line
  follows too, so no new session or resume reaches the group at all while its worlds move elsewhere.
- `down`: the model is not ready (loading, healing, or its server gone).
"""
from __future__ import annotations

import json
import logging
import socketserver
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from ..api.contract import MODEL_NAME
from ..api.description import PREFIX
from .metrics_page import metrics_page, samples

FREE_SLOTS_METRIC = "lingbot_world_free_slots"
READ_TIMEOUT_S = 1.0  # one read of the server's HTTP or metrics port
DRAIN_LINE = "drain\n"
FRESH_S = 0.25  # a reply is reused this long: a flood of connections costs the server no more than 4 reads a second

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GroupState:
    ready: bool
    free_slots: int | None = None  # None: not published (yet)
    max_sessions: int | None = None


def agent_reply(state: GroupState) -> str:
    """The agent-check line for a group's state."""
    if not state.ready or not state.max_sessions or state.free_slots is None:
        return "down\n"
    if state.free_slots <= 0:
        return "ready up 0%\n"
    percent = max(1, min(100, round(100 * state.free_slots / state.max_sessions)))
    return f"ready up {percent}%\n"


def free_slots_of(metrics_text: str, model: str = MODEL_NAME) -> int | None:
    """The group's free slots in a Prometheus text page (rank 0's gauge), None when it is not there."""
    values = samples(metrics_text, FREE_SLOTS_METRIC, model=model, rank="0")
    return int(values[0]) if values else None


class GroupProbe:
    """Reads a group's state from its server's HTTP and metrics ports (loopback or another host)."""

    def __init__(self, host: str, http_port: int, metrics_port: int, model: str = MODEL_NAME) -> None:
        self.model = model
        self.http = f"http://{host}:{http_port}/v2/models/{model}"
        self.metrics = f"http://{host}:{metrics_port}/metrics"
        self._max_sessions: int | None = None  # read once per load: it changes only with the model's config

    def state(self) -> GroupState:
        try:
            urllib.request.urlopen(self.http + "/ready", timeout=READ_TIMEOUT_S).close()  # 200, else HTTPError
            if self._max_sessions is None:
                with urllib.request.urlopen(self.http + "/config", timeout=READ_TIMEOUT_S) as reply:
                    parameters = json.load(reply).get("parameters", {})
                self._max_sessions = int(parameters[PREFIX + "max_sessions"]["string_value"])
            free = free_slots_of(metrics_page(self.metrics, READ_TIMEOUT_S), self.model)
        except (OSError, ValueError, KeyError):  # not ready (HTTPError is an OSError), unreachable, no description
            self._max_sessions = None
            return GroupState(False)
        return GroupState(True, free, self._max_sessions)


class _Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.settimeout(READ_TIMEOUT_S)
        agent = self.server.agent  # type: ignore[attr-defined]
        line = agent.reply()
        try:
            self.request.sendall(line.encode())
        except OSError:
            return  # the peer left first
        agent.answered(line)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # a burst of connections waits to be accepted, not for SYN retries (the default is 5)


class CapacityAgent:
    """Serves `probe`'s state on `address:port` (loopback unless opened on purpose); `start()`, then `stop()`."""

    def __init__(self, probe: GroupProbe, port: int, address: str = "127.0.0.1") -> None:
        self.probe = probe
        self._lock = threading.Lock()
        self._last: tuple[float, str] | None = None
        self._draining = False
        self.told = threading.Event()  # a peer heard `drain`: a balancer took the group out
        try:
            self._server = _Server((address, port), _Handler)
        except OSError as exc:
            raise ValueError(f"the agent port {address}:{port} cannot be bound ({exc.strerror}): pass --agent-port "
                             f"with a free port") from None
        self._server.agent = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, name="lingbot-agent", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def reply(self) -> str:
        with self._lock:  # one probe at a time; connections meanwhile share its answer
            now = time.monotonic()
            if self._last is None or now - self._last[0] > FRESH_S:
                # Draining, it reads nothing: whatever the group reads, its streams must not be cut (a `down` would)
                # while their worlds move.
                self._last = (now, DRAIN_LINE if self._draining else agent_reply(self.probe.state()))
            return self._last[1]

    def answered(self, line: str) -> None:
        """A peer was sent `line` (the handler's thread)."""
        with self._lock:
            if line == DRAIN_LINE:
                self.told.set()

    def drain(self) -> None:
        """From now on the group says `drain`: it leaves the rotation for good (a restarted launcher has a new
        agent)."""
        with self._lock:
            self._draining, self._last = True, None

    def start(self) -> CapacityAgent:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
