"""A fault soak: worlds that play on through many faults in a row, none lost, each bit for bit its uninterrupted twin.

    python -m bench.soak [--faults 50] [--worlds 4] [--pace-s 0.5] [--save-every 2]

One fleet of 2 SP2 groups on the tiny random checkpoint (`python -m backend.fleet --sp 2`, check interval 1 s;
max_sessions = --worlds each, so either group holds every world; max_batch 1, so a world's blocks are bit for bit those
of a lone run), real HAProxy in front. --worlds played worlds (client/world.PlayedWorld, as `play` and the page play:
lookahead 1, saved every --save-every blocks, strict: a block made again must be the one received) play through the
balancer, a step every --pace-s, while faults come one after another, each once the fleet is whole again (the group
hit has new stubs and is back in the balancer's rotation) and every world has made two blocks since:

- rolling restart: `fleet rolling-restart` (each group drained and restarted in turn; one fault, two drains);
- SIGTERM launcher: a group's launcher drains it and stops; the fleet starts it again;
- SIGKILL tritonserver: the fleet restarts its launcher;
- SIGKILL stub rank 0, SIGKILL stub rank 1: one rank of an SP2 group (the survivor fails the group, the healer
  reloads it; rank 0 also hosts the group's store);
- SIGKILL stub mid-save: rank 0's stub the moment its log says a save's parts were copied, its files not yet written;
- SIGKILL launcher: its tritonserver ends with it; the fleet starts it again.

Each fault hits the group answering the most streams. Then, in the same run, every world is played again from its
start on the same steps with no fault (save_every 0): its blocks must equal the soaked world's, bit for bit.

Reported per kind: faults, worlds lost (the goal: 0), the worlds each fault interrupted, blocks made again (received
since the snapshot a world resumed from), from the fault (in a rolling restart: the SIGTERM of the world's group) to
each interrupted world's next new block (p50, p99, max), and from the fault to the fleet whole again.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import signal
import statistics
import threading
import time
from pathlib import Path

from backend.api.contract import MODEL_NAME
from backend.api.request import Controls
from backend.fleet.balancer import server_states
from backend.launch.control import ModelControl
from backend.launch.drain import streams_open
from backend.launch.metrics_page import metrics_page
from backend.launch.polling import wait_for
from backend.launch.procfs import children, command_line, stub_pids
from backend.fleet.restart import rolling_restart
from bench.common import BUILD_DIR, TINY, ensure_checkpoint, format_table, make_request, percentile
from bench.fleet import running_fleet
from client.world import Failover, PlayedWorld

KINDS = ("rolling restart", "SIGTERM launcher", "SIGKILL tritonserver", "SIGKILL stub rank 0", "SIGKILL stub rank 1",
         "SIGKILL stub mid-save", "SIGKILL launcher")
KEYS = ("w", "a", "s", "d", "wa", "wd", "j", "l", "i", "k")
SP = 2
BLOCK_TIMEOUT_S = 300.0  # a caller's bound on any one block: the world's own stall bound and resume bound come first
WHOLE_TIMEOUT_S = 300.0  # a fault's group back with new stubs in rotation, and two blocks of every world since
SAVE_SEEN_TIMEOUT_S = 60.0  # the mid-save kill waits this long for a save on its group
SAVED_LINE = "into snapshot"  # the group loop's "session ... saved at block N into snapshot ID" (loop._save)


@dataclasses.dataclass
class Lost:
    """A stream a world gave up: when (time.perf_counter()), and the failover once it was through."""

    at: float
    through: Failover | None = None


class SoakedWorld:
    """One world played on its own thread until `stop`: block i on `keys[i]` (drawn from its seed); every block's
    hash and arrival, and each stream it lost."""

    def __init__(self, url: str, seed: int, pace_s: float, save_every: int) -> None:
        self.url, self.pace_s, self.save_every = url, pace_s, save_every
        self.request = dataclasses.replace(make_request(TINY), num_frames=None, poses=None, keys=KEYS[0], seed=seed)
        self._draw = random.Random(seed)
        self.keys: list[str] = [KEYS[0]]
        self.hashes: list[str] = []
        self.arrivals: list[float] = []
        self.lost: list[Lost] = []
        self.error: Exception | None = None
        self.failed_at = float("inf")  # when it was lost (time.perf_counter())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"world-{seed}", daemon=True)

    def start(self) -> SoakedWorld:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 300.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    @property
    def playing(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def blocks_since(self, t: float) -> int:
        return sum(a > t for a in self.arrivals)

    def _failover(self, failover: Failover) -> None:
        if failover.took_s is None:
            self.lost.append(Lost(time.perf_counter()))
        else:
            self.lost[-1].through = failover

    def _run(self) -> None:
        try:
            with PlayedWorld(self.url, save_every=self.save_every, strict=True, on_failover=self._failover) as world:
                world.start(self.request)
                sent = 1
                while True:
                    while not self._stop.is_set() and sent - len(self.hashes) <= 1:  # lookahead 1
                        self.keys.append(self._draw.choice(KEYS))
                        world.step(Controls(keys=self.keys[-1]))
                        sent += 1
                    block = world.next_block(BLOCK_TIMEOUT_S)
                    self.hashes.append(block.used.latents_sha256)
                    self.arrivals.append(block.arrival_s)
                    if self._stop.is_set() and len(self.hashes) == sent:
                        break
                    time.sleep(max(0.0, block.arrival_s + self.pace_s - time.perf_counter()))
                world.finish(BLOCK_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a lost world is what the soak counts
            self.error, self.failed_at = exc, time.perf_counter()


def twin_hashes(url: str, world: SoakedWorld) -> list[str]:
    """The same world's blocks on the same steps with no fault (and no save)."""
    hashes = []
    with PlayedWorld(url, save_every=0, strict=True) as twin:
        twin.start(world.request)
        for i in range(1, len(world.keys) + 1):
            if i < len(world.keys):
                twin.step(Controls(keys=world.keys[i]), end=i == len(world.keys) - 1)
            hashes.append(twin.next_block(BLOCK_TIMEOUT_S).used.latents_sha256)
        twin.finish(BLOCK_TIMEOUT_S)
    return hashes


