"""Saving a steered world through the serving path and resuming it anywhere, bit for bit (docs/worlds.md): a step's
`save` writes a snapshot in the background and tells its client the id once it is durable; a start with `resume`
opens it where it stood, on one rank or a sequence-parallel group; forks are independent; and every refusal an
attacker or an unlucky user can cause (a path for an id, a guessed id, a damaged or truncated file, a snapshot of
other settings, a full store) has its code while the server serves on."""
from __future__ import annotations

import dataclasses
import json
import re
import secrets
import threading
from pathlib import Path

import numpy as np
import pytest

from backend.api import contract as c
from backend.api.codec import SnapshotNotice, controls_arrays, parse_request, request_arrays
from backend.api.errors import InputError
from backend.api.refusal import Refusal
from backend.api.request import Controls, ResumeRequest, SessionRequest, StepRequest
from backend.engine.blocks import BlockOutput
from backend.engine.rollout import WorldModelEngine
from backend.serving.settings import ServingSettings
from factories import tiny_request
from backend.serving.bootstrap import snapshot_store
from one_rank import OneRank
from polling import wait_until

EVENT = Controls(keys="d", prompt="it starts to snow", recache=True)
# Block 0 is the start's; a prompt event with a recache before block 2; the window's first eviction before block 3;
# the save after block 4; then two blocks more.
STEPS = [Controls(keys="w"), EVENT, Controls(keys="w"), Controls(keys="wa"), Controls(keys="j"), Controls(keys="w")]
SAVED_AFTER = 4
KEY = "7"


class Client:
    """One request's replies: its blocks' latents, the saves' outcomes and places in the queue told on it, its end."""

    def __init__(self) -> None:
        self.latents: list[np.ndarray] = []
        self.notices: list[SnapshotNotice] = []
        self.places: list[int] = []
        self.error: Refusal | None = None
        self.closed = threading.Event()

    def send_block(self, output: BlockOutput, frames: np.ndarray, decode_ms: float, final: bool) -> None:
        self.latents.append(output.latents[0].numpy().copy())
        if final:
            self.closed.set()

    def send_error(self, refusal: Refusal) -> None:
        self.error = refusal
        self.closed.set()

    def send_place(self, position: int, wait_s: float) -> None:
        self.places.append(position)

    def send_notice(self, notice: SnapshotNotice) -> None:
        self.notices.append(notice)

    def finish(self) -> None:
        self.closed.set()

    def is_cancelled(self) -> bool:
        return self.cancelled

    cancelled = False

    def answered(self, timeout: float = 60.0) -> Client:
        assert self.closed.wait(timeout), "no answer"
        return self


class World:
    """A steered session played step by step through one rank's intake, as Triton would hand its requests over."""

    def __init__(self, group: OneRank, first: SessionRequest | ResumeRequest) -> None:
        self.group, self.key = group, first.sequence_id
        self.latents: list[np.ndarray] = []
        self.notices: list[SnapshotNotice] = []
        self._ask(first)

    def _ask(self, request: object) -> Client:
        client = Client()
        self.group.submit(request, client)
        client.answered()
        self.notices += client.notices
        if client.error is not None:
            raise RefusedError(client.error)
        self.latents += client.latents
        return client

    def step(self, controls: Controls, save: bool = False) -> None:
        self._ask(StepRequest(self.key, dataclasses.replace(controls, save=save)))

    def saved(self, timeout: float = 60.0) -> SnapshotNotice:
        """The outcome of the save asked for last, told on a pause held open meanwhile (as clients keep one)."""
        pause = Client()
        self.group.submit(StepRequest(self.key, None, pause=True), pause)
        wait_until(lambda: pause.notices, timeout, "the save's outcome")
        self.notices += pause.notices
        return pause.notices[-1]

    def end(self) -> None:
        self._ask(StepRequest(self.key, None, end=True))


class RefusedError(Exception):
    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


def start_request(key: str = KEY):
    return dataclasses.replace(tiny_request(decode=False, num_frames=9), num_frames=None, poses=None, keys="w",
                               sequence_id=key)


def resume_request(snapshot_id: str, controls: Controls, key: str = KEY, fork_seed: int = c.NO_FORK) -> ResumeRequest:
    return ResumeRequest(snapshot_id, controls, key, fork_seed)


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("snapshots")


@pytest.fixture(scope="module")
def group(engine: WorldModelEngine, snapshots: Path):
    ranks = OneRank(engine, ServingSettings(max_sessions=2, snapshot_dir=str(snapshots), max_blocks_ahead=100))
    yield ranks
    ranks.stop()


