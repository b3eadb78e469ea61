"""Saves belong to their key (docs/security.md, "Saves belong to their key"): a snapshot records the hash of the key
that saved it; another key's resume, fork and release are refused SNAPSHOT_NOT_YOURS unless its owner shares it
(`share` on the save, or `saves=share` later); a key lists its own saves and their sizes; its snapshots count against
its own `snapshot_bytes` beside the store's quota. Through one rank's intake (the serving path) and at the store."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from backend.api import contract as c
from backend.api.codec import parse_request
from backend.api.request import Controls, ResumeRequest, SavesRequest, StepRequest
from backend.engine.rollout import WorldModelEngine
from backend.engine.snapshot.store import Ownership, SnapshotStore
from backend.serving.keys import ANONYMOUS, Principal, Quota
from backend.serving.settings import ServingSettings
from factories import tiny_request
from one_rank import OneRank
from polling import wait_until
from test_saved_worlds import Client
from test_snapshots import Clock, publish_small, refused

pytestmark = pytest.mark.timeout(300)


def principal(name: str, **quota: int) -> Principal:
    digest = hashlib.sha256(name.encode()).hexdigest()
    return Principal(name, digest[:12], Quota(**quota), digest)


ALICE, BOB = principal("alice"), principal("bob")


class Saves:
    """Answers to requests about a key's saves and to steered requests, as the intake gives them."""

    def __init__(self, group: OneRank) -> None:
        self.group = group
        self.keys = iter(range(1000, 10_000))

    def ask(self, request: object, who: Principal) -> Client:
        client = Listing()
        self.group.submit(request, client, who)
        return client.answered()

    def listing(self, who: Principal, action: str = "list", snapshot_id: str = "") -> dict:
        client = self.ask(SavesRequest(action, snapshot_id), who)
        assert client.error is None, client.error
        return client.listing

    def saved_world(self, who: Principal, share: bool = False, release: str = "") -> str:
        """A new world of `who`, saved after its first block (on its start's step, or on a step of its own that
        releases `release`); its snapshot's id once durable."""
        key = str(next(self.keys))
        start = dataclasses.replace(tiny_request(decode=False, num_frames=9), num_frames=None, poses=None, keys="w",
                                    sequence_id=key, save=not release, share=share)
        first = self.ask(start, who)
        assert first.error is None, first.error
        if release:
            step = self.ask(StepRequest(key, Controls(keys="w", save=True, release=release)), who)
            assert step.error is None, step.error
        pause = Listing()
        self.group.submit(StepRequest(key, None, pause=True), pause, who)
        wait_until(lambda: pause.notices, 60, "the save's outcome")
        self.ask(StepRequest(key, None, end=True), who)
        notice = pause.notices[-1]
        assert notice.error is None, notice.error
        return notice.snapshot_id

    def resume(self, snapshot_id: str, who: Principal, fork_seed: int = c.NO_FORK, **controls) -> Client:
        key = str(next(self.keys))
        client = self.ask(ResumeRequest(snapshot_id, Controls(keys="w", **controls), key, fork_seed), who)
        if client.error is None:
            self.ask(StepRequest(key, None, end=True), who)
        return client


class Listing(Client):
    listing: dict | None = None

    def send_saves(self, listing: str) -> None:
        self.listing = json.loads(listing)
        self.closed.set()


@pytest.fixture(scope="module")
def saves(engine: WorldModelEngine, tmp_path_factory: pytest.TempPathFactory):
    group = OneRank(engine, ServingSettings(max_sessions=2, max_blocks_ahead=100,
                                            snapshot_dir=str(tmp_path_factory.mktemp("owned"))))
    yield Saves(group)
    group.stop()


def test_another_key_s_resume_fork_and_release_are_refused_until_its_owner_shares(saves: Saves) -> None:
    snapshot_id = saves.saved_world(ALICE)
    for fork_seed in (c.NO_FORK, 7):  # a resume, and a fork
        refusal = saves.resume(snapshot_id, BOB, fork_seed).error
        assert refusal is not None and refusal.code == c.SNAPSHOT_NOT_YOURS, refusal
    assert saves.resume(snapshot_id, ANONYMOUS).error.code == c.SNAPSHOT_NOT_YOURS  # a keyless request owns nothing
    # bob's own world, saved, may not release alice's snapshot; nor may he share it
    refusal = saves.resume(saves.saved_world(BOB), BOB, save=True, release=snapshot_id).error
    assert refusal is not None and refusal.code == c.SNAPSHOT_NOT_YOURS, refusal
    assert saves.ask(SavesRequest("share", snapshot_id), BOB).error.code == c.SNAPSHOT_NOT_YOURS
    assert saves.resume(snapshot_id, ALICE).error is None  # its owner's
    (entry,) = [s for s in saves.listing(ALICE, "share", snapshot_id)["snapshots"] if s["id"] == snapshot_id]
    assert entry["shared"]
    assert saves.resume(snapshot_id, BOB).error is None  # shared: any key that holds its id
    assert saves.resume(snapshot_id, BOB, 7).error is None
    saves.listing(ALICE, "unshare", snapshot_id)
    assert saves.resume(snapshot_id, BOB).error.code == c.SNAPSHOT_NOT_YOURS


