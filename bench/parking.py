"""More worlds than slots (docs/serving.md, "Parking"): players on a 2-slot CPU group, with parking and without.

    python -m bench.parking     # = --players 8 --slots 2 --bursts 4 --steps 2 5 --pause-s 2 30 --seed 7
                                #   --park-after-s 2 5 10 --give-up-s 60

One SP1 group in this process (one rank's intake and group loop, wired as serving/bootstrap wires them), the tiny
random checkpoint (64x64, float32, frames not decoded), max_sessions --slots, max_batch 1 (each world's forward its
own, so its bits do not depend on who plays beside it). Each player is a thread playing a steered world as a client
does: its start, then --bursts bursts of 2-5 steps (each sent once the block before it came), between two bursts a
pause of 2-30 s during which it keeps a pause request open (as client.steer does), all drawn from --seed; then its
end flag. A player whose start waits in the queue longer than --give-up-s leaves (its request cancelled: its client went
away). The same scripts are played once for each --park-after-s (the park tier in host memory, a folder under
/dev/shm) and once without parking. Then each world is played again alone, its steps back to back, on a group that
never parks: every block a player received must equal its twin's, bit for bit.
"""
from __future__ import annotations

import argparse
import dataclasses
import queue
import random
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from backend.api.codec import SnapshotNotice
from backend.api.refusal import Refusal
from backend.api.request import Controls, SessionRequest, StepRequest
from backend.engine.blocks import BlockOutput
from backend.engine.rollout import WorldModelEngine
from backend.serving.bootstrap import Hooks, owner_side
from backend.serving.waits import QueueCounts
from backend.serving.loop import GroupLoop, LoopHooks
from backend.serving.settings import ServingSettings
from bench.common import TINY, engine_settings, ensure_checkpoint, format_table, make_request, percentile

KEYS = ("w", "wa", "w", "d", "j", "w", "wd", "l", "s", "i")
BLOCK_TIMEOUT_S = 300.0


class Answer:
    """One request's reply channel: its block (latents, arrival), or its error, or its empty end."""

    def __init__(self) -> None:
        self.latents: np.ndarray | None = None
        self.session_id = ""
        self.at = 0.0
        self.error: Refusal | None = None
        self.done = threading.Event()
        self.cancelled = False

    def send_block(self, output: BlockOutput, frames: np.ndarray, decode_ms: float, final: bool) -> None:
        self.latents, self.session_id, self.at = output.latents[0].numpy().copy(), output.session_id, time.perf_counter()
        self.done.set()

    def send_error(self, refusal: Refusal) -> None:
        self.error = refusal
        self.done.set()

    def send_place(self, position: int, wait_s: float) -> None:
        pass

    def send_notice(self, notice: SnapshotNotice) -> None:
        pass

    def finish(self) -> None:
        self.done.set()

    def is_cancelled(self) -> bool:
        return self.cancelled


@dataclass
class Script:
    """A player's world: its seed, its bursts of steps, the pause before each burst after the first."""

    seed: int
    bursts: list[list[Controls]]
    pauses_s: list[float]

    @classmethod
    def drawn(cls, seed: int, bursts: int, steps: tuple[int, int], pause_s: tuple[float, float]) -> Script:
        draw = random.Random(seed)
        return cls(seed, [[Controls(keys=draw.choice(KEYS)) for _ in range(draw.randint(*steps))]
                          for _ in range(bursts)], [draw.uniform(*pause_s) for _ in range(bursts - 1)])

    @property
    def steps(self) -> list[Controls]:
        return [c for burst in self.bursts for c in burst]


@dataclass
class Played:
    """What a player got: its blocks' latents, each step's (burst, place in it, sent, arrived), its start's wait."""

    latents: list[np.ndarray] = field(default_factory=list)
    steps: list[tuple[int, int, float, float]] = field(default_factory=list)
    session_id: str = ""
    start_wait_s: float = 0.0
    gave_up: bool = False
    began: float = 0.0
    ended: float = 0.0

    def returns(self) -> list[float]:
        """The wait on return: each burst's first step after a pause to its block."""
        return [arrived - sent for burst, step, sent, arrived in self.steps if burst > 0 and step == 0]

    def within_bursts(self) -> list[float]:
        """Each step's wait for its block but a burst's first."""
        return [arrived - sent for _, step, sent, arrived in self.steps if step > 0]

    def playing_s(self) -> float:
        """Time in bursts: a burst's first step sent to its last block."""
        spans: dict[int, list[float]] = {}
        for burst, _, sent, arrived in self.steps:
            spans.setdefault(burst, [sent, arrived])[1] = arrived
        return sum(end - begin for begin, end in spans.values())


def start_request(seed: int, key: str) -> SessionRequest:
    base = dataclasses.replace(make_request(TINY, decode=False), seed=seed)
    return dataclasses.replace(base, num_frames=None, poses=None, keys="w", sequence_id=key)