@pytest.fixture(scope="module")
def uninterrupted(group: OneRank) -> list[np.ndarray]:
    world = World(group, start_request("u"))
    for controls in STEPS:
        world.step(controls)
    world.end()
    return world.latents


@pytest.fixture(scope="module")
def saved(group: OneRank, uninterrupted: list[np.ndarray]) -> str:
    """A session played to block 4 and saved there (it plays on to its end, unchanged by the save)."""
    world = World(group, start_request("s"))
    for n, controls in enumerate(STEPS, start=1):
        world.step(controls, save=n == SAVED_AFTER)
        if n == SAVED_AFTER:
            notice = world.saved()
    world.end()
    assert notice.error is None and len(notice.snapshot_id) == 32
    assert all(np.array_equal(a, b) for a, b in zip(world.latents, uninterrupted, strict=True))
    return notice.snapshot_id


def test_a_resumed_world_makes_the_blocks_the_saved_one_would_have_bit_for_bit(group, uninterrupted, saved) -> None:
    world = World(group, resume_request(saved, STEPS[SAVED_AFTER], key="r"))
    for controls in STEPS[SAVED_AFTER + 1:]:
        world.step(controls)
    world.end()
    after = uninterrupted[SAVED_AFTER + 1:]
    assert len(world.latents) == len(after)
    assert all(np.array_equal(a, b) for a, b in zip(world.latents, after))


def test_a_resumed_world_is_held_back_only_when_its_client_falls_behind(engine, snapshots, uninterrupted,
                                                                       saved) -> None:
    """Its client has the blocks before the snapshot: a group with the default max_blocks_ahead (2) plays a resumed
    world on past two blocks while its client keeps up."""
    ranks = OneRank(engine, ServingSettings(max_sessions=1, snapshot_dir=str(snapshots)))
    try:
        assert ranks.settings.max_blocks_ahead == 2
        world = World(ranks, resume_request(saved, STEPS[SAVED_AFTER], key="b"))
        for controls in (*STEPS[SAVED_AFTER + 1:], Controls(keys="w"), Controls(keys="d")):
            world.step(controls)
        world.end()
    finally:
        ranks.stop()
    assert len(world.latents) == 4
    assert all(np.array_equal(a, b) for a, b in zip(world.latents, uninterrupted[SAVED_AFTER + 1:]))


def test_forks_of_one_snapshot_are_independent_worlds(group, uninterrupted, saved) -> None:
    """Two resumes played in turn: the same steps give the original's blocks, a new noise seed others; neither
    changes the other; other steps give other blocks; a fork's seed makes it reproducible."""
    same, seeded = (World(group, resume_request(saved, STEPS[SAVED_AFTER], key=k, fork_seed=s))
                    for k, s in (("f1", c.NO_FORK), ("f2", 1234)))
    same.step(STEPS[SAVED_AFTER + 1])
    seeded.step(STEPS[SAVED_AFTER + 1])
    for world in (same, seeded):
        world.end()
    again = World(group, resume_request(saved, STEPS[SAVED_AFTER], key="f3", fork_seed=1234))
    again.end()
    other = World(group, resume_request(saved, Controls(keys="s"), key="f4"))
    other.end()
    assert all(np.array_equal(a, b) for a, b in zip(same.latents, uninterrupted[SAVED_AFTER + 1:], strict=True))
    assert not np.array_equal(seeded.latents[0], uninterrupted[SAVED_AFTER + 1])  # new noise from the first block
    assert np.array_equal(again.latents[0], seeded.latents[0])  # the same seed, the same fork
    assert not np.array_equal(other.latents[0], uninterrupted[SAVED_AFTER + 1])  # another step


def test_a_fork_from_seed_0_is_a_fork(group, uninterrupted, saved) -> None:
    """0 is a seed like any other: only a resume without a fork seed (NO_FORK) lets the saved noise go on."""
    fork = World(group, resume_request(saved, STEPS[SAVED_AFTER], key="f0", fork_seed=0))
    fork.end()
    assert not np.array_equal(fork.latents[0], uninterrupted[SAVED_AFTER + 1])


def copy_snapshot(snapshots: Path, snapshot_id: str) -> str:
    """A published snapshot copied under a new id (its manifest names its id): what an attacker may tamper with."""
    twin = secrets.token_hex(16)
    (snapshots / twin).mkdir()
    for f in (snapshots / snapshot_id).iterdir():
        data = f.read_bytes()
        if f.name == "manifest.json":
            data = data.replace(snapshot_id.encode(), twin.encode())
        (snapshots / twin / f.name).write_bytes(data)
    return twin


