"""A world that survives its group (client/world.py), against a stand-in server: a deterministic world (each
block's hash is that of every step before it), a snapshot store, and the failures a real one shows (a failed
stream, MOVED, a silent stream, a resume refused while the group heals, a full store). The real servers' tests
are in test_world_failover.py."""
from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from backend.api import contract
from backend.api.codec import BlockResponse, BlockUsed, Place, SnapshotNotice, controls_arrays, parse_request
from backend.api.request import Controls, SessionRequest
from client import world as world_module
from client.__main__ import main as client_main
from client.connection import Connection
from client.stream import StreamError, StreamTimeoutError
from client.world import Failover, PlayedWorld, Saved, WorldLostError

pytestmark = pytest.mark.timeout(30)

PLACE_EVERY_S = 0.1  # how often a session waiting in a busy group's line is told its place


@dataclass
class StandIn:
    """The server side, shared by every session a world opens (a fleet behind one address, one snapshot store)."""

    fail_at: dict[int, str] = field(default_factory=dict)  # blocks made in all -> how the session then fails
    refuse_opens: int = 0  # resumes answered "not ready" (a healing group) before one takes
    pending_opens: int = 0  # resumes answered SNAPSHOT_PENDING (the snapshot's save still under way) before one takes
    full: bool = False  # the store refuses saves
    no_store: bool = False  # the server keeps no snapshots
    tamper: bool = False  # a resumed world is another one
    forget: bool = False  # the store loses its snapshots
    line_s: float = 0.0  # a resumed session waits this long in the group's line for a slot, told its place
    open_s: float = 0.0  # then a session's first block takes this long (its caches opened, its snapshot read)
    skew: int = 0  # a resumed session's first block is numbered this many past the one after its snapshot
    durable_saves: int | None = None  # the saves after this many fail to be written: their outcome is an error
    store: dict[str, list[str]] = field(default_factory=dict)
    released: list[str] = field(default_factory=list)  # snapshots a durable save released (gone from the store)
    made: int = 0  # blocks made, every session's, replays included
    opens: list[str] = field(default_factory=list)  # "start" or the snapshot id of each session

    sessions: list[Session] = field(default_factory=list)

    def session(self, *args: object, **kwargs: object) -> Session:
        self.sessions.append(Session(self, kwargs["on_snapshot"], kwargs["on_place"]))
        return self.sessions[-1]


def block_hash(history: list[str]) -> str:
    return hashlib.sha256("|".join(history).encode()).hexdigest()


def keys_of(controls: Controls) -> str:
    return controls.keys if controls.keys is not None else f"poses:{controls.poses.tobytes().hex()[:8]}"


