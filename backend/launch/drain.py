"""The launcher's drain, what SIGTERM does when the server keeps snapshots (`snapshot_dir` set): the group leaves the
balancer's rotation for new sessions (its capacity agent says `drain`), its instances save every steered session at
the next block boundary and end it MOVED with its snapshot's id (the `drain` signal: serving/host_signals), and the
launcher waits until no stream is open, or a bound, before it stops the server as it always does (docs/serving.md,
"Stopping"). Whole trajectories run to their end within the bound."""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..api.contract import MODEL_NAME
from .agent import CapacityAgent
from .metrics_page import metrics_page, samples
from .server import TritonServer

STREAMS_OPEN_METRIC = "lingbot_world_streams_open"
# The drain's default bound: the writes of a full group's snapshots. At the 14B geometry a world is 27 GiB
# (docs/worlds.md), so max_sessions' default 4 is 108 GiB, whatever the SP degree (each rank writes its share):
# 54 s at 2 GB/s (one local NVMe drive), plus the block in progress; twice that leaves room for a slower disk or a
# whole trajectory to finish. On CPU at the tiny and mid presets a drain takes about a second (bench/README).
DRAIN_TIMEOUT_S = 120.0
# How long the drain waits for a balancer to hear `drain` from the agent before the instances move their worlds (so
# that a moved client's resume through the balancer lands on another group): HAProxy asks every agent-inter, 2 s by
# default and the fleet's check interval (1 s) there; without a balancer the drain goes on after this.
AGENT_TOLD_S = 3.0
POLL_S = 0.2  # how often the drain reads the server's streams


@dataclass(frozen=True)
class Drained:
    seconds: float  # from the drain's start to the group's last stream (or to the bound)
    streams_at_start: int  # streams open when the drain began
    streams_left: int  # open at the end: 0 unless the bound ran out


def streams_open(metrics_text: str, model: str = MODEL_NAME) -> int:
    """Streams the server's instances are answering: every rank's gauge, summed (0 when no instance publishes one)."""
    return round(sum(samples(metrics_text, STREAMS_OPEN_METRIC, model=model)))


def open_streams(server: TritonServer) -> int:
    """The server's open streams; 0 when it serves nothing (exited, its model not ready: a failed group's streams
    ended GROUP_FAILED)."""
    if server.process is None or server.process.poll() is not None or not server.control.is_model_ready(MODEL_NAME):
        return 0
    try:
        return streams_open(metrics_page(f"http://{server.host}:{server.metrics_port}/metrics", 1.0))
    except OSError:
        return 0


def drain(server: TritonServer, agent: CapacityAgent | None, timeout_s: float = DRAIN_TIMEOUT_S) -> Drained:
    """Take the group out of the rotation, ask its instances to move their worlds, and wait until no stream is open
    or `timeout_s` has passed."""
    began = time.monotonic()
    deadline = began + timeout_s
    at_start = open_streams(server)
    if agent is not None:
        agent.drain()
        agent.told.wait(max(0.0, min(AGENT_TOLD_S, deadline - time.monotonic())))
    server.signals.ask_drain()
    while (left := open_streams(server)) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return Drained(time.monotonic() - began, at_start, left)
