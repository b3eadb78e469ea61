"""Many groups behind one address: what the balancer costs and what it buys (`python -m backend.fleet`).

    python -m bench.fleet [--steps 60] [--rounds 3] [--sessions 4]

One fleet of 2 SP1 groups on the tiny checkpoint (max_sessions = --sessions each), real HAProxy in front. Side by
side, in one run:

1. Added latency: a steered session's step (request to its block) straight to group 0 and through the balancer,
   taking turns, `--steps` each; and a unary gRPC round trip (`is_model_ready`), 200 each, taking turns.
2. Finding room: group 0 filled by clients of its own (not through the balancer); seconds until its agent takes
   it out of the rotation (weight 0), then a new session's time to first block through the balancer against the
   same session straight to the idle group 1.
3. One group against two: `--sessions` whole trajectories at once straight to group 0, then through the balancer
   (spread over both groups), taking turns `--rounds` times: blocks per second. On a CPU host both groups share
   the same cores, so this measures their contention, not scale-out (see bench/README section 14).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import tritonclient.grpc as grpcclient

from backend.api import contract
from backend.api.request import Controls
from backend.fleet.balancer import server_stats
from backend.launch.polling import wait_for
from backend.parallel.ports import free_port
from bench.common import (BUILD_DIR, TINY, engine_settings, ensure_checkpoint, format_table, make_request, percentile,
                          server_parameters)
from client.steer import SteeredSession
from client.stream import StreamRequest, request_inputs, run_sessions

CHECK_S = 1.0  # the fleet's default check interval


@dataclasses.dataclass
class Fleet:
    url: str
    groups: list[dict]
    stats_socket: Path

    def weight(self, name: str) -> int:
        """The group's weight as its agent last said: 0 while every slot is held."""
        return int(server_stats(self.stats_socket)[name]["weight"])



@contextlib.contextmanager
def running_fleet(checkpoint: Path, sessions: int, out: Path, sp: int = 1, **settings: str) -> Iterator[Fleet]:
    """Two groups of `sp` instances each; settings: more server parameters of every group."""
    parameters = server_parameters(engine_settings(checkpoint, TINY, sp)) | {"max_sessions": str(sessions),
                                                                          "max_queue": str(4 * sessions)} | settings
    parameters.pop("rendezvous_port", None)  # the fleet gives each group its own
    parameters.pop("snapshot_dir", None)  # and every group one store, so SIGTERM drains a group
    port = free_port()
    out.mkdir(parents=True, exist_ok=True)
    with (out / "fleet.log").open("wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "backend.fleet", "--groups", "2", "--sp", str(sp),
                                    "--kind", "cpu",
                                    "--grpc-port", str(port), "--out", str(out),
                                    *(a for k, v in parameters.items() for a in ("--param", f"{k}={v}"))],
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "fleet ready" in (out / "fleet.log").read_text() or process.poll() is not None, 300,
                 "fleet")
        if process.poll() is not None:
            raise RuntimeError((out / "fleet.log").read_text())
        manifest = json.loads((out / "fleet.json").read_text())
        yield Fleet(manifest["grpc_url"], manifest["groups"], Path(manifest["stats_socket"]))
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


def steered_request():
    return dataclasses.replace(make_request(TINY, decode=False), num_frames=None, poses=None, keys="w")


def step_latencies(url: str, steps: int) -> list[float]:
    """One steered session: `steps` steps sent one at a time, each waited for; seconds from each to its block."""
    with SteeredSession(url) as session:
        session.start(steered_request())
        session.next_block(60)
        latencies = []
        for i in range(steps):
            session.step(Controls(keys="w"), end=i == steps - 1)
            block = session.next_block(60)
            latencies.append(block.arrival_s - session.sent_s[-1])
    return latencies


def unary_round_trips(urls: dict[str, str], count: int) -> dict[str, list[float]]:
    clients = {k: grpcclient.InferenceServerClient(u) for k, u in urls.items()}
    times: dict[str, list[float]] = {k: [] for k in urls}
    for _ in range(count):
        for k, c in clients.items():
            began = time.perf_counter()
            c.is_model_ready(contract.MODEL_NAME)
            times[k].append(time.perf_counter() - began)
    for c in clients.values():
        c.close()
    return times