class Session:
    """A steered session of the stand-in: every request answered at once, in order (a save's at-once refusal too)."""

    def __init__(self, server: StandIn, on_snapshot, on_place) -> None:
        self.server, self.on_snapshot, self.on_place = server, on_snapshot, on_place
        self.line_until = 0.0  # it waits in the queue, told its place, until then
        self.slot_at = 0.0  # nothing is answered before
        self.history: list[str] = []
        self.answers: deque = deque()
        self.answered_sent_s: float | None = None
        self.dead: str | None = None  # how it died: "error", "silent"
        self.silent_since = 0.0
        self.closed = False

    def start(self, request: SessionRequest) -> None:
        self.server.opens.append("start")
        self.slot_at = time.perf_counter() + self.server.open_s
        self._block(Controls(keys=request.keys), save=False, index=0)

    def resume(self, snapshot_id: str, controls: Controls, fork_seed=None, *, return_latents=True,
               return_used=False, save=False) -> None:
        self.server.opens.append(snapshot_id)
        if self.server.refuse_opens:
            self.server.refuse_opens -= 1
            self._answer(StreamError("model 'lingbot_world' is not ready"))
            self.dead = "error"
            return
        if self.server.pending_opens:
            self.server.pending_opens -= 1
            self._answer(StreamError("x", f"[SNAPSHOT_PENDING retry_after_s=0.5] snapshot {snapshot_id} is still "
                                          "being saved; resume it again in a moment"))
            return
        if self.server.forget:
            self._answer(StreamError("x", f"[SNAPSHOT_UNKNOWN] no snapshot {snapshot_id}"))
            return
        self.history = list(self.server.store[snapshot_id])
        self.line_until = time.perf_counter() + self.server.line_s
        self.slot_at = self.line_until + self.server.open_s
        if self.server.tamper:
            self.history[0] = "another world"
        self._block(controls, save, index=len(self.history) + self.server.skew)

    def step(self, controls: Controls, end: bool = False, save: bool = False) -> None:
        self._block(controls, save, index=len(self.history))

    def end(self) -> None:
        if not self.dead:
            self._answer(None)

    def _block(self, controls: Controls, save: bool, index: int) -> None:
        if self.dead:
            return
        if save and self.server.full:
            self._answer(StreamError("x", "[SNAPSHOT_STORE_FULL retry_after_s=5] the store is full"))
            return
        if save and self.server.no_store:
            self._answer(StreamError("x", "[INVALID_INPUT] this server keeps no snapshots (its snapshot_dir is not "
                                          "set): request parameters 'save' and 'resume' need one"))
            return
        how = self.server.fail_at.pop(self.server.made, None)
        if how == "moved":
            moved = secrets.token_hex(16)
            self.server.store[moved] = list(self.history)
            self._answer(StreamError("x", f"[MOVED snapshot_id={moved}] the group drains"))
        elif how == "group":
            self._answer(StreamError("x", "[GROUP_FAILED retry_after_s=20] the group lost an instance"))
        elif how == "error":
            self._answer(StreamError("the stream failed: UNAVAILABLE"))
        if how is not None:
            self.dead, self.silent_since = how if how == "silent" else "error", time.perf_counter()
            return
        self.server.made += 1
        self.history.append(keys_of(controls))
        camera = np.tile(np.eye(4, dtype=np.float32), (12, 1, 1))
        used = BlockUsed(camera, "a street", block_hash(self.history))
        self._answer(BlockResponse(index, 0, None, np.zeros((0, 0, 0, 3), np.uint8), (), 0.0, False, used))
        if save and self.server.durable_saves is not None and self.server.durable_saves <= len(self.server.store):
            self.on_snapshot(SnapshotNotice(secrets.token_hex(16), "[SNAPSHOT_SAVE_FAILED] could not be written"))
        elif save:
            snapshot_id = secrets.token_hex(16)
            self.server.store[snapshot_id] = list(self.history)
            if controls.release:  # as the server does once the new snapshot is durable
                del self.server.store[controls.release]
                self.server.released.append(controls.release)
            self.on_snapshot(SnapshotNotice(snapshot_id))

    def _answer(self, answer: object) -> None:
        self.answers.append((answer, time.perf_counter()))

    def waiting_since(self) -> float | None:
        return self.answers[0][1] if self.answers else (self.silent_since if self.dead == "silent" else None)

    def next_block(self, timeout: float | None = None) -> BlockResponse | None:
        deadline = time.perf_counter() + (timeout or 0)
        while (now := time.perf_counter()) < self.slot_at:  # in the queue (its place told), then opening
            if now >= deadline:
                raise StreamTimeoutError("nothing within the timeout")
            time.sleep(min(PLACE_EVERY_S, self.slot_at - now, deadline - now))
            if time.perf_counter() < self.line_until:
                self.on_place(Place(1, -1.0))
        if not self.answers:
            time.sleep(timeout or 0)  # a silent stream: nothing comes
            raise StreamTimeoutError("nothing within the timeout")
        answer, self.answered_sent_s = self.answers.popleft()
        if isinstance(answer, StreamError):
            raise answer
        return None if answer is None else BlockResponse(**{**answer.__dict__, "arrival_s": time.perf_counter()})

    def close(self) -> None:
        self.closed = True


KEYS = ["w", "a", "s", "d", "wa", "wd", "j", "l", "i", "k", "w", "s"]