def refusal_of(group: OneRank, request: object) -> Refusal:
    with pytest.raises(RefusedError) as refused:
        World(group, request)
    return refused.value.refusal


def test_an_id_that_is_a_path_is_refused_at_parse_before_any_file_is_touched() -> None:
    for bad in ("../../etc/passwd", "a" * 31, "A" * 32, "a" * 32 + "/", "/" + "a" * 32, "a" * 33):
        params = json.dumps({c.PARAM_RESUME: bad})
        arrays = {c.ACTION: np.array([b"w"], dtype=np.object_)}
        with pytest.raises(InputError, match="request parameter 'resume' must be a snapshot id"):
            parse_request(arrays.get, params, KEY, c.SEQUENCE_START)


def test_a_guessed_a_damaged_a_truncated_and_a_foreign_snapshot_are_refused_and_the_server_serves_on(
        group, uninterrupted, saved, snapshots: Path) -> None:
    step = STEPS[SAVED_AFTER]
    assert refusal_of(group, resume_request(secrets.token_hex(16), step)).code == c.SNAPSHOT_UNKNOWN
    flipped = copy_snapshot(snapshots, saved)
    kv = snapshots / flipped / "kv-0.safetensors"
    data = bytearray(kv.read_bytes())
    data[len(data) // 2] ^= 0x01
    kv.write_bytes(bytes(data))
    assert refusal_of(group, resume_request(flipped, step)).code == c.SNAPSHOT_INVALID
    truncated = copy_snapshot(snapshots, saved)
    shared = snapshots / truncated / "shared.safetensors"
    shared.write_bytes(shared.read_bytes()[:-10])
    assert refusal_of(group, resume_request(truncated, step)).code == c.SNAPSHOT_INVALID
    foreign = copy_snapshot(snapshots, saved)
    manifest = snapshots / foreign / "manifest.json"
    manifest.write_text(manifest.read_text().replace("kv_reuse=False", "kv_reuse=True"))
    refusal = refusal_of(group, resume_request(foreign, step))
    assert refusal.code == c.SETTINGS_MISMATCH and "kv_reuse" in refusal.sentence
    world = World(group, resume_request(saved, step, key="after"))  # the real one still resumes, bit for bit
    world.end()
    assert np.array_equal(world.latents[0], uninterrupted[SAVED_AFTER + 1])


def test_saves_past_the_quota_are_refused_at_once_while_others_play(engine: WorldModelEngine, tmp_path: Path) -> None:
    """The quota holds one save's reservation (its largest snapshot) and a little more: a first save is durable,
    a second is refused at once with a retry time, nothing of it written, and every session goes on."""
    request = start_request()
    geometry = engine.geometry_of(request)
    facts = engine.snapshot_facts
    reserved = facts.snapshot_size(request, geometry, facts.most_blocks(request, geometry), True).total
    full = OneRank(engine, ServingSettings(max_sessions=2, snapshot_dir=str(tmp_path), max_blocks_ahead=100,
                                         snapshot_quota_bytes=reserved + 1024))
    try:
        other = World(full, start_request("other"))  # plays throughout
        world = World(full, start_request())
        world.step(Controls(keys="w"), save=True)
        first = world.saved()
        assert first.error is None
        with pytest.raises(RefusedError) as refused:
            world.step(Controls(keys="w"), save=True)
        assert refused.value.refusal.code == c.SNAPSHOT_STORE_FULL and refused.value.refusal.retry_after_s > 0
        assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".lock")] == [first.snapshot_id]
        world.step(Controls(keys="w"))  # the session goes on
        other.step(Controls(keys="d"))
        assert len(world.latents) == 3 and len(other.latents) == 2
        world.end()
        other.end()
    finally:
        full.stop()


def test_a_save_whose_block_never_runs_frees_its_reservation(engine: WorldModelEngine, tmp_path: Path) -> None:
    """A start that asks for a save waits in the queue, and its client leaves: the reservation is dropped (no staging
    folder, nothing held against the quota) and its stream is closed, not held for a save that will never be."""
    ranks = OneRank(engine, ServingSettings(max_sessions=1, snapshot_dir=str(tmp_path)))
    try:
        playing = World(ranks, start_request("playing"))
        waiting = Client()
        ranks.submit(dataclasses.replace(start_request("waiting"), save=True), waiting)
        wait_until(lambda: list(tmp_path.glob(".staging-*")), 10, "the waiting start's reservation")
        waiting.cancelled = True
        assert waiting.closed.wait(10) and not waiting.latents
        wait_until(lambda: not list(tmp_path.glob(".staging-*")), 10, "the reservation to be dropped")
        assert snapshot_store(ranks.settings).usage() == 0
        playing.end()
    finally:
        ranks.stop()


