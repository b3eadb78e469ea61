"""More worlds than slots (docs/serving.md, "Parking"): a steered world that asks for no block for park_after_s is
saved where it stands into the park tier (host memory first, then the snapshot store) and leaves its slot; its next
step brings it back, bit for bit the world that never parked. Played through one rank's intake and group loop
(OneRank); the same at SP2 and TP2 x SP2 through local process groups (server tier, at the end)."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from backend.api import contract as c
from backend.api.request import Controls, StepRequest
from backend.engine.rollout import WorldModelEngine
from backend.serving import mail
from backend.serving.bootstrap import Hooks
from backend.serving.keys import ANONYMOUS, Principal
from backend.serving.sessions import Status
from backend.serving.settings import ServingSettings
from one_rank import OneRank
from polling import wait_until
from test_owned_saves import principal
from test_saved_worlds import Client, World, resume_request, start_request

PARK_S = 0.4  # park_after_s of these tests' groups
STEPS = [Controls(keys="w"), Controls(keys="wa"), Controls(keys="j"), Controls(keys="w"), Controls(keys="d")]


class Player:
    """A steered world played through one rank's intake: a step is sent, its block read later (`block`)."""

    def __init__(self, group: OneRank, key: str, who: Principal = ANONYMOUS) -> None:
        self.group, self.key, self.who = group, key, who
        self.latents: list[np.ndarray] = []
        self.asked = self._send(start_request(key))

    def _send(self, request: object) -> Client:
        client = Client()
        self.group.submit(request, client, self.who)
        return client

    def block(self, timeout: float = 60.0) -> Client:
        """The block of the request sent last."""
        assert self.asked.closed.wait(timeout), f"world {self.key}: no block"
        assert self.asked.error is None, self.asked.error
        self.latents += self.asked.latents
        return self.asked

    def step(self, controls: Controls) -> Client:
        self.asked = self._send(StepRequest(self.key, controls))
        return self.asked

    def play(self, steps: list[Controls]) -> None:
        for controls in steps:
            self.step(controls)
            self.block()

    def pause(self) -> Client:
        return self._send(StepRequest(self.key, None, pause=True))

    @property
    def sid(self) -> str:
        return self.group.intake._sequences.session_of(self.key)


def parking(tmp_path: Path, **overrides) -> ServingSettings:
    """A group that parks a world PARK_S after its last block, in memory under tmp_path/memory, else on disk."""
    base = ServingSettings(max_sessions=1, max_batch=1, max_blocks_ahead=100, park_after_s=PARK_S,
                           snapshot_dir=str(tmp_path / "disk"),
                           park_memory_dir=str(tmp_path / "memory"))
    return dataclasses.replace(base, **overrides)


def folders(root: Path) -> list[str]:
    """The snapshots (published or being written) a store's folder holds."""
    return sorted(p.name for p in root.iterdir() if re.fullmatch(rf"(\.staging-)?{c.SNAPSHOT_ID_PATTERN}", p.name)) \
        if root.is_dir() else []


@pytest.fixture(scope="module")
def twin(engine: WorldModelEngine) -> list[np.ndarray]:
    """The world of STEPS played without a pause, on a group that never parks: what every parked one must make."""
    group = OneRank(engine, ServingSettings(max_sessions=1, max_blocks_ahead=100, park_after_s=0.0))
    try:
        world = Player(group, "twin")
        world.block()
        world.play(STEPS)
        return world.latents
    finally:
        group.stop()


def same(latents: list[np.ndarray], twin: list[np.ndarray]) -> bool:
    return len(latents) == len(twin) and all(np.array_equal(a, b) for a, b in zip(latents, twin))