def play(server: StandIn, keys: list[str] = KEYS, lookahead: int = 1, asked: tuple[int, ...] = (),
         **options: object) -> tuple[list, list, list]:
    """A world played as `python -m client play` plays it: (blocks returned, saves told, failovers told). asked: the
    steps before which its player asks for a save."""
    saves: list[Saved] = []
    failovers: list[Failover] = []
    world = PlayedWorld("stand-in:8001", session_factory=server.session, on_snapshot=saves.append,
                        on_failover=failovers.append, **options)
    request = SessionRequest(image=np.zeros((8, 8, 3), np.uint8), prompt="a street", poses=None, num_frames=None,
                             seed=1, height=8, width=8, keys=keys[0])
    world.start(request)
    blocks, sent = [], 1
    for received in range(len(keys)):
        while sent < len(keys) and sent - received <= lookahead:
            if sent in asked:
                world.save()
            world.step(Controls(keys=keys[sent]), end=sent == len(keys) - 1)
            sent += 1
        blocks.append(world.next_block(5))
    world.finish(5)
    return blocks, saves, failovers


def hashes(blocks: list[BlockResponse]) -> list[str]:
    return [b.used.latents_sha256 for b in blocks]


UNINTERRUPTED = [block_hash(KEYS[: i + 1]) for i in range(len(KEYS))]


def test_saves_every_n_blocks_and_a_failed_stream_resumes_from_the_last_without_showing_a_block_twice() -> None:
    server = StandIn(fail_at={7: "error"})
    blocks, saves, failovers = play(server, save_every=3)
    assert [b.block_index for b in blocks] == list(range(len(KEYS)))
    assert hashes(blocks) == UNINTERRUPTED  # bit for bit with the uninterrupted world, none twice
    # The save after block 8 was under way when the stream failed: the next step after the failover saves instead.
    assert [s.block_index for s in saves] == [2, 5, 9] and all(s.error is None for s in saves)
    lost, through = failovers
    # Blocks 0-6 were received, the snapshot after block 5 durable: block 6 is made again and checked, block 7's
    # step (and the lookahead's) sent again.
    assert (lost.snapshot_id, lost.resume_block, lost.replayed, lost.resent) == (saves[1].snapshot_id, 6, 1, 2)
    assert through.took_s is not None and through.took_s >= 0 and through.attempts == 1
    assert server.opens == ["start", saves[1].snapshot_id]


def test_periodic_saves_release_the_snapshot_before_the_base_so_a_world_keeps_two() -> None:
    """Each periodic save asks the server to delete the periodic snapshot before the world's base once it is durable:
    the store holds a world's base and the one before it, never fewer (a failover resumes from the base, which is never
    released), and a save the world's player asked for is never released."""
    server = StandIn(fail_at={9: "error"})
    keys = KEYS * 2
    blocks, saves, failovers = play(server, keys=keys, save_every=2)
    assert hashes(blocks) == [block_hash(keys[: i + 1]) for i in range(len(keys))]
    periodic = [s.snapshot_id for s in saves]
    assert server.released == periodic[:-2]  # each released once the save two after it was asked
    assert [s.released for s in saves if s.released] == server.released  # each told with the save that released it
    assert sorted(server.store) == sorted(periodic[-2:])
    lost, _ = failovers
    assert lost.snapshot_id not in server.released[: periodic.index(lost.snapshot_id)]


def test_a_moved_session_resumes_from_the_snapshot_its_group_made_and_a_healing_group_is_tried_again() -> None:
    server = StandIn(fail_at={4: "moved"}, refuse_opens=2)
    blocks, saves, failovers = play(server, save_every=0)
    assert hashes(blocks) == UNINTERRUPTED and saves == []
    lost, through = failovers
    assert lost.replayed == 0 and lost.resume_block == 4 and "drains" in lost.reason
    assert through.attempts == 3  # twice "not ready", then resumed
    assert server.opens[0] == "start" and len(set(server.opens[1:])) == 1