def test_a_save_releases_the_older_snapshot_it_names_once_it_is_durable(engine: WorldModelEngine,
                                                                         tmp_path: Path) -> None:
    """Periodic saves free their predecessors: a save with release=ID deletes ID once the new snapshot is durable
    (its bytes freed, a resume of it SNAPSHOT_UNKNOWN); release rides only on a save of a saved world."""
    ranks = OneRank(engine, ServingSettings(max_sessions=2, snapshot_dir=str(tmp_path), max_blocks_ahead=100))
    try:
        world = World(ranks, start_request())
        world.step(Controls(keys="w"), save=True)
        older = world.saved().snapshot_id
        held = snapshot_store(ranks.settings).usage()
        world.step(Controls(keys="d", release=older), save=True)
        newer = world.saved()
        assert newer.error is None and not (tmp_path / older).exists() and (tmp_path / newer.snapshot_id).is_dir()
        assert snapshot_store(ranks.settings).usage() <= held * 2  # one world's snapshot less than two
        assert refusal_of(ranks, resume_request(older, Controls(keys="w"), key="late")).code == c.SNAPSHOT_UNKNOWN
        world.end()
    finally:
        ranks.stop()
    release = json.dumps({c.PARAM_RELEASE: "a" * 32})
    step = controls_arrays(Controls(keys="w"))
    with pytest.raises(InputError, match="'release' rides on a save"):
        parse_request(step.get, release, KEY, 0)
    with pytest.raises(InputError, match="a new world has none"):
        parse_request(request_arrays(start_request()).get, json.dumps({c.PARAM_RELEASE: "a" * 32, c.PARAM_SAVE: True}),
                      KEY, c.SEQUENCE_START)
    with pytest.raises(InputError, match="'release' must be a snapshot id"):
        parse_request(step.get, json.dumps({c.PARAM_RELEASE: "../" + "a" * 29, c.PARAM_SAVE: True}), KEY, 0)


def published(store: Path) -> set[str]:
    """The ids of the snapshots a store holds (a folder each, named by its id)."""
    return {p.name for p in store.iterdir() if re.fullmatch(c.SNAPSHOT_ID_PATTERN, p.name)}


def test_a_bounded_world_resumes_for_the_block_it_has_left_and_not_after_its_last(engine: WorldModelEngine,
                                                                                  tmp_path: Path) -> None:
    """max_blocks=3, saved after block 1 and after block 2 (its last): the first resumes and makes block 2 as the
    world did; the second is refused, nothing being left to play."""
    ranks = OneRank(engine, ServingSettings(max_sessions=1, snapshot_dir=str(tmp_path), max_blocks_ahead=100))
    try:
        world = World(ranks, dataclasses.replace(start_request("b"), max_blocks=3))
        world.step(Controls(keys="w"), save=True)
        one_left = world.saved().snapshot_id
        world.step(Controls(keys="d"), save=True)
        (last,) = wait_until(lambda: published(tmp_path) - {one_left}, 30, "the last block's snapshot")
        refusal = refusal_of(ranks, resume_request(last, Controls(keys="w"), key="r1"))
        assert refusal.code == c.INVALID_INPUT and "max_blocks=3" in refusal.sentence
        resumed = World(ranks, resume_request(one_left, Controls(keys="d"), key="r2"))
        assert len(world.latents) == 3 and len(resumed.latents) == 1
        assert np.array_equal(resumed.latents[0], world.latents[2])
    finally:
        ranks.stop()


def test_without_a_snapshot_dir_a_save_or_a_resume_is_refused_naming_it(engine: WorldModelEngine) -> None:
    bare = OneRank(engine, ServingSettings(max_sessions=1))
    try:
        world = World(bare, start_request())
        with pytest.raises(RefusedError, match="snapshot_dir"):
            world.step(Controls(keys="w"), save=True)
        world.step(Controls(keys="w"))
        world.end()
        assert refusal_of(bare, resume_request(secrets.token_hex(16), Controls(keys="w"))).code == c.INVALID_INPUT
    finally:
        bare.stop()