@dataclasses.dataclass
class Fault:
    kind: str
    group: str  # the group hit ("both": a rolling restart)
    at: float  # time.perf_counter() of the fault
    whole_s: float = 0.0  # from the fault to the fleet whole again
    signals: tuple[float, ...] = ()  # a rolling restart: each group's SIGTERM (time.perf_counter())

    def hit_before(self, t: float) -> float:
        """When the fault hit what a world lost at `t`: its group's SIGTERM in a rolling restart."""
        return max((s for s in self.signals if s <= t), default=self.at)


class Soak:
    def __init__(self, out: Path, url: str) -> None:
        self.out, self.url = out, url

    def manifest(self) -> dict:
        return json.loads((self.out / "fleet.json").read_text())

    def group(self, name: str) -> dict:
        return next(g for g in self.manifest()["groups"] if g["name"] == name)

    def busiest(self, turn: int) -> str:
        """The group answering the most streams (ties: the groups in turn)."""
        counts = {}
        for g in self.manifest()["groups"]:
            try:
                counts[g["name"]] = streams_open(metrics_page(f"http://{g['host']}:{g['metrics_port']}/metrics", 2))
            except OSError:
                counts[g["name"]] = -1
        names = sorted(counts)
        return max(names, key=lambda n: (counts[n], names.index(n) == turn % len(names)))

    def server_and_stubs(self, name: str) -> tuple[int, dict[int, int]]:
        launcher = self.group(name)["launcher_pid"]
        (server,) = [p for p in children(launcher) if command_line(p)[:1] and "tritonserver" in command_line(p)[0]]
        return server, stub_pids(server)

    def hit(self, kind: str, name: str) -> tuple[float, tuple[float, ...]]:
        """Put the fault in; returns when (time.perf_counter()), and each SIGTERM of a rolling restart."""
        if kind == "rolling restart":
            at, clocks = time.perf_counter(), time.perf_counter() - time.monotonic()
            return at, tuple(r.sigterm_s + clocks for r in rolling_restart(self.out))
        launcher = self.group(name)["launcher_pid"]
        server, stubs = self.server_and_stubs(name)
        if kind == "SIGKILL stub mid-save":
            with Path(self.group(name)["log"]).with_name("tritonserver.log").open(errors="replace") as log:
                log.seek(0, os.SEEK_END)
                wait_for(lambda: SAVED_LINE in log.read(), SAVE_SEEN_TIMEOUT_S, f"a save on {name}", 0.005)
        pid = {"SIGTERM launcher": launcher, "SIGKILL tritonserver": server, "SIGKILL stub rank 0": stubs[0],
               "SIGKILL stub rank 1": stubs[1], "SIGKILL stub mid-save": stubs[0], "SIGKILL launcher": launcher}[kind]
        os.kill(pid, signal.SIGTERM if kind == "SIGTERM launcher" else signal.SIGKILL)
        return time.perf_counter(), ()

    def whole(self, name: str, old_stubs: set[int]) -> bool:
        """The group hit serves again: every rank's stub is a new process (Triton starts a load's stubs at once, so
        that alone says little), its model reads ready, and the balancer has it in rotation."""
        try:
            _, stubs = self.server_and_stubs(name)
        except (ValueError, StopIteration, OSError):
            return False
        group = self.group(name)
        return (len(stubs) == SP and not set(stubs.values()) & old_stubs
                and ModelControl(f"{group['host']}:{group['http_port']}", "").is_model_ready(MODEL_NAME)
                and server_states(Path(self.manifest()["stats_socket"])).get(name) == "UP")