def test_a_parked_world_comes_back_on_its_next_step_bit_for_bit_and_under_a_pause(engine, twin, tmp_path) -> None:
    """Parked after block 1 with no request open and after block 3 under its client's open pause: each time its
    caches leave the group and its copy sits in host memory; its next step answers the pause, brings it back and
    makes the blocks of the world that never parked, bit for bit; its copy is released once it is back."""
    events: list[tuple[str, float, float]] = []
    hooks = Hooks(on_park=lambda sid, event, s: events.append((event, s, 0.0)),
                  on_unpark=lambda sid, line, s: events.append(("unparked", line, s)))
    group = OneRank(engine, parking(tmp_path), hooks=hooks)
    memory = tmp_path / "memory"
    try:
        world = Player(group, "p")
        world.block()
        world.play(STEPS[:1])
        wait_until(lambda: group.parked() == {world.sid}, 20, "the world parked")
        assert world.sid not in group.sessions and len(folders(memory)) == 1  # its caches gone, its copy in memory
        world.play(STEPS[1:3])
        assert folders(memory) == []  # back on its slot: the copy released
        pause = world.pause()
        wait_until(lambda: group.parked() == {world.sid}, 20, "the world parked under its pause")
        assert not pause.closed.is_set()  # the pause stays open: nothing changes for its client
        world.play(STEPS[3:])
        assert pause.closed.is_set() and pause.error is None and not pause.latents
    finally:
        group.stop()
    assert same(world.latents, twin)
    assert [e[0] for e in events] == ["parked", "unparked", "parked", "unparked"]
    assert all(0 < seconds < 20 for _, seconds, _ in events) and folders(tmp_path / "disk") == []


def test_more_worlds_than_slots_take_turns_and_a_returning_world_waits_at_the_front_told_its_place(
        engine, twin, tmp_path) -> None:
    """One slot, two worlds: the second waits in the queue until the first parks; the first's next step waits at the
    front of the line, told its place, until the second parks; each world is its twin, bit for bit."""
    group = OneRank(engine, parking(tmp_path))
    try:
        first = Player(group, "a")
        first.block()
        second = Player(group, "b")
        wait_until(lambda: group.parked() == {first.sid}, 20, "the first world parked")
        second.block()  # it had the slot the first one left
        back = first.step(STEPS[0])
        wait_until(lambda: back.places, 20, "the returning world's place")
        assert back.places[0] == 1 and not back.closed.is_set()  # the second world holds the slot
        first.block()
        assert group.parked() == {second.sid}
        for world in (first, second):
            world.play(STEPS[len(world.latents) - 1:])
    finally:
        group.stop()
    assert same(first.latents, twin) and same(second.latents, twin)


def test_a_client_that_vanishes_while_parked_ends_its_world_and_frees_its_copy(engine, tmp_path) -> None:
    group = OneRank(engine, parking(tmp_path))
    try:
        world = Player(group, "v")
        world.block()
        pause = world.pause()
        wait_until(lambda: group.parked() == {world.sid}, 20, "the world parked")
        assert len(folders(tmp_path / "memory")) == 1
        pause.cancelled = True  # its client went away (a SIGKILLed player's open pause)
        wait_until(lambda: pause.closed.is_set(), 10, "the parked world's end")
        wait_until(lambda: not folders(tmp_path / "memory"), 10, "its copy freed")
        assert not group.scheduler.table and not group.loop.here
    finally:
        group.stop()


def test_a_step_that_races_its_world_s_park_leaves_no_ghost(engine, tmp_path) -> None:
    """A step reaches the owner after the group began saving the world's park copy, before the copy is durable (the
    step sent at park_after_s): the copy is dropped and the world plays; idle again, it parks again, the group's count
    of parked worlds is the gauge's, and max_parked=1 still takes the next idle world."""
    counts: list = []
    group = OneRank(engine, parking(tmp_path, max_sessions=2, max_parked=1), on_queue=counts.append)
    raced: list[str] = []
    world = Player(group, "race")
    writer_post = group.loop.writer._to_loop

    def report(written) -> None:  # the writer's report of the park copy: the world's step arrives first
        if not raced and written.snapshot_id in group.intake._saves._saves:
            raced.append(written.snapshot_id)
            world.step(STEPS[0])
        writer_post(written)

    group.loop.writer._to_loop = report
    try:
        world.block()
        wait_until(lambda: raced, 20, "the park's copy written")
        world.block()  # the racing step's block
        assert group.parked() == set()
        wait_until(lambda: group.parked() == {world.sid}, 20, "the world parked again")
        assert counts[-1].parked == 1
        other = Player(group, "other")
        other.block()
        world.step(STEPS[1])  # the first world takes its slot back; the other, idle, parks in its place
        world.block()
        wait_until(lambda: group.parked() == {other.sid}, 20, "the other world parked (max_parked=1, no ghost)")
        held = [s for s in group.scheduler.table.values() if s.status in (Status.PARKING, Status.PARKED)]
        assert [s.id for s in held] == [other.sid] and counts[-1].parked == 1
    finally:
        group.stop()