class Group:
    """One rank's intake and group loop (serving/bootstrap's wiring, without a process group or Triton), with what
    its hooks report."""

    def __init__(self, engine: WorldModelEngine, settings: ServingSettings) -> None:
        self.settings = settings
        self.held: list[tuple[float, int]] = []  # (time, slots held) after each plan that changed them
        self.most_parked = 0
        self.parks: list[tuple[str, str, float]] = []  # (session, event, seconds)
        self.unparks: list[tuple[str, float, float]] = []  # (session, line s, open s)
        self.copies: dict[str, int] = {}  # each park copy's bytes, by its folder in the park tier
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        hooks = Hooks(on_park=self._park, on_unpark=lambda sid, line, s: self.unparks.append((sid, line, s)))
        self.loop = GroupLoop(engine, settings, None, inbox.put, LoopHooks(on_queue=self._line,
                                                                            on_unpark=hooks.on_unpark))
        self.intake = owner_side(0, 1, settings, engine, self.loop.post, inbox, hooks)

    def _line(self, counts: QueueCounts) -> None:
        self.held.append((time.perf_counter(), self.settings.max_sessions - counts.free_slots))
        self.most_parked = max(self.most_parked, counts.parked)

    def _park(self, sid: str, event: str, seconds: float) -> None:
        """The intake's report; a copy just made is in the tier: the bytes of each copy there are noted."""
        self.parks.append((sid, event, seconds))
        if event == "parked":
            for folder in Path(self.settings.park_memory_dir).glob("[0-9a-f]" * 32):
                self.copies[folder.name] = sum(f.stat().st_size for f in folder.iterdir())

    def ask(self, request: SessionRequest | StepRequest) -> Answer:
        answer = Answer()
        self.intake.arrive(request.sequence_id, request, answer)
        return answer

    def held_share(self, begin: float, end: float) -> float:
        """The share of slot-time a world held a slot over [begin, end]."""
        total, (at, held) = 0.0, (begin, 0)
        for t, n in [*self.held, (end, 0)]:
            t = min(max(t, begin), end)
            total += (t - at) * held
            at, held = t, n
        return total / ((end - begin) * self.settings.max_sessions)

    def stop(self) -> None:
        self.loop.stop()
        self.intake.close()


def play(group: Group, script: Script, key: str, give_up_s: float, paused: bool = True) -> Played:
    """One player's script (paused: with its think times; else its steps back to back, a twin)."""
    played = Played(began=time.perf_counter())
    start = group.ask(start_request(script.seed, key))
    if not start.done.wait(give_up_s):
        start.cancelled = True  # the player leaves
        start.done.wait(BLOCK_TIMEOUT_S)
        played.gave_up, played.ended = True, time.perf_counter()
        return played
    assert start.error is None, start.error
    played.latents.append(start.latents)
    played.session_id, played.start_wait_s = start.session_id, start.at - played.began
    for n, burst in enumerate(script.bursts):
        if n and paused:
            group.ask(StepRequest(key, None, pause=True))  # held open through the think time, answered by the step
            time.sleep(script.pauses_s[n - 1])
        for step, controls in enumerate(burst):
            sent = time.perf_counter()
            answer = group.ask(StepRequest(key, controls))
            assert answer.done.wait(BLOCK_TIMEOUT_S) and answer.error is None, (key, answer.error)
            played.latents.append(answer.latents)
            played.steps.append((n, step, sent, answer.at))
    group.ask(StepRequest(key, None, end=True)).done.wait(BLOCK_TIMEOUT_S)
    played.ended = time.perf_counter()
    return played


def run(engine: WorldModelEngine, settings: ServingSettings, scripts: list[Script],
        give_up_s: float) -> tuple[Group, list[Played]]:
    group = Group(engine, settings)
    results: list[Played | None] = [None] * len(scripts)

    def player(n: int) -> None:
        results[n] = play(group, scripts[n], f"p{n}", give_up_s)

    threads = [threading.Thread(target=player, args=(n,), name=f"player-{n}") for n in range(len(scripts))]
    for n, thread in enumerate(threads):
        thread.start()
        time.sleep(0.1 if n < len(threads) - 1 else 0.0)  # players arrive in order
    for thread in threads:
        thread.join()
    group.stop()
    return group, results


def seconds(values: list[float]) -> str:
    return f"{percentile(values, 50):.2f} / {max(values):.2f}" if values else "-"


def player_rows(group: Group, played: list[Played], scripts: list[Script], twins: list[Played]) -> list[list[str]]:
    rows = []
    for n, (p, script, twin) in enumerate(zip(played, scripts, twins)):
        parks = [e for e in group.parks if e[0] == p.session_id and e[1] == "parked"]
        unparks = [u for u in group.unparks if u[0] == p.session_id]
        same = bool(p.latents) and all(np.array_equal(a, b) for a, b in zip(p.latents, twin.latents))
        rows.append([f"player {n}", "gave up" if p.gave_up else f"{len(p.latents) - 1}/{len(script.steps)}",
                     f"{p.start_wait_s:.2f}" if not p.gave_up else f">{p.ended - p.began:.0f}", str(len(parks)),
                     seconds(p.returns()), seconds([u[1] for u in unparks]), seconds([u[2] for u in unparks]),
                     seconds(p.within_bursts()), "-" if not p.latents else "yes" if same else "NO"])
    return rows