def test_a_snapshot_still_being_saved_is_resumed_again_until_it_is_durable() -> None:
    """SNAPSHOT_PENDING (the store holds the id's save under way: on another group, or not yet visible here) is no
    reason to give the world up: it is tried again, as a group that is not ready is."""
    server = StandIn(fail_at={4: "moved"}, pending_opens=2)
    blocks, _, (lost, through) = play(server, save_every=0)
    assert hashes(blocks) == UNINTERRUPTED and through.attempts == 3
    assert len(set(server.opens[1:])) == 1 and len(server.opens) == 4


def test_before_any_save_a_world_starts_again_from_its_first_request() -> None:
    server = StandIn(fail_at={3: "group"})
    blocks, _, failovers = play(server, save_every=0)
    assert hashes(blocks) == UNINTERRUPTED
    assert failovers[0].snapshot_id is None and failovers[0].replayed == 3 and server.opens == ["start", "start"]


def test_a_silent_stream_is_given_up_at_the_stall_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream that stays open and says nothing (Triton keeps a dead stub's open) ends at the bound."""
    monkeypatch.setattr(world_module, "STALL_FLOOR_S", 0.3)
    server = StandIn(fail_at={5: "silent"})
    began = time.perf_counter()
    blocks, _, failovers = play(server, save_every=2)
    assert hashes(blocks) == UNINTERRUPTED
    assert "stall bound" in failovers[0].reason and time.perf_counter() - began < 3


def test_a_world_that_fails_over_into_a_busy_group_keeps_its_place_past_the_stall_bound(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The resume waits in the queue for a second, three stall bounds, told its place all along: the places are news of
    the session, so it is not given up for a silent one."""
    monkeypatch.setattr(world_module, "STALL_FLOOR_S", 0.3)
    server = StandIn(fail_at={5: "error"}, line_s=1.0)
    places: list[Place] = []
    blocks, saves, (lost, through) = play(server, save_every=2, on_place=places.append)
    assert hashes(blocks) == UNINTERRUPTED and places
    assert through.attempts == 1 and server.opens == ["start", lost.snapshot_id]


def test_a_resume_is_given_as_long_for_its_first_block_as_the_worlds_start_took(monkeypatch: pytest.MonkeyPatch) -> None:
    """A session's first block takes 0.8 s (its caches opened, its snapshot read), every other comes at once: the
    resume's first block is not given up at the stall bound (0.5 s) alone."""
    monkeypatch.setattr(world_module, "STALL_FLOOR_S", 0.5)
    server = StandIn(fail_at={5: "error"}, open_s=0.8)
    blocks, _, (lost, through) = play(server, save_every=2)
    assert hashes(blocks) == UNINTERRUPTED
    assert through.attempts == 1 and server.opens == ["start", lost.snapshot_id]


def test_a_save_its_player_asked_for_survives_a_failover_and_is_never_released() -> None:
    """The player asks for a save on block 5's step and the stream fails before that block: the next step after the
    failover saves instead; it releases no periodic snapshot, and no periodic save releases it."""
    server = StandIn(fail_at={5: "error"})
    blocks, saves, _ = play(server, save_every=2, asked=(5,))
    assert hashes(blocks) == UNINTERRUPTED
    (mine,) = [s for s in saves if s.asked]
    assert mine.block_index == 7 and mine.error is None and not mine.released
    assert mine.snapshot_id in server.store and server.released == [s.snapshot_id for s in saves if not s.asked][:-2]


def test_a_save_whose_write_failed_releases_nothing_and_the_world_fails_over_from_the_last_durable_one() -> None:
    server = StandIn(fail_at={8: "error"}, durable_saves=2)
    blocks, saves, (lost, _) = play(server, save_every=2)
    assert hashes(blocks) == UNINTERRUPTED
    assert [s.error is None for s in saves][:3] == [True, True, False]
    assert not [s.released for s in saves if s.error is not None and s.released] and not server.released
    assert lost.snapshot_id == saves[1].snapshot_id and lost.resume_block == 4


def test_a_world_resumed_at_another_block_than_the_one_after_its_snapshot_is_lost() -> None:
    with pytest.raises(WorldLostError, match="resumed at block 7, not at block 6 after its snapshot's"):
        play(StandIn(fail_at={7: "error"}, skew=1), save_every=3)


def test_a_save_refused_by_a_full_store_is_sent_again_without_it_and_the_world_goes_on() -> None:
    server = StandIn(full=True)
    blocks, saves, _ = play(server, save_every=4)
    assert len(blocks) == len(KEYS) and [b.block_index for b in blocks] == list(range(len(KEYS)))
    assert saves and all(s.snapshot_id is None and s.error == "the store is full" for s in saves)
    # A refused step ran after the steps sent behind it: every step ran once, one block each.
    (session,) = server.sessions
    assert sorted(session.history) == sorted(KEYS) and session.history != KEYS
    assert hashes(blocks) == [block_hash(session.history[: i + 1]) for i in range(len(KEYS))]


def test_on_a_server_without_a_store_the_world_plays_on_unsaved_and_fails_over_from_its_start() -> None:
    server = StandIn(no_store=True, fail_at={8: "error"})
    blocks, saves, failovers = play(server, save_every=3)
    ran = server.sessions[-1].history  # the refused step ran behind the one sent after it, in both sessions
    assert sorted(ran) == sorted(KEYS) and hashes(blocks) == [block_hash(ran[: i + 1]) for i in range(len(KEYS))]
    (refused,) = saves  # the first save told it: no more are asked for
    assert refused.snapshot_id is None and "keeps no snapshots" in refused.error
    assert failovers[0].snapshot_id is None and server.opens == ["start", "start"]


def test_a_block_made_differently_after_a_resume_loses_a_strict_world_and_a_snapshot_gone_any() -> None:
    with pytest.raises(WorldLostError, match="block 6 made again after the resume differs from the one received"):
        play(StandIn(fail_at={7: "error"}, tamper=True), save_every=3, strict=True)
    blocks, _, (lost, through) = play(StandIn(fail_at={7: "error"}, tamper=True), save_every=3)  # not strict
    assert through.differed == 1 and [b.block_index for b in blocks] == list(range(len(KEYS)))
    with pytest.raises(WorldLostError, match="cannot be resumed: no snapshot"):
        play(StandIn(fail_at={7: "error"}, forget=True), save_every=3)


def test_a_world_that_cannot_be_resumed_within_its_bound_is_lost() -> None:
    server = StandIn(fail_at={3: "error"}, refuse_opens=1000)
    began = time.perf_counter()
    with pytest.raises(WorldLostError, match="could not be resumed within 1 s"):
        play(server, save_every=2, resume_within_s=1.0)
    assert time.perf_counter() - began < 4


class Wire:
    """A gRPC stream that records the parameters of each request a client sends, and answers nothing."""

    def __init__(self) -> None:
        self.parameters: list[dict] = []

    def start_stream(self, callback, headers=None) -> None:
        pass

    def async_stream_infer(self, model_name: str, inputs: list, parameters: dict | None = None, **kwargs) -> None:
        self.parameters.append(parameters or {})

    def stop_stream(self, cancel_requests: bool = False) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize("flags, read", [(["--fork-seed", "0"], 0), ([], contract.NO_FORK)])
def test_play_resumes_a_fork_from_seed_0_as_seed_0(flags: list[str], read: int, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """0 is a seed like any other: only a resume without --fork-seed lets the saved noise go on."""
    wire = Wire()
    monkeypatch.setattr(Connection, "client", lambda self, url, verbose=False: wire)
    assert client_main(["play", "--url", "wire:8001", "--resume", "ab" * 16, *flags, "--keys", "w", "--height", "64",
                        "--width", "64", "--timeout", "0.05", "--out", str(tmp_path / "play.mp4")]) == 1  # no answer
    resume = json.dumps(wire.parameters[0])  # as the server's parser reads it
    assert parse_request(controls_arrays(Controls(keys="w")).get, resume, "7", contract.SEQUENCE_START).fork_seed == read