def test_a_group_that_stops_ends_a_world_parked_on_disk_moved_to_its_copy(engine, twin, tmp_path) -> None:
    """No memory tier: the world parks in the snapshot store. The group's loop ends (an unload, a failure) while it is
    parked: its open pause is told MOVED naming the copy, a durable snapshot its client resumes elsewhere."""
    group = OneRank(engine, parking(tmp_path, park_memory_bytes=0))
    try:
        world = Player(group, "d")
        world.block()
        pause = world.pause()
        wait_until(lambda: group.parked() == {world.sid}, 20, "the world parked on disk")
        (copy,) = folders(tmp_path / "disk")
    finally:
        group.stop()
    assert pause.closed.wait(10) and pause.error.code == c.MOVED and pause.error.snapshot_id == copy
    resumed = OneRank(engine, ServingSettings(max_sessions=1, snapshot_dir=str(tmp_path / "disk"), park_after_s=0.0))
    try:
        again = World(resumed, resume_request(copy, STEPS[0], key="elsewhere"))
    finally:
        resumed.stop()
    assert same(again.latents, twin[1:2])


def test_the_park_tier_fills_memory_then_disk_then_a_world_stays_on_its_slot(engine, twin, tmp_path) -> None:
    """Memory holds one world's copy and the snapshot store one more: of three idle worlds one parks in memory, one
    on disk, and the third stays on its slot (its park fails, logged, counted); each goes on bit for bit."""
    request = start_request("x")
    geometry = engine.geometry_of(request)
    facts = engine.snapshot_facts
    one = facts.snapshot_size(request, geometry, facts.most_blocks(request, geometry), True).total
    events: list[str] = []
    held: list[tuple[int, int]] = []
    hooks = Hooks(on_park=lambda sid, event, s: events.append(event),
                  on_parked_bytes=lambda m, d: held.append((m, d)))
    group = OneRank(engine, parking(tmp_path, max_sessions=3, park_memory_bytes=one + 1024,
                                    snapshot_quota_bytes=one + 1024), hooks=hooks)
    try:
        worlds = [Player(group, key) for key in "xyz"]
        for world in worlds:
            world.block()
        wait_until(lambda: len(group.parked()) == 2 and "failed" in events, 30, "two worlds parked, one not")
        (stays,) = [w for w in worlds if w.sid not in group.parked()]
        assert stays.sid in group.sessions  # on its slot, caches whole
        assert len(folders(tmp_path / "memory")) == 1 and len(folders(tmp_path / "disk")) == 1
        memory, disk = held[-1]
        assert 0 < memory <= one and 0 < disk <= one  # the bytes parked in each tier
        for world in worlds:
            world.play(STEPS[:2])
    finally:
        group.stop()
    assert all(same(w.latents, twin[:3]) for w in worlds)


def test_a_drain_moves_parked_worlds_from_their_copy_without_running_a_block(engine, twin, tmp_path) -> None:
    """One world parked in memory, one on disk: the drain copies the first into the snapshot store and names the
    second's copy itself; both end MOVED with no block run, and each resumes where it was, bit for bit."""
    request = start_request("m")
    geometry = engine.geometry_of(request)
    facts = engine.snapshot_facts
    one = facts.snapshot_size(request, geometry, facts.most_blocks(request, geometry), True).total
    group = OneRank(engine, parking(tmp_path, max_sessions=2, park_memory_bytes=one + 1024))
    try:
        worlds = [Player(group, key) for key in "mn"]
        pauses = []
        for world in worlds:
            world.block()
            pauses.append(world.pause())
        wait_until(lambda: len(group.parked()) == 2, 30, "both worlds parked")
        parked_on_disk = folders(tmp_path / "disk")
        assert len(folders(tmp_path / "memory")) == 1 and len(parked_on_disk) == 1
        blocks = sum(s.computed for s in group.scheduler.table.values())
        group.intake.post(mail.Drain())
        for pause in pauses:
            assert pause.closed.wait(30) and pause.error.code == c.MOVED
        moved = [p.error.snapshot_id for p in pauses]
        assert parked_on_disk[0] in moved and sorted(moved) == folders(tmp_path / "disk")
        assert folders(tmp_path / "memory") == [] and blocks == 2
    finally:
        group.stop()
    resumed = OneRank(engine, ServingSettings(max_sessions=2, snapshot_dir=str(tmp_path / "disk"), park_after_s=0.0))
    try:
        for n, snapshot_id in enumerate(moved):
            world = World(resumed, resume_request(snapshot_id, STEPS[0], key=f"r{n}"))
            world.step(STEPS[1])
            assert same(world.latents, twin[1:3])
    finally:
        resumed.stop()