@contextlib.contextmanager
def holding(url: str, count: int) -> Iterator[None]:
    """`count` paused players that each keep a slot."""
    with contextlib.ExitStack() as stack:
        sessions = [stack.enter_context(SteeredSession(url)) for _ in range(count)]
        for s in sessions:
            s.start(steered_request())
        for s in sessions:
            s.next_block(60)
        yield


def first_block_s(url: str) -> float:
    (result,) = run_sessions(url, [StreamRequest(request_inputs(make_request(dataclasses.replace(TINY, blocks=1),
                                                                                         decode=False)),
                                                 parameters={contract.PARAM_DECODE: False})], timeout=60)
    if result.error is not None:
        raise result.error
    return result.time_to_first_block_s


def throughput(url: str, sessions: int) -> float:
    """Blocks per second of `sessions` whole trajectories at once."""
    request = make_request(TINY, decode=False)
    began = time.perf_counter()
    results = run_sessions(url, [StreamRequest(request_inputs(dataclasses.replace(request, seed=i)),
                                               parameters={contract.PARAM_DECODE: False})
                                 for i in range(sessions)], timeout=300, keep_data=False)
    took = time.perf_counter() - began
    if errors := [r.error for r in results if r.error]:
        raise RuntimeError(errors)
    return sum(len(r.blocks) for r in results) / took


def ms(values: list[float], q: float) -> str:
    return f"{1000 * percentile(values, q):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--steps", type=int, default=60, help="steered steps each way")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=4, help="max_sessions of each group, and section 3's load")
    args = parser.parse_args()
    checkpoint = ensure_checkpoint(args.checkpoint, "tiny")
    began = time.monotonic()
    with running_fleet(checkpoint, args.sessions, BUILD_DIR / "bench" / "fleet") as fleet:
        print(f"fleet of 2 SP1 groups ready after {time.monotonic() - began:.1f} s")
        group0, group1 = fleet.groups
        direct0, direct1 = (f"{g['host']}:{g['grpc_port']}" for g in fleet.groups)
        step_latencies(fleet.url, 3), step_latencies(direct0, 3)  # warm-up
        steps: dict[str, list[float]] = {"direct": [], "balancer": []}
        for _ in range(4):
            for name, url in (("direct", direct0), ("balancer", fleet.url)):
                steps[name] += step_latencies(url, args.steps // 4)
        trips = unary_round_trips({"direct": direct0, "balancer": fleet.url}, 200)
        rows = [[f"steered step, {label} ms", ms(steps["direct"], q), ms(steps["balancer"], q),
                 f"{percentile(steps['balancer'], q) / percentile(steps['direct'], q):.3f}"]
                for label, q in (("p10", 10), ("median", 50))]
        rows.append(["unary round trip, median ms", ms(trips["direct"], 50), ms(trips["balancer"], 50),
                     f"{percentile(trips['balancer'], 50) / percentile(trips['direct'], 50):.3f}"])
        print(format_table(["", "direct to group 0", "through the balancer", "ratio"], rows))

        rows = []
        for _ in range(args.rounds):
            with holding(direct0, args.sessions):
                drained_s = wait_for(lambda: fleet.weight(group0["name"]) == 0, 10, "weight 0")
                through = first_block_s(fleet.url)
                straight = first_block_s(direct1)
            wait_for(lambda: fleet.weight(group0["name"]) > 0, 10, "group 0 back")
            rows.append([f"{drained_s:.2f}", f"{1000 * through:.0f}", f"{1000 * straight:.0f}",
                         f"{through / straight:.2f}"])
        print(format_table(["group 0 full -> weight 0 s", "TTFB through balancer ms", "TTFB straight to group 1 ms",
                            "ratio"], rows))

        one, two = [], []
        for _ in range(args.rounds):
            one.append(throughput(direct0, args.sessions))
            two.append(throughput(fleet.url, args.sessions))
        print(format_table(["", "1 group (straight to group 0)", "2 groups (through the balancer)", "ratio"], [
            [f"{args.sessions} sessions at once, blocks/s (median of {args.rounds})", f"{statistics.median(one):.2f}",
             f"{statistics.median(two):.2f}", f"{statistics.median(two) / statistics.median(one):.2f}"]]))
    print(f"run time {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
