"""Failover: a played world (client/world.PlayedWorld) whose server is lost, beside the same world uninterrupted.

    python -m bench.failover        # = --blocks 40 --kill-after 12 --save-every 4; the tiny random checkpoint

Each case in one run on the same servers: the world played uninterrupted (its block time), then the same steps
with a process of the group that holds it SIGKILLed after `--kill-after` blocks. The world (64x64, frames decoded,
lookahead 1, strict: every block made again must be bit for bit the one received) saves every `--save-every`
blocks. Servers run max_batch 1, so a world's forward is its own wherever it runs (docs/fidelity.md).

1. fleet, tritonserver: a fleet of 2 SP1 groups behind HAProxy (`python -m backend.fleet`, its default
   check interval), the world on group 0 (group 1 held full by paused players of its own while the world starts,
   then freed); group 0's tritonserver killed.
2. fleet, stub: the same, group 0's model stub killed (Triton keeps that stream open).
3. SP2 group, owner rank: one SP2 group with the launcher's healer, the stub of the rank that owns the world killed
   (Triton keeps the dead stub's stream open: the client's stall bound ends it; the resume waits for the heal).

Reported per case: the uninterrupted run's median block interval; from the kill, seconds until the world gave its
stream up and until its next block; that gap in block times; the blocks made again (received since the snapshot)
and steps sent again; the sessions opened to resume; the goal (2 block times plus the blocks made again); whether
every block equals the uninterrupted run's.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from backend.api.contract import MODEL_NAME
from backend.api.request import Controls
from backend.fleet.balancer import server_states, server_stats
from backend.launch.drain import STREAMS_OPEN_METRIC
from backend.launch.metrics_page import metrics_page, samples
from backend.launch.model_repository import write_model_repository
from backend.launch.polling import wait_for
from backend.launch.procfs import stub_pids, tritonserver_of
from backend.launch.server import TritonServer
from backend.launch.wheel import prepare_backends
from backend.parallel.ports import free_port
from bench.common import BUILD_DIR, TINY, engine_settings, ensure_checkpoint, format_table, make_request, server_parameters
from client.steer import SteeredSession
from client.world import DEFAULT_SAVE_EVERY, PlayedWorld

KEYS = ["w", "w", "a", "d", "wa", "j", "l", "w"]


@dataclass
class Played:
    hashes: list[str]
    arrivals: list[float]
    killed_s: float | None = None
    failovers: list = dataclasses.field(default_factory=list)


def play(url: str, blocks: int, save_every: int, kill_after: int | None = None,
         kill: Callable[[], None] | None = None, placed: Callable[[], None] | None = None) -> Played:
    """A world of `blocks` blocks (lookahead 1); `placed` runs after its first block, `kill` after `kill_after`."""
    request = dataclasses.replace(make_request(TINY), num_frames=None, poses=None, keys=KEYS[0])
    keys = [KEYS[i % len(KEYS)] for i in range(blocks)]
    played = Played([], [])
    with PlayedWorld(url, save_every=save_every, strict=True) as world:
        world.start(request)
        sent = 1
        for received in range(blocks):
            while sent < blocks and sent - received <= 1:
                world.step(Controls(keys=keys[sent]), end=sent == blocks - 1)
                sent += 1
            if received == kill_after:
                kill()
                played.killed_s = time.perf_counter()
            block = world.next_block(120)
            played.hashes.append(block.used.latents_sha256)
            played.arrivals.append(block.arrival_s)
            if received == 0 and placed is not None:
                placed()
        world.finish(120)
    played.failovers = world.failovers
    return played


def row(case: str, calm: Played, hit: Played) -> list[str]:
    block_s = statistics.median(b - a for a, b in zip(calm.arrivals, calm.arrivals[1:]))
    gap = min(t for t in hit.arrivals if t > hit.killed_s) - hit.killed_s
    (failover,) = hit.failovers
    seen = gap - failover.took_s  # from the kill until the stream was given up
    goal = (2 + failover.replayed) * block_s
    return [case, f"{block_s * 1000:.0f}", f"{seen:.2f}", f"{gap:.2f}", f"{gap / block_s:.1f}",
            str(failover.replayed), str(failover.resent), str(failover.attempts), f"{goal:.2f}",
            "yes" if hit.hashes == calm.hashes else "NO"]


HEADER = ["case", "block ms", "kill -> given up s", "kill -> next block s", "in blocks", "made again",
          "sent again", "sessions opened", "goal s", "bit for bit"]


# ---------------------------------------------------------------- the fleet's cases


@contextlib.contextmanager
def running_fleet(checkpoint: Path, out: Path) -> Iterator[tuple[str, list[dict], Path, subprocess.Popen]]:
    parameters = server_parameters(engine_settings(checkpoint, TINY, 1)) | {"max_sessions": "2", "max_batch": "1",
                                                                         "max_frames": "1000"}
    for own in ("rendezvous_port", "snapshot_dir"):  # the fleet's: a port per group, one store for all
        parameters.pop(own)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "fleet.log"
    with log.open("wb") as sink:
        process = subprocess.Popen([sys.executable, "-m", "backend.fleet", "--groups", "2", "--kind", "cpu",
                                    "--grpc-port", str(free_port()), "--out", str(out),
                                    *(a for k, v in parameters.items() for a in ("--param", f"{k}={v}"))],
                                   stdout=sink, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "fleet ready" in log.read_text() or process.poll() is not None, 300, "fleet")
        if process.poll() is not None:
            raise RuntimeError(log.read_text())
        manifest = json.loads((out / "fleet.json").read_text())
        yield manifest["grpc_url"], manifest["groups"], Path(manifest["stats_socket"]), process
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


def running_tritonserver(fleet: subprocess.Popen, group: dict) -> int:
    """The group's tritonserver now (a killed one's launcher is restarted by the fleet: a new pid)."""
    pid = tritonserver_of(fleet.pid, group["grpc_port"])
    if pid is None:
        raise RuntimeError(f"{group['name']} has no tritonserver")
    return pid


@contextlib.contextmanager
def held_full(url: str) -> Iterator[None]:
    """Two paused players on a group of its own: the balancer sends new sessions elsewhere while they hold it."""
    request = dataclasses.replace(make_request(TINY, decode=False), num_frames=None, poses=None, keys="w")
    with contextlib.ExitStack() as stack:
        sessions = [stack.enter_context(SteeredSession(url)) for _ in range(2)]
        for s in sessions:
            s.start(request)
        for s in sessions:
            s.next_block(60)
        yield


def fleet_cases(checkpoint: Path, args: argparse.Namespace) -> list[list[str]]:
    rows = []
    with running_fleet(checkpoint, BUILD_DIR / "bench" / "failover_fleet") as (url, groups, stats, fleet):
        group0, group1 = groups

        def weight(name: str) -> str:
            return server_stats(stats)[name]["weight"]

        def on_group0(kill: Callable[[], None] | None) -> Played:
            wait_for(lambda: all(r["status"] == "UP" for r in server_stats(stats).values()), 120, "both groups up")
            with contextlib.ExitStack() as stack:
                stack.enter_context(held_full(f"{group1['host']}:{group1['grpc_port']}"))
                wait_for(lambda: server_states(stats)["group1"].startswith("DRAIN"), 10, "group 1 drained")

                def placed() -> None:  # the world has its slot on group 0: group 1 takes sessions again
                    stack.close()
                    wait_for(lambda: weight("group1") == "100", 10, "group 1 back at full weight")

                return play(url, args.blocks, args.save_every, args.kill_after if kill else None, kill, placed)

        def kill_stub() -> None:
            (stub,) = stub_pids(running_tritonserver(fleet, group0)).values()
            os.kill(stub, signal.SIGKILL)

        for case, kill in (("fleet, stub", kill_stub),
                           ("fleet, tritonserver", lambda: os.kill(running_tritonserver(fleet, group0), signal.SIGKILL))):
            rows.append(row(case, on_group0(None), on_group0(kill)))
            print(format_table(HEADER, rows[-1:], left=1).splitlines()[-1], flush=True)
    return rows


# ---------------------------------------------------------------- the SP2 group's case


def sp2_case(checkpoint: Path, args: argparse.Namespace) -> list[str]:
    out = BUILD_DIR / "bench" / "failover_sp2"
    params = server_parameters(engine_settings(checkpoint, TINY, 2)) | {
        "collective_timeout_s": "5", "max_batch": "1", "max_frames": "1000", "snapshot_dir": str(out / "snapshots")}
    repo = write_model_repository(out / "repo", instances=2, kind="KIND_CPU", parameters=params)
    with TritonServer(repo, backends_dir=prepare_backends(), log_path=out / "tritonserver.log", heal=True) as server:
        server.wait_ready(MODEL_NAME, timeout=300)
        calm = play(server.grpc_url, args.blocks, args.save_every)

        def kill_owner() -> None:
            owner = next(r for r in (0, 1) if streams_open(server, r) > 0)
            os.kill(server.stub_pids()[owner], signal.SIGKILL)

        return row("SP2 group, owner rank", calm, play(server.grpc_url, args.blocks, args.save_every,
                                                         args.kill_after, kill_owner))


def streams_open(server: TritonServer, rank: int) -> float:
    page = metrics_page(f"http://127.0.0.1:{server.metrics_port}/metrics", 10)
    return sum(samples(page, STREAMS_OPEN_METRIC, rank=str(rank)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=40, help="blocks of each world (default: %(default)s)")
    p.add_argument("--kill-after", type=int, default=12, help="blocks received before the kill (default: %(default)s)")
    p.add_argument("--save-every", type=int, default=DEFAULT_SAVE_EVERY, help="(default: %(default)s)")
    p.add_argument("--preset", default="tiny", help="random checkpoint preset (default: %(default)s)")
    p.add_argument("--checkpoint", type=Path, help="a checkpoint instead of the preset's random one")
    args = p.parse_args()
    checkpoint = ensure_checkpoint(args.checkpoint, args.preset)
    began = time.monotonic()
    rows = fleet_cases(checkpoint, args)
    rows.append(sp2_case(checkpoint, args))
    print(format_table(HEADER, rows, left=1))
    print(f"run time {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