def test_a_key_at_its_snapshot_bytes_still_has_its_worlds_parked_and_moved_by_a_drain(engine, twin, tmp_path) -> None:
    """The park copies and a drain's moves are the server's, not the key's saves: a key whose snapshot_bytes refuse
    its own saves still has its idle world parked, and a drain moves it and its world on a slot (max_parked=1), each
    MOVED to a durable snapshot that resumes where it was, bit for bit."""
    full = principal("full", snapshot_bytes=1)  # no save of its own fits
    group = OneRank(engine, parking(tmp_path, max_sessions=2, max_parked=1))
    try:
        first = Player(group, "f", full)
        first.block()
        refused = first.step(Controls(keys="w", save=True))
        assert refused.closed.wait(10) and refused.error.code == c.SNAPSHOT_KEY_FULL, refused.error
        pauses = [first.pause()]
        wait_until(lambda: group.parked() == {first.sid}, 20, "the full key's idle world parked")
        second = Player(group, "g", full)
        second.block()
        pauses.append(second.pause())  # idle too; max_parked=1 keeps it on its slot
        group.intake.post(mail.Drain())
        for pause in pauses:
            assert pause.closed.wait(30) and pause.error.code == c.MOVED, pause.error
        moved = [p.error.snapshot_id for p in pauses]
        assert sorted(moved) == folders(tmp_path / "disk")
    finally:
        group.stop()
    resumed = OneRank(engine, ServingSettings(max_sessions=2, snapshot_dir=str(tmp_path / "disk"), park_after_s=0.0))
    try:
        for n, snapshot_id in enumerate(moved):
            client = Client()
            resumed.submit(resume_request(snapshot_id, STEPS[0], key=f"r{n}"), client, full)
            assert client.answered().error is None and same(client.latents, twin[1:2]), client.error
    finally:
        resumed.stop()


# -- other layouts: local process groups (one run each)

@pytest.mark.server  # a group of processes
@pytest.mark.parametrize("tp, world", [(1, 2), (2, 4)], ids=["sp2", "tp2_x_sp2"])
def test_a_world_parks_and_comes_back_bit_for_bit_at_sp2_and_tp2_x_sp2(tiny_checkpoint: str, tmp_path: Path, tp: int,
                                                                        world: int) -> None:
    """Owned by the last rank, parked twice (once under its pause): every block after each return equals the same
    steps played on the same group without a pause, bit for bit."""
    from backend.launch.local_group import LocalGroup
    from factories import tiny_settings

    settings = tiny_settings(tiny_checkpoint, sp_degree=world // tp, tp_degree=tp, decode_frames=False)
    serving = dataclasses.replace(parking(tmp_path), park_after_s=1.0, collective_timeout_s=60.0)
    owner = world - 1
    with LocalGroup(settings, serving, ranks=world) as group:
        def parked() -> bool:
            return group.call(0, "sp_workers:parked_sessions") == 1

        twin = group.steered(start_request(""), rank=owner)
        latents = [twin.next_block().latents]
        for controls in STEPS[:3]:
            twin.step(controls)
            latents.append(twin.next_block().latents)
        twin.step(None, end=True)
        assert twin.next_block() is None
        played = group.steered(start_request(""), rank=owner)
        again = [played.next_block().latents]
        played.step(STEPS[0])
        again.append(played.next_block().latents)
        wait_until(parked, 30, "the world parked")
        played.step(STEPS[1])
        again.append(played.next_block().latents)
        pause = played.pause()
        wait_until(parked, 30, "the world parked under its pause")
        played.step(STEPS[2])
        again.append(played.next_block().latents)
        assert pause.next() is None  # answered, empty, by the step
        played.step(None, end=True)
    assert len(again) == len(latents) == 4 and all(np.array_equal(a, b) for a, b in zip(again, latents))