def test_a_resume_needs_the_next_blocks_camera_and_nothing_of_the_snapshots_own() -> None:
    arrays = {c.ACTION: np.array([b"w"], dtype=np.object_), c.SEED: np.array([1], dtype=np.int64)}
    params = json.dumps({c.PARAM_RESUME: "a" * 32})
    with pytest.raises(InputError, match=r"\['seed'\] are the snapshot's"):
        parse_request(arrays.get, params, KEY, c.SEQUENCE_START)
    with pytest.raises(InputError, match="needs the next block's"):
        parse_request({}.get, params, KEY, c.SEQUENCE_START)
    with pytest.raises(InputError, match="recache' rides on a prompt event"):
        parse_request({c.ACTION: arrays[c.ACTION]}.get, json.dumps({c.PARAM_RESUME: "a" * 32, c.PARAM_RECACHE: True}),
                      KEY, c.SEQUENCE_START)
    resumed = parse_request({c.ACTION: arrays[c.ACTION]}.get, json.dumps({c.PARAM_RESUME: "a" * 32,
                                                                          c.PARAM_FORK_SEED: 7}), KEY,
                            c.SEQUENCE_START)
    assert resumed == ResumeRequest("a" * 32, Controls(keys="w"), KEY, 7)
    event = {c.ACTION: arrays[c.ACTION], c.PROMPT: np.array([b"it snows"], dtype=np.object_)}  # a prompt event
    resumed = parse_request(event.get, json.dumps({c.PARAM_RESUME: "a" * 32, c.PARAM_RECACHE: True}), KEY,
                            c.SEQUENCE_START)
    assert resumed.controls == Controls(keys="w", prompt="it snows", recache=True)


def test_a_resume_takes_a_world_event_and_counts_its_blocks_on_from_the_snapshot(engine, snapshots: Path,
                                                                                uninterrupted) -> None:
    """A client that fails over replays the steps since its snapshot, so its resume may carry a prompt event (here
    with a recache): the blocks are the uninterrupted session's, bit for bit; and the resumed session's blocks
    count on from the snapshot's, as the group's backpressure does (the default max_blocks_ahead, 2, would hold a
    session whose delivered blocks counted from 0 after its second block)."""
    group = OneRank(engine, ServingSettings(max_sessions=1, snapshot_dir=str(snapshots)))
    try:
        world = World(group, start_request("e"))
        world.step(STEPS[0], save=True)
        notice = world.saved()
        world.end()
        resumed = World(group, resume_request(notice.snapshot_id, STEPS[1], key="e2"))  # the event, recached
        for controls in STEPS[2:]:
            resumed.step(controls)
        resumed.end()
    finally:
        group.stop()
    assert all(np.array_equal(a, b) for a, b in zip(resumed.latents, uninterrupted[2:], strict=True))


@pytest.mark.server  # a group of two processes
def test_a_world_saved_on_sp2_resumes_on_one_rank_and_one_saved_there_resumes_on_sp2_bit_for_bit(
        sp2_group, engine: WorldModelEngine, snapshot_dir: str, uninterrupted: list[np.ndarray]) -> None:
    """The latents of SP1 and SP2 are the same bits, so a world moves between them and goes on exactly."""
    request = dataclasses.replace(start_request(), sequence_id=None)
    played = sp2_group.steered(request)
    latents = [played.next_block().latents]
    for n, controls in enumerate(STEPS[:SAVED_AFTER], start=1):
        played.step(dataclasses.replace(controls, save=n == SAVED_AFTER))
        latents.append(played.next_block().latents)
    notice = played.pause().next(notices=True)
    played.step(None, end=True)
    assert notice.error is None
    assert all(np.array_equal(a, b) for a, b in zip(latents, uninterrupted[:SAVED_AFTER + 1], strict=True))
    one = OneRank(engine, ServingSettings(max_sessions=1, snapshot_dir=snapshot_dir))
    try:
        world = World(one, resume_request(notice.snapshot_id, STEPS[SAVED_AFTER], key="sp1"))
        world.step(STEPS[SAVED_AFTER + 1], save=True)  # saved on one rank, after block 6
        there = world.saved()
        world.end()
    finally:
        one.stop()
    assert all(np.array_equal(a, b) for a, b in zip(world.latents, uninterrupted[SAVED_AFTER + 1:], strict=True))
    back = sp2_group.resumed(resume_request(there.snapshot_id, Controls(keys="w"), key=""))
    block = back.next_block()
    back.step(None, end=True)
    reference = World(OneRank(engine, ServingSettings(max_sessions=1, snapshot_dir=snapshot_dir)),
                      resume_request(there.snapshot_id, Controls(keys="w"), key="ref"))
    reference.end()
    reference.group.stop()
    assert block.block_index == SAVED_AFTER + 3 and np.array_equal(block.latents, reference.latents[0])
