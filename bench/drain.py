"""Drain and rolling restart: no world is lost, and how long each moved world's player is without blocks.

    python -m bench.drain [--players 4] [--pace-s 0.25] [--after 6]

One fleet of 2 SP1 groups on the tiny random checkpoint (`python -m backend.fleet`, check interval 1 s;
max_sessions = --players each, so either group holds every world; max_batch 1, so a world's blocks are bit for bit
those of a lone run), real HAProxy in front. --players steered worlds play through the balancer, a step every
--pace-s (leastconn puts half on each group); then a rolling restart, one group at a time, each back in rotation
before the next drains (`backend.fleet.restart.rolling_restart`, what `fleet rolling-restart` runs). A moved
world's stream ends MOVED with its snapshot's id; its player resumes it through the balancer with the next block's
step at once. Each plays --after steps more once the restart is done. Then, in the same run, every world is played again from its
start without interruption, the same steps at the same pace: its latents must equal the moved world's bit for bit,
and its time between blocks is what a move's gap is set against.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from backend.api import contract
from backend.api.codec import controls_arrays, resume_parameters
from backend.api.request import Controls, ResumeRequest, SessionRequest
from backend.fleet.restart import Restarted, rolling_restart
from bench.common import BUILD_DIR, TINY, ensure_checkpoint, format_table, make_request
from bench.fleet import running_fleet
from client.steer import SteeredSession
from client.stream import StreamError

KEYS = ("w", "wa", "w", "d", "j", "w", "wd", "l")  # block i's held keys: KEYS[i % len(KEYS)]
BLOCK_TIMEOUT_S = 60.0


def controls_of(block: int) -> Controls:
    return Controls(keys=KEYS[block % len(KEYS)])


def steered(first: SessionRequest) -> SessionRequest:
    """A steered world's start: `first`'s image, prompt and seed, block 0's keys."""
    return dataclasses.replace(first, num_frames=None, poses=None, keys=KEYS[0], decode=False)


def resume(session: SteeredSession, snapshot_id: str, controls: Controls) -> None:
    """Open a saved world on `session`'s new stream: a start with request parameter resume and the next block's
    controls (the rest is the snapshot's: docs/worlds.md)."""
    request = ResumeRequest(snapshot_id, controls, str(session.sequence_id))
    session._step_parameters = {contract.PARAM_RETURN_LATENTS: True}  # each step's, as start() sets them
    session._send(controls_arrays(controls), start=True, parameters=resume_parameters(request))


@dataclasses.dataclass(frozen=True)
class Move:
    snapshot_id: str
    block: int  # the resumed block's index: the first its player had not received
    replayed: int  # blocks the resume sent again that the player had before the move
    last_block_s: float  # time.monotonic() of the last block before the move
    moved_s: float  # MOVED received
    resumed_s: float  # the resumed block received


class Player:
    """One steered world played through `url` a step at a time, block i on `controls_of(i)`, resumed through the
    same address whenever its group moves it. `latents` of every block received, its `moves`, `arrivals` (each
    block's time.monotonic()), `error` (anything else that ended it)."""

    def __init__(self, url: str, first: SessionRequest, pace_s: float, blocks: int | None = None) -> None:
        """blocks: stop after this many (else when `finish` says)."""
        self.url, self.first, self.pace_s = url, steered(first), pace_s
        self.latents: list[np.ndarray] = []
        self.arrivals: list[float] = []
        self.moves: list[Move] = []
        self.error: Exception | None = None
        self._blocks = blocks
        self._finish = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="player", daemon=True)

    def start(self) -> Player:
        self._thread.start()
        return self

    def finish(self, more: int | None = None, timeout_s: float = 120.0) -> Player:
        """Play `more` steps beyond what it has now (None: to its own bound), end the session, wait for it."""
        with self._finish:
            if more is not None:
                self._blocks = len(self.latents) + more
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"a player did not finish within {timeout_s:g} s ({len(self.latents)} blocks)")
        return self

    def _done(self) -> bool:
        with self._finish:
            return self._blocks is not None and len(self.latents) >= self._blocks

    def _run(self) -> None:
        session = SteeredSession(self.url)
        try:
            session.start(self.first)
            self._received(session.next_block(BLOCK_TIMEOUT_S))
            while not self._done():
                time.sleep(max(0.0, self.arrivals[-1] + self.pace_s - time.monotonic()))
                try:
                    session.step(controls_of(len(self.latents)))
                except StreamError:
                    pass  # the stream was closed after its last answer (a MOVED, read next)
                try:
                    block = session.next_block(BLOCK_TIMEOUT_S)
                except StreamError as exc:
                    if exc.code != contract.MOVED:
                        raise
                    session = self._resumed(session, exc.refusal.snapshot_id, time.monotonic())
                    continue
                self._received(block)
            session.end()
            session.next_block(BLOCK_TIMEOUT_S)
        except Exception as exc:  # the caller reads it
            self.error = exc
        finally:
            session.close()

    def _resumed(self, moved: SteeredSession, snapshot_id: str, moved_s: float) -> SteeredSession:
        """The moved world opened again through the balancer with its next block's step."""
        moved.close()
        session = SteeredSession(self.url)
        resume(session, snapshot_id, controls_of(len(self.latents)))
        block = session.next_block(BLOCK_TIMEOUT_S)
        if block.block_index > len(self.latents):
            raise RuntimeError(f"the resume skipped blocks: block {block.block_index} after {len(self.latents)}")
        self.moves.append(Move(snapshot_id, block.block_index, len(self.latents) - block.block_index,
                               self.arrivals[-1], moved_s, time.monotonic()))
        del self.latents[block.block_index:], self.arrivals[block.block_index:]  # blocks sent again: kept once
        self._received(block)
        return session

    def _received(self, block) -> None:
        self.latents.append(block.latents)
        self.arrivals.append(time.monotonic())