def run(out: Path, url: str, faults: int, worlds: list[SoakedWorld]) -> list[Fault]:
    soak, done, began, told = Soak(out, url), [], time.perf_counter(), set()
    for i in range(faults):
        kind = KINDS[i % len(KINDS)]
        names = ["group0", "group1"] if kind == "rolling restart" else [soak.busiest(i)]
        old = {name: set(soak.server_and_stubs(name)[1].values()) for name in names}
        try:
            at, signals = soak.hit(kind, names[0])
        except TimeoutError as exc:  # no save to kill a stub in the middle of (no world plays there)
            print(f"fault {i + 1:>2}/{faults} {kind:<22} not put in: {exc}", flush=True)
            continue
        fault = Fault(kind, "both" if len(names) > 1 else names[0], at, signals=signals)
        for name in names:
            wait_for(lambda n=name, gone=old[name]: soak.whole(n, gone), WHOLE_TIMEOUT_S,
                     f"{name} whole again after {kind}", 0.2)
        fault.whole_s = time.perf_counter() - at
        back = time.perf_counter()
        wait_for(lambda since=back: all(w.blocks_since(since) >= 2 for w in worlds if w.playing), WHOLE_TIMEOUT_S,
                 "two blocks of every world since the fault", 0.2)
        done.append(fault)
        for n, w in enumerate(worlds):
            if w.error is not None and n not in told:
                told.add(n)
                print(f"world {n} lost {w.failed_at - began:.0f} s into the soak: {w.error!r}", flush=True)
        print(f"fault {i + 1:>2}/{faults} {kind:<22} on {fault.group} at {at - began:.0f} s: whole again after "
              f"{fault.whole_s:.1f} s; {len(told)} world(s) lost so far", flush=True)
    return done


def fault_before(faults: list[Fault], t: float) -> Fault | None:
    """The last fault put in before `t`."""
    return max((f for f in faults if f.at <= t), key=lambda f: f.at, default=None)


def table(faults: list[Fault], worlds: list[SoakedWorld], same: list[bool]) -> str:
    rows = []
    for kind in KINDS:
        hits = [f for f in faults if f.kind == kind]
        if not hits:
            continue
        gaps, replayed, interrupted = [], 0, 0
        for n, f in enumerate(faults):
            if f.kind != kind:
                continue
            until = faults[n + 1].at if n + 1 < len(faults) else float("inf")
            for w in worlds:
                for lost in (x for x in w.lost if f.at <= x.at < until):
                    interrupted += 1
                    replayed += lost.through.replayed if lost.through else 0
                    after = [a for a in w.arrivals if a > lost.at]
                    if after:
                        gaps.append(after[0] - f.hit_before(lost.at))
        lost_worlds = sum(1 for w in worlds if w.error is not None and fault_before(faults, w.failed_at) in hits)
        cells = [f"{percentile(gaps, 50):.2f}", f"{percentile(gaps, 99):.2f}", f"{max(gaps):.2f}"] if gaps else ["-"] * 3
        rows.append([kind, str(len(hits)), str(lost_worlds), str(interrupted), str(replayed), *cells,
                     f"{statistics.median(f.whole_s for f in hits):.1f}", f"{max(f.whole_s for f in hits):.1f}"])
    total_lost = sum(w.error is not None for w in worlds)
    rows.append(["all", str(len(faults)), str(total_lost), "", "", "", "", "", "", ""])
    header = ["fault", "faults", "worlds lost", "worlds interrupted", "blocks made again", "fault -> next block p50 s",
              "p99 s", "max s", "fleet whole again p50 s", "max s"]
    return format_table(header, rows, left=1) + "\n" + format_table(
        ["world", "blocks", "streams lost", "bit for bit with its uninterrupted twin"],
        [[str(i), str(len(w.hashes)), str(len(w.lost)), "yes" if ok else "NO"] for i, (w, ok) in
         enumerate(zip(worlds, same))])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--faults", type=int, default=50)
    parser.add_argument("--worlds", type=int, default=4, help="worlds playing at once (max_sessions of each group)")
    parser.add_argument("--pace-s", type=float, default=0.5, help="a world's step interval")
    parser.add_argument("--save-every", type=int, default=2, help="a world's saves, every this many blocks")
    args = parser.parse_args()
    logging.getLogger("client.world").setLevel(logging.ERROR)  # each failover is counted in the table instead
    checkpoint = ensure_checkpoint(args.checkpoint, "tiny")
    began = time.monotonic()
    out = BUILD_DIR / "bench" / "soak"
    with running_fleet(checkpoint, args.worlds, out, sp=SP, max_batch="1", collective_timeout_s="20") as fleet:
        print(f"fleet of 2 SP{SP} groups ready after {time.monotonic() - began:.1f} s", flush=True)
        worlds = [SoakedWorld(fleet.url, 100 + i, args.pace_s, args.save_every).start() for i in range(args.worlds)]
        wait_for(lambda: all(len(w.hashes) >= 2 for w in worlds), 120, "every world playing", 0.2)
        faults = run(out, fleet.url, args.faults, worlds)
        for w in worlds:
            w.stop()
        print(f"faults done after {time.monotonic() - began:.0f} s; playing the uninterrupted twins", flush=True)
        same = [w.error is None and twin_hashes(fleet.url, w) == w.hashes for w in worlds]
        print(table(faults, worlds, same))
        for i, w in enumerate(worlds):
            if w.error is not None:
                print(f"world {i} lost: {w.error!r}")
    print(f"run time {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