def test_a_save_shared_at_once_opens_to_every_key_and_a_key_lists_only_its_own(saves: Saves) -> None:
    shared = saves.saved_world(ALICE, share=True)
    assert saves.resume(shared, BOB).error is None
    alice, bob = saves.listing(ALICE), saves.listing(BOB)
    assert shared in [s["id"] for s in alice["snapshots"]] and shared not in [s["id"] for s in bob["snapshots"]]
    assert alice["key"] == "alice" and alice["quota_bytes"] is None
    assert alice["bytes"] == sum(s["bytes"] for s in alice["snapshots"]) > 0  # nothing under way now
    assert [s["created_unix_s"] for s in alice["snapshots"]] == sorted(s["created_unix_s"] for s in alice["snapshots"])
    refusal = saves.ask(SavesRequest("list"), ANONYMOUS).error  # a server's keyless requests own no saves
    assert refusal is not None and refusal.code == c.INVALID_INPUT


def test_a_key_s_snapshot_bytes_bind_its_own_saves(saves: Saves) -> None:
    """A save past the key's snapshot_bytes is refused at once (SNAPSHOT_KEY_FULL with a retry time), its block not
    run; another key's saves are not counted against it."""
    held = saves.listing(ALICE)["bytes"]
    tight = dataclasses.replace(ALICE, quota=Quota(snapshot_bytes=held + 1))
    key = "999"
    start = dataclasses.replace(tiny_request(decode=False, num_frames=9), num_frames=None, poses=None, keys="w",
                                sequence_id=key, save=True)
    refusal = saves.ask(start, tight).error
    assert refusal is not None and refusal.code == c.SNAPSHOT_KEY_FULL and refusal.retry_after_s > 0, refusal
    roomy = dataclasses.replace(BOB, quota=Quota(snapshot_bytes=held + 10**9))
    saves.saved_world(roomy)  # alice's bytes are not bob's


def test_a_save_that_releases_a_snapshot_already_expired_or_swept_is_told_durable(saves: Saves) -> None:
    """The older snapshot a save step releases may be gone by then, swept past its time to live, or past it and not
    swept yet: the save is the key's own and is written and told durable (never SNAPSHOT_NOT_YOURS: nothing is left
    to own), and the old one stays gone."""
    store = saves.group.intake._saves.store
    swept, expired = saves.saved_world(ALICE), saves.saved_world(ALICE)
    past = time.time() - store.ttl_s - 1
    os.utime(store.root / swept, (past, past))
    store.sweep()
    os.utime(store.root / expired, (past, past))  # its sweep is the next save's reservation
    for gone in (swept, expired):
        newer = saves.saved_world(ALICE, release=gone)
        assert newer in [s["id"] for s in saves.listing(ALICE)["snapshots"]]
        assert saves.resume(gone, ALICE).error.code == c.SNAPSHOT_EXPIRED


def test_the_saves_request_is_its_own_kind_of_request() -> None:
    parsed = parse_request({}.get, json.dumps({c.PARAM_SAVES: "share", c.PARAM_SNAPSHOT: "a" * 32}), "5", 3)
    assert parsed == SavesRequest("share", "a" * 32)
    for params, words in (({c.PARAM_SAVES: "share"}, "needs request parameter 'snapshot'"),
                          ({c.PARAM_SAVES: "list", c.PARAM_SNAPSHOT: "a" * 32}, "without 'snapshot'"),
                          ({c.PARAM_SAVES: "list", c.PARAM_SAVE: True}, "takes no session parameters"),
                          ({c.PARAM_SNAPSHOT: "a" * 32}, "send it with that"),
                          ({c.PARAM_SHARE: True}, "rides on a save")):
        with pytest.raises(ValueError, match=words):
            parse_request({}.get, json.dumps(params), "5", 3)
    with pytest.raises(ValueError, match="without inputs"):
        parse_request({c.SEED: __import__("numpy").array([0])}.get, json.dumps({c.PARAM_SAVES: "list"}), "5", 3)


def test_the_store_counts_a_key_s_bytes_and_keeps_its_owner_with_the_snapshot(tmp_path: Path) -> None:
    """The owner file travels with the folder from its reservation on; a save under way counts at its reservation
    against its key; a key's retry waits for its own oldest snapshot; an unreadable owner file opens to nobody."""
    clock = Clock()
    store = SnapshotStore(tmp_path / "store", quota_bytes=10**6, ttl_s=60.0, clock=clock)
    alice = Ownership("a" * 64)
    first = store.reserve(30_000, alice, owner_quota=50_000)
    assert store.ownership(first) == alice  # under way
    publish_small(store, first, 30_000)
    assert store.ownership(first) == alice and not store.ownership(first).opens_for("b" * 64)
    clock.now += 10.0
    publish_small(store, store.reserve(10_000, Ownership("b" * 64)), 10_000)  # another key's
    with refused(c.SNAPSHOT_KEY_FULL) as caught:
        store.reserve(30_000, alice, owner_quota=50_000)
    assert caught.value.refusal.retry_after_s == pytest.approx(50.0)  # when alice's own first one expires
    store.reserve(15_000, alice, owner_quota=50_000)  # under way: its reservation counts
    assert 45_000 <= store.usage("a" * 64) < 47_000  # its files, manifest and owner file beside them
    with refused(c.SNAPSHOT_NOT_YOURS):
        store.share(first, "b" * 64, True)
    (store.root / first / "owner.json").write_text("not json")
    assert not store.ownership(first).opens_for("a" * 64)
    unowned = store.reserve(1_000)  # saved without a key: nobody's, open to any holder of its id
    publish_small(store, unowned, 1_000)
    assert store.ownership(unowned).opens_for("b" * 64) and not (store.root / unowned / "owner.json").exists()