def same_world(a: Player, b: Player) -> bool:
    return len(a.latents) == len(b.latents) and all(np.array_equal(x, y) for x, y in zip(a.latents, b.latents))


def play_moved(url: str, players: int, pace_s: float, after: int, out: Path) -> tuple[list[Player], list[Restarted]]:
    """`players` worlds through the balancer while every group is restarted in turn."""
    worlds = [Player(url, dataclasses.replace(make_request(TINY, decode=False), seed=100 + i), pace_s).start()
              for i in range(players)]
    time.sleep(4 * pace_s)  # each has played a few blocks
    restarts = rolling_restart(out)
    for w in worlds:
        w.finish(more=after)
    return worlds, restarts


def table(worlds: list[Player], alone: list[Player], restarts: list[Restarted]) -> str:
    rows = []
    for i, (moved, baseline) in enumerate(zip(worlds, alone)):
        gap = statistics.median(np.diff(baseline.arrivals))
        for m in moved.moves:
            sigterm = max((r for r in restarts if r.sigterm_s <= m.moved_s), key=lambda r: r.sigterm_s)
            rows.append([f"world {i}", sigterm.name, f"{m.moved_s - sigterm.sigterm_s:.2f}",
                         f"{m.resumed_s - sigterm.sigterm_s:.2f}", f"{m.resumed_s - m.last_block_s:.2f}",
                         f"{gap:.2f}", str(m.replayed), "yes" if same_world(moved, baseline) else "NO"])
    return format_table(["world", "group drained", "SIGTERM -> MOVED s", "SIGTERM -> resumed block s",
                         "without blocks s", "uninterrupted: between blocks s", "blocks replayed",
                         "bit for bit"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--players", type=int, default=4, help="worlds playing at once (max_sessions of each group)")
    parser.add_argument("--pace-s", type=float, default=0.25, help="a player's step interval")
    parser.add_argument("--after", type=int, default=6, help="steps each world plays once the restart is done")
    args = parser.parse_args()
    checkpoint = ensure_checkpoint(args.checkpoint, "tiny")
    began = time.monotonic()
    out = BUILD_DIR / "bench" / "drain"
    with running_fleet(checkpoint, args.players, out, max_batch="1") as fleet:
        print(f"fleet of 2 SP1 groups ready after {time.monotonic() - began:.1f} s", flush=True)
        worlds, restarts = play_moved(fleet.url, args.players, args.pace_s, args.after, out)
        if errors := [w.error for w in worlds if w.error is not None]:
            raise RuntimeError(f"a world was lost: {errors}")
        alone = [Player(fleet.url, w.first, args.pace_s, len(w.latents)).start() for w in worlds]
        for baseline in alone:
            baseline.finish()
        print(format_table(["group", "SIGTERM -> launcher exit s", "SIGTERM -> back in rotation s"],
                           [[r.name, f"{r.stopped_s:.1f}", f"{r.back_s:.1f}"] for r in restarts]))
        print(table(worlds, alone, restarts))
        print(f"{len(worlds)} worlds, {sum(len(w.moves) for w in worlds)} moves, "
              f"{sum(len(w.latents) for w in worlds)} blocks in all")
    print(f"run time {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