def summary_row(name: str, group: Group, played: list[Played]) -> list[str]:
    begin, end = min(p.began for p in played), max(p.ended for p in played)
    blocks = sum(len(p.latents) for p in played)
    parks = [e[2] for e in group.parks if e[1] == "parked"]
    unparks = [u[2] for u in group.unparks]
    playing = sum(p.playing_s() - sum(u[1] for u in group.unparks if u[0] == p.session_id) for p in played)
    return [name, str(sum(not p.gave_up for p in played)), str(sum(p.gave_up for p in played)), f"{end - begin:.0f}",
            str(blocks), f"{blocks / (end - begin) * 60:.0f}", f"{group.held_share(begin, end):.0%}",
            f"{playing / ((end - begin) * group.settings.max_sessions):.0%}", str(len(parks)), str(group.most_parked),
            str(len(unparks)),
            f"{percentile(parks, 50) * 1000:.0f} / {percentile(parks, 99) * 1000:.0f}" if parks else "-",
            f"{percentile(unparks, 50) * 1000:.0f} / {percentile(unparks, 99) * 1000:.0f}" if unparks else "-",
            f"{min(group.copies.values()) / 2**20:.2f} / {max(group.copies.values()) / 2**20:.2f}" if group.copies
            else "-"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--players", type=int, default=8)
    parser.add_argument("--slots", type=int, default=2, help="max_sessions")
    parser.add_argument("--bursts", type=int, default=4, help="bursts of steps per player, a pause between two")
    parser.add_argument("--steps", type=int, nargs=2, default=[2, 5], help="steps per burst, drawn in this range")
    parser.add_argument("--pause-s", type=float, nargs=2, default=[2.0, 30.0], help="a pause's seconds, drawn")
    parser.add_argument("--seed", type=int, default=7, help="draws every player's script")
    parser.add_argument("--park-after-s", type=float, nargs="+", default=[2.0, 5.0, 10.0],
                        help="one run with parking for each (then one without)")
    parser.add_argument("--give-up-s", type=float, default=60.0, help="a player whose start waits longer leaves")
    args = parser.parse_args()

    checkpoint = ensure_checkpoint(None, "tiny")
    engine = WorldModelEngine.load(engine_settings(checkpoint, TINY, sp=1))
    scripts = [Script.drawn(args.seed * 1000 + n, args.bursts, tuple(args.steps), tuple(args.pause_s))
               for n in range(args.players)]
    began = time.perf_counter()
    base = ServingSettings(max_sessions=args.slots, max_batch=1, max_blocks_ahead=100)
    runs: list[tuple[str, Group, list[Played]]] = []
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as memory:
        for park_after_s in args.park_after_s:
            settings = dataclasses.replace(base, park_after_s=park_after_s, park_memory_dir=memory)
            default = " (the default)" if park_after_s == ServingSettings.park_after_s else ""
            runs.append((f"park_after_s={park_after_s:g}{default}", *run(engine, settings, scripts, args.give_up_s)))
    runs.append(("no parking", *run(engine, dataclasses.replace(base, park_after_s=0.0), scripts, args.give_up_s)))
    twins_group = Group(engine, dataclasses.replace(base, max_sessions=1, park_after_s=0.0))
    twins = [play(twins_group, script, f"t{n}", BLOCK_TIMEOUT_S, paused=False) for n, script in enumerate(scripts)]
    twins_group.stop()
    pauses = [s for script in scripts for s in script.pauses_s]
    print(f"{args.players} players, {args.slots} slots (SP1, tiny, 64x64, max_batch 1), {args.bursts} bursts of "
          f"{args.steps[0]}-{args.steps[1]} steps, pauses {min(pauses):.1f}-{max(pauses):.1f} s (median "
          f"{statistics.median(pauses):.1f}), seed {args.seed}, give up after {args.give_up_s:g} s in the queue; "
          f"{time.perf_counter() - began:.0f} s")
    header = ["player", "steps played", "start wait s", "parks", "wait on return s p50 / max",
              "line s p50 / max", "unpark s p50 / max", "other steps s p50 / max", "bit for bit"]
    for name, group, played in runs:
        print(f"\n{name}")
        print(format_table(header, player_rows(group, played, scripts, twins)))
    print()
    print(format_table(["run", "played", "gave up", "wall s", "blocks", "blocks / min", "slot time held",
                        "slot time playing", "parks", "most parked", "unparks", "park ms p50 / p99",
                        "unpark ms p50 / p99",
                        "MiB a copy min / max"], [summary_row(name, group, played) for name, group, played in runs]))


if __name__ == "__main__":
    main()
