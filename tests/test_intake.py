"""The intake alone: Triton's side of one rank driven with recording responders and a fake group loop (a list of
the letters the intake hands it). No engine, no loop thread: the letters a loop would send are posted by hand,
in the orders that race in a server."""
from __future__ import annotations

import dataclasses
import hashlib
import queue
import secrets
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from backend.api import contract as c
from backend.api.refusal import Refusal
from backend.api.request import Controls, StepRequest
from backend.engine.blocks import BlockOutput
from backend.engine.rollout import WorldModelEngine
from backend.engine.snapshot.store import staging_folder
from backend.engine.validation import checked_spec
from backend.serving import mail, messages
from backend.serving.admission import Admission
from backend.serving.bootstrap import owner_side
from backend.serving.books import CALL_TIMEOUT_S, BooksUnavailable, Hour, Taken
from backend.serving.news import FilesWritten, Park, Parked
from backend.serving.saves import Saves
from backend.serving.settings import ServingSettings
from backend.serving.intake import Intake
from backend.serving.sequences import KEEP_ENDED
from backend.serving.keys import Principal, Quota
from backend.serving.sessions import Status, Tier
from factories import tiny_settings, tiny_request
from polling import wait_until
from test_one_rank import RecordingResponder

STEERED_SEQUENCE = "7"


class FakeLoop:
    """What the intake tells the group loop, in order."""

    def __init__(self) -> None:
        self.letters: queue.SimpleQueue = queue.SimpleQueue()

    def post(self, letter: mail.LoopLetter) -> None:
        self.letters.put(letter)

    def next(self, kind: type, timeout: float = 5.0):
        letter = self.letters.get(timeout=timeout)
        assert isinstance(letter, kind), letter
        return letter

    def quiet(self) -> bool:
        return self.letters.empty()


@pytest.fixture()
def intake(tiny_checkpoint: str):
    loop = FakeLoop()
    settings = ServingSettings(session_idle_timeout_s=0.5)
    spec = checked_spec(tiny_settings(tiny_checkpoint), 1)
    side = Intake(0, settings, Admission(settings, spec), Saves(None, None, 1, keep_commits=False), loop.post,
                  every_s=0.05)
    yield side, loop
    side.close()


def steered_start(key: str = STEERED_SEQUENCE):
    return dataclasses.replace(tiny_request(decode=False, num_frames=9), num_frames=None, poses=None, keys="w",
                               sequence_id=key)


def block(index: int) -> BlockOutput:
    return BlockOutput("r0-0", index, 0, torch.zeros(1), 0.0, 0)


def start(side: Intake, loop: FakeLoop) -> tuple[str, RecordingResponder]:
    first = RecordingResponder()
    side.arrive(STEERED_SEQUENCE, steered_start(), first)
    shared = loop.next(mail.Submitted).session
    return shared.id, first


def test_a_start_is_admitted_once_and_a_bad_one_refused_without_news(intake) -> None:
    side, loop = intake
    sid, _ = start(side, loop)
    assert sid == "r0-0"
    again, bad = RecordingResponder(), RecordingResponder()
    side.arrive(STEERED_SEQUENCE, steered_start(), again)  # the sequence already steers a session
    side.arrive("", tiny_request(num_frames=10), bad)  # not a whole number of blocks
    for r in (again, bad):
        assert r.closed.wait(5)
    assert again.code == "SESSION_EXISTS" and bad.code == "INVALID_INPUT" and "num_frames" in bad.error
    assert loop.quiet()


def test_a_step_racing_its_sessions_end_is_answered_with_the_ending(intake) -> None:
    side, loop = intake
    sid, first = start(side, loop)
    side.post(mail.Decoded(sid, block(0), np.zeros(1), 0.0, False))
    assert loop.next(mail.Delivered) == mail.Delivered(sid, 1) and first.blocks == [0]
    racing = RecordingResponder()
    side.arrive(STEERED_SEQUENCE, StepRequest(STEERED_SEQUENCE, Controls(keys="d")), racing)
    assert loop.next(mail.Stepped).step.session_id == sid  # the loop ends the session before it reads this step
    gone = Refusal("EXPIRED", "the session sent no step for session_idle_timeout_s=60 s and was ended")
    side.post(mail.Ended(sid, gone, gone))
    assert racing.closed.wait(5) and racing.code == "EXPIRED" and not racing.blocks
    late = RecordingResponder()
    side.arrive(STEERED_SEQUENCE, StepRequest(STEERED_SEQUENCE, Controls(keys="d")), late)
    assert late.closed.wait(5) and late.code == "EXPIRED"
    assert late.error.startswith(f"no running session {STEERED_SEQUENCE}: the session sent no step")
    assert loop.quiet()  # a step of an ended session is no news for the loop


def test_a_pause_racing_a_cancel_is_told_once_and_closed_by_the_ending(intake) -> None:
    side, loop = intake
    sid, first = start(side, loop)
    side.post(mail.Opened(sid))
    side.post(mail.Decoded(sid, block(0), np.zeros(1), 0.0, False))
    loop.next(mail.Delivered)
    paused = RecordingResponder()
    side.arrive(STEERED_SEQUENCE, StepRequest(STEERED_SEQUENCE, None, pause=True), paused)
    paused.cancelled = True  # the client went away while its pause was open
    assert loop.next(mail.Cancelled) == mail.Cancelled(sid)
    side.post(mail.Ended(sid, None, Refusal("SESSION_UNKNOWN", "it cancelled")))
    assert paused.closed.wait(5) and paused.error is None and not paused.blocks
    assert loop.quiet()  # told once, though the watch read the flag many times


def test_a_block_computed_ahead_answers_the_next_step_at_once(intake) -> None:
    side, loop = intake
    sid, first = start(side, loop)
    side.post(mail.Decoded(sid, block(0), np.zeros(1), 0.0, False))
    side.post(mail.Decoded(sid, block(1), np.zeros(1), 0.0, False))  # held: no request waits for it
    assert loop.next(mail.Delivered).blocks == 1 and first.blocks == [0]
    step = RecordingResponder()
    side.arrive(STEERED_SEQUENCE, StepRequest(STEERED_SEQUENCE, Controls(keys="d")), step)
    assert loop.next(mail.Stepped).step.controls == Controls(keys="d")
    assert loop.next(mail.Delivered).blocks == 2 and step.blocks == [1]


def test_an_opened_steered_session_is_expired_by_its_owners_clock_once(intake) -> None:
    side, loop = intake
    sid, first = start(side, loop)
    side.post(mail.Decoded(sid, block(0), np.zeros(1), 0.0, False))
    loop.next(mail.Delivered)
    assert loop.quiet()  # not opened: no clock runs
    side.post(mail.Opened(sid))
    expired = loop.next(mail.Expired, timeout=5)
    assert expired.session_id == sid and "session_idle_timeout_s=0.5 s" in expired.why.sentence
    with pytest.raises(queue.Empty):
        loop.letters.get(timeout=0.3)


def test_a_closed_loop_answers_every_open_stream_and_every_later_request(intake) -> None:
    side, loop = intake
    sid, first = start(side, loop)
    whole = RecordingResponder()
    side.arrive("", tiny_request(decode=False), whole)
    loop.next(mail.Submitted)
    side.post(mail.Closed(messages.GROUP_FAILED))
    later = RecordingResponder()
    side.arrive(STEERED_SEQUENCE, StepRequest(STEERED_SEQUENCE, Controls(keys="d")), later)
    for r in (first, whole, later):
        assert r.closed.wait(5) and r.code == "GROUP_FAILED"
    side.post(mail.Decoded(sid, block(0), np.zeros(1), 0.0, False))  # a late block of a closed stream is dropped
    marker = RecordingResponder()  # answered after the intake has read the block (one inbox, in order)
    side.arrive("", tiny_request(decode=False), marker)
    assert marker.closed.wait(5) and marker.code == "GROUP_FAILED"
    assert not first.blocks and loop.quiet()


def test_a_step_after_the_end_flag_is_told_so_and_the_sequence_may_start_again_at_once(intake) -> None:
    side, loop = intake
    sid, first = start(side, loop)
    side.arrive(STEERED_SEQUENCE, StepRequest(STEERED_SEQUENCE, Controls(keys="d"), end=True), RecordingResponder())
    assert loop.next(mail.Stepped).step.end  # its last block still runs
    late = RecordingResponder()
    side.arrive(STEERED_SEQUENCE, StepRequest(STEERED_SEQUENCE, Controls(keys="w")), late)
    assert late.closed.wait(5) and late.code == c.SESSION_UNKNOWN and messages.ENDED_BY_FLAG.sentence in late.error
    side.arrive(STEERED_SEQUENCE, steered_start(), RecordingResponder())  # not SESSION_EXISTS
    assert loop.next(mail.Submitted).session.id != sid and loop.quiet()


def test_another_keys_request_on_a_sequence_touches_nothing(intake) -> None:
    """A step, pause or end flag of alice's sequence sent with bob's key is refused; her open pause stays open."""
    side, loop = intake
    alice, bob = Principal("alice", "tag-a"), Principal("bob", "tag-b")
    side.arrive(STEERED_SEQUENCE, steered_start(), RecordingResponder(), principal=alice)
    sid = loop.next(mail.Submitted).session.id
    side.post(mail.Decoded(sid, block(0), np.zeros(1), 0.0, False))
    loop.next(mail.Delivered)
    paused = RecordingResponder()
    side.arrive(STEERED_SEQUENCE, StepRequest(STEERED_SEQUENCE, None, pause=True), paused, principal=alice)
    for request in (StepRequest(STEERED_SEQUENCE, Controls(keys="d")), StepRequest(STEERED_SEQUENCE, None, pause=True),
                    StepRequest(STEERED_SEQUENCE, None, end=True)):
        refused = RecordingResponder()
        side.arrive(STEERED_SEQUENCE, request, refused, principal=bob)
        assert refused.closed.wait(5) and refused.code == c.AUTH_INVALID
    assert not paused.closed.is_set() and loop.quiet()
    side.arrive(STEERED_SEQUENCE, StepRequest(STEERED_SEQUENCE, Controls(keys="d")), RecordingResponder(), principal=alice)
    assert loop.next(mail.Stepped).step.session_id == sid and paused.closed.wait(5)  # her own step answers it


def test_the_newest_ended_keys_are_remembered_and_the_oldest_forgotten(intake) -> None:
    """KEEP_ENDED keys whose session ended tell a late step why (a moved world its snapshot's id); one more ending
    forgets the key that ended longest ago, and a key that ended again counts from its latest ending."""
    side, loop = intake
    expired, again = Refusal(c.EXPIRED, "it sent no step"), Refusal(c.CANCELLED, "its client went away")
    moved = messages.moved(secrets.token_hex(16))

    def end(keys: list[str], ending: Refusal) -> None:
        for key in keys:
            side.arrive(key, steered_start(key), RecordingResponder())
        for _ in keys:
            side.post(mail.Ended(loop.next(mail.Submitted).session.id, ending, ending))

    end([f"k{i}" for i in range(KEEP_ENDED)], expired)
    end(["k0"], again)  # k0 started again and ended: now the newest but one
    end([f"k{KEEP_ENDED}"], moved)  # one ending more than are kept: k1 goes
    told = {}
    for key in ("k0", "k1", "k2", f"k{KEEP_ENDED}"):
        told[key] = RecordingResponder()
        side.arrive(key, StepRequest(key, Controls(keys="d")), told[key])
    for r in told.values():
        assert r.closed.wait(5)
    assert (told["k0"].code, told["k1"].code, told["k2"].code) == (c.CANCELLED, c.SESSION_UNKNOWN, c.EXPIRED)
    assert messages.NEVER_STARTED.sentence in told["k1"].error
    newest = told[f"k{KEEP_ENDED}"]
    assert newest.code == c.MOVED and moved.sentence in newest.error  # the sentence names the snapshot to resume
    assert loop.quiet()


@pytest.fixture()
def saving(engine: WorldModelEngine, tmp_path: Path):
    """An intake of a server that keeps snapshots in `tmp_path` (the engine's facts size a save's reservation)."""
    loop = FakeLoop()
    side = owner_side(0, 1, ServingSettings(snapshot_dir=str(tmp_path)), engine, loop.post, queue.SimpleQueue())
    yield side, loop, tmp_path
    side.close()


def test_a_failed_save_keeps_the_older_snapshot_it_names_and_a_durable_one_releases_it(saving) -> None:
    side, loop, store = saving
    sid, first = start(side, loop)
    older = secrets.token_hex(16)
    (store / older).mkdir()  # the world's last durable snapshot, which its next save releases
    for _ in range(2):  # sent ahead: the saves' outcomes are told on the oldest open request, the start's
        side.arrive(STEERED_SEQUENCE, StepRequest(STEERED_SEQUENCE, Controls(keys="d", save=True, release=older)),
                    RecordingResponder())
    failed, durable = (loop.next(mail.Stepped).step.snapshot_id for _ in range(2))
    side.post(FilesWritten(failed, 0, 0, (), messages.save_failed(failed)))  # a rank could not write its files
    wait_until(lambda: first.notices, 5, "the failed save's outcome")
    assert first.notices[0].error is not None and (store / older).is_dir()  # still the world's fallback
    side.post(files_written(side, durable))
    wait_until(lambda: len(first.notices) == 2, 5, "the durable save's outcome")
    assert first.notices[1].error is None and not (store / older).exists()


def test_a_drain_moves_each_steered_world_once_its_snapshot_is_durable_and_takes_no_new_session(saving) -> None:
    """Each steered session is saved where it stands and ends MOVED with its snapshot's id only once that snapshot is
    durable (one whose save failed ends SERVER_STOPPING: nothing to resume); a whole trajectory runs on."""
    side, loop, _ = saving
    pauses = {}
    for key in ("7", "8"):  # two played worlds, each with the pause its client keeps open
        side.arrive(key, steered_start(key), RecordingResponder())
        sid = loop.next(mail.Submitted).session.id
        side.post(mail.Decoded(sid, block(0), np.zeros(1), 0.0, False))
        loop.next(mail.Delivered)
        pauses[sid] = RecordingResponder()
        side.arrive(key, StepRequest(key, None, pause=True), pauses[sid])
    side.arrive("", tiny_request(decode=False), RecordingResponder())
    whole = loop.next(mail.Submitted).session.id
    side.post(mail.Drain())
    moving = {m.session_id: m.snapshot_id for m in (loop.next(mail.Moving) for _ in pauses)}
    assert set(moving) == set(pauses) and whole not in moving
    (saved, failed), refused = moving, RecordingResponder()
    for sid, snapshot_id in moving.items():  # the loop saves each at the next boundary and ends it
        side.post(mail.Ended(sid, messages.moved(snapshot_id), messages.moved(snapshot_id)))
    side.arrive("9", steered_start("9"), refused)  # answered after the endings were read (one inbox, in order)
    assert refused.closed.wait(5) and refused.code == c.SERVER_STOPPING
    assert not any(p.closed.is_set() for p in pauses.values())  # held until their snapshots are durable
    side.post(files_written(side, moving[saved]))
    side.post(FilesWritten(moving[failed], 0, 0, (), messages.save_failed(moving[failed])))
    for p in pauses.values():
        assert p.closed.wait(5) and not p.notices  # a move's id comes with MOVED, not as a save's outcome
    assert pauses[saved].code == c.MOVED and moving[saved] in pauses[saved].error
    assert pauses[failed].code == c.SERVER_STOPPING
    assert loop.quiet()


def test_a_save_on_a_bounded_sessions_last_block_is_told_on_the_pause_its_client_keeps(saving) -> None:
    side, loop, _ = saving
    sid, first = start(side, loop)
    last = RecordingResponder()
    side.arrive(STEERED_SEQUENCE, StepRequest(STEERED_SEQUENCE, Controls(keys="d", save=True)), last)
    snapshot_id = loop.next(mail.Stepped).step.snapshot_id
    for index in (0, 1):
        side.post(mail.Decoded(sid, block(index), np.zeros(1), 0.0, False))
    finished = Refusal(c.SESSION_UNKNOWN, "it finished")
    side.post(mail.Ended(sid, None, finished))  # its max_blocks ran: the loop ends it after its last block
    pause = RecordingResponder()  # what a client sends once every request is answered
    side.arrive(STEERED_SEQUENCE, StepRequest(STEERED_SEQUENCE, None, pause=True), pause)
    side.post(files_written(side, snapshot_id))
    assert pause.closed.wait(5) and last.blocks == [1]
    assert [n.snapshot_id for n in pause.notices] == [snapshot_id] and pause.error is None


def files_written(side: Intake, snapshot_id: str, root: Path | None = None) -> FilesWritten:
    """A rank's report of its files of a snapshot, written small but whole into its staging folder (in store `root`,
    by default the snapshot store; the store checks their form and sizes when it publishes, not their meaning)."""
    from backend.engine.snapshot import files

    folder = staging_folder(root or Path(side.settings.snapshot_dir), snapshot_id)
    heads = side._saves.facts.model()["num_heads"]
    parts = [files.Part("shared", 0, {"x": torch.zeros(1)}), files.Part("condition", 0, {"x": torch.zeros(1)}),
             files.Part("kv", 0, {"k.0": torch.zeros(4)}, heads=(0, heads))]
    return FilesWritten(snapshot_id, 0, 0, tuple(files.write_part(folder, part) for part in parts))


def drained_while_a_step_waits(side: Intake, loop: FakeLoop) -> tuple[str, RecordingResponder, RecordingResponder]:
    """A steered session with a step waiting for its block, moved by a drain; the loop has ended it MOVED but its
    snapshot is not durable yet, and a late step of its sequence has arrived. Returns (snapshot id, the waiting
    step's responder, the late step's)."""
    sid, first = start(side, loop)
    side.post(mail.Opened(sid))
    side.post(mail.Decoded(sid, block(0), np.zeros(1), 0.0, False))
    loop.next(mail.Delivered)
    waiting = RecordingResponder()
    side.arrive(STEERED_SEQUENCE, StepRequest(STEERED_SEQUENCE, Controls(keys="d")), waiting)
    loop.next(mail.Stepped)
    side.post(mail.Drain())
    snapshot_id = loop.next(mail.Moving).snapshot_id
    moved = messages.moved(snapshot_id)
    side.post(mail.Ended(sid, moved, moved))
    late = RecordingResponder()
    side.arrive(STEERED_SEQUENCE, StepRequest(STEERED_SEQUENCE, Controls(keys="w")), late)
    refused = RecordingResponder()  # answered after the intake has read the late step (one inbox, in order)
    side.arrive("", tiny_request(decode=False), refused)
    assert refused.closed.wait(5) and refused.code == "SERVER_STOPPING"
    return snapshot_id, waiting, late


def test_a_moved_world_is_named_to_any_request_only_once_its_snapshot_is_durable(saving) -> None:
    """Neither the waiting step nor a late one hears MOVED, which names the snapshot, before the snapshot is
    published: a client that resumed on the id at once found no snapshot in the store, and its world was lost."""
    side, loop, _ = saving
    snapshot_id, waiting, late = drained_while_a_step_waits(side, loop)
    assert not waiting.closed.is_set() and not late.closed.is_set()
    side.post(files_written(side, snapshot_id))  # every rank's files (one rank here): published, durable now
    for r in (waiting, late):
        assert r.closed.wait(5) and r.code == "MOVED" and f"resume={snapshot_id}" in r.error
    after = RecordingResponder()
    side.arrive(STEERED_SEQUENCE, StepRequest(STEERED_SEQUENCE, Controls(keys="w")), after)
    assert after.closed.wait(5) and after.code == "MOVED" and f"resume={snapshot_id}" in after.error
    assert loop.quiet()  # the late steps are no news for the loop


def test_a_move_whose_save_failed_names_no_snapshot(saving) -> None:
    side, loop, _ = saving
    snapshot_id, waiting, late = drained_while_a_step_waits(side, loop)
    side.post(FilesWritten(snapshot_id, 0, 0, (), messages.save_failed(snapshot_id)))
    for r in (waiting, late):
        assert r.closed.wait(5) and r.code == "SERVER_STOPPING" and snapshot_id not in r.error


def test_a_step_racing_its_worlds_park_keeps_it_on_its_slot_and_its_copy_is_dropped(engine, tmp_path: Path) -> None:
    """The owner parks an idle world (its copy reserved in memory), and its player's step comes while the copy is
    being written: the copy, once made, is released and the group is not told to take the world off its slot. A park
    the group refuses (max_parked) drops its reservation at once, and the owner tries again park_after_s later."""
    loop = FakeLoop()
    memory = tmp_path / "memory"
    settings = ServingSettings(snapshot_dir=str(tmp_path / "disk"), park_memory_dir=str(memory), park_after_s=0.2)
    side = owner_side(0, 1, settings, engine, loop.post, queue.SimpleQueue())
    try:
        sid, first = start(side, loop)
        side.post(mail.Opened(sid))
        side.post(mail.Decoded(sid, block(0), np.zeros(1), 0.0, False))
        loop.next(mail.Delivered)
        park = loop.next(Park)  # no block asked for 0.2 s
        assert park.session_id == sid and park.tier is Tier.MEMORY
        step = RecordingResponder()
        side.arrive(STEERED_SEQUENCE, StepRequest(STEERED_SEQUENCE, Controls(keys="d")), step)
        assert loop.next(mail.Stepped).step.controls == Controls(keys="d")
        side.post(files_written(side, park.snapshot_id, memory))  # the group made the copy before the step came
        wait_until(lambda: not held(memory), 5, "the copy released")
        # The group is told the copy was dropped (no manifest): the world plays on its slot, its park no longer under
        # way (else it never parks again and counts against max_parked).
        assert loop.next(Parked) == Parked(sid, park.snapshot_id, None)
        assert loop.quiet() and not step.closed.is_set()
        side.post(mail.Decoded(sid, block(1), np.zeros(1), 0.0, False))
        loop.next(mail.Delivered)
        again = loop.next(Park)
        side.post(mail.ParkRefused(again.snapshot_id, messages.park_full(1, 0.2)))
        wait_until(lambda: not held(memory), 5, "the refused park's reservation dropped")
        assert loop.next(Parked) == Parked(sid, again.snapshot_id, None)
        assert loop.next(Park).snapshot_id != again.snapshot_id  # tried again park_after_s later
    finally:
        side.close()


def held(store: Path) -> list[str]:
    """What a store's folder holds beside its lock file: snapshots, saves under way."""
    return [p.name for p in store.iterdir() if p.name != ".lock"]


class SlowBooks:
    """The fleet's books answering each call at the end of its bound (books.CALL_TIMEOUT_S): `sessions` seats, then
    places in the queue; no seat ever frees."""

    def __init__(self, sessions: int) -> None:
        self.sessions, self.calls = sessions, 0

    def _call(self) -> None:
        self.calls += 1
        time.sleep(CALL_TIMEOUT_S)  # the store's bound, spent

    def take(self, name, lease_id, quota, lease_s) -> Taken:
        self._call()
        self.sessions -= 1
        return Taken("seat" if self.sessions >= 0 else "queue")

    def promote(self, name, lease_id, sessions, lease_s) -> bool:
        self._call()
        return False

    def renew(self, leases, lease_s) -> bool:
        self._call()
        return True

    def add_blocks(self, name, blocks) -> Hour:
        self._call()
        return Hour(time.time(), ())

    def release(self, name, lease_id) -> None:
        self._call()


class SlowAddress:
    def __init__(self, books: SlowBooks) -> None:
        self.books = books

    def connect(self) -> SlowBooks:
        return self.books


class TimedResponder(RecordingResponder):
    def __init__(self) -> None:
        super().__init__()
        self.sent_at: list[float] = []

    def send_block(self, output: BlockOutput, frames: np.ndarray, decode_ms: float, final: bool) -> None:
        self.sent_at.append(time.monotonic())
        super().send_block(output, frames, decode_ms, final)


def test_a_slow_store_never_delays_a_running_session_s_block(engine: WorldModelEngine) -> None:
    """The books answer every call at the end of its bound, and the key's sessions ask them all the time (its hour's
    blocks, a waiting world's seat, the leases' renewals): the running world's blocks still reach its client as the
    loop hands them over, not a store's call later."""
    loop = FakeLoop()
    books = SlowBooks(sessions=1)
    settings = ServingSettings(books_lease_s=1.0)  # renewed every third of a second
    side = owner_side(0, 1, settings, engine, loop.post, queue.SimpleQueue(), books=SlowAddress(books))
    alice = principal("alice", sessions=1, queue=1, blocks_per_hour=10**6)
    try:
        first = TimedResponder()  # a whole trajectory: every block goes out as it comes
        side.arrive("", tiny_request(decode=False), first, principal=alice)
        sid = loop.next(mail.Submitted).session.id
        side.arrive("", tiny_request(decode=False), RecordingResponder(), principal=alice)  # waits for a seat
        assert loop.next(mail.Submitted).session.status is Status.WAITING_SEAT
        posted = []
        for index in range(40):  # one block every 40 ms for 1.6 s, the loop's pace
            posted.append(time.monotonic())
            side.post(mail.Decoded(sid, block(index), np.zeros(1), 0.0, False))
            time.sleep(0.04)
        wait_until(lambda: len(first.sent_at) == len(posted), 5, "every block sent (not held by the store)")
        delays = sorted(sent - at for sent, at in zip(first.sent_at, posted))
        assert books.calls > 4  # the store was asked while the blocks went out
        assert delays[-1] < CALL_TIMEOUT_S / 2, f"blocks delayed up to {delays[-1]:.3f} s by the store"
    finally:
        side.close()


def principal(name: str, **quota: int) -> Principal:
    digest = hashlib.sha256(name.encode()).hexdigest()
    return Principal(name, digest[:12], Quota(**quota), digest)


class GatedBooks:
    """The fleet's books as the owner's books thread sees them: each start's lease answered `kind` once `gate` is open;
    a waiting lease seated when `promoted`; the key's hour counted here; `down`: every call refused."""

    def __init__(self, kind: str = "seat", promoted: bool = False) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.kind, self.promoted, self.down = kind, promoted, False
        self.calls: list[str] = []
        self.used = 0

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if self.down:
            raise BooksUnavailable("the books did not answer: stopped")

    def take(self, name, lease_id, quota, lease_s) -> Taken:
        self._call("take")
        assert self.gate.wait(10)
        return Taken(self.kind)

    def promote(self, name, lease_id, sessions, lease_s) -> bool:
        self._call("promote")
        return self.promoted

    def renew(self, leases, lease_s) -> bool:
        self._call("renew")
        return True

    def add_blocks(self, name, blocks) -> Hour:
        self._call("add_blocks")
        self.used += blocks
        return Hour(time.time(), ((int(time.time() // 60), self.used),))

    def release(self, name, lease_id) -> None:
        self._call("release")


@pytest.fixture()
def booked(tiny_checkpoint: str):
    """An intake of a group that shares the fleet's books (GatedBooks)."""
    loop, books = FakeLoop(), GatedBooks()
    settings = ServingSettings()
    spec = checked_spec(tiny_settings(tiny_checkpoint), 1)
    side = Intake(0, settings, Admission(settings, spec), Saves(None, None, 1, keep_commits=False), loop.post,
                  every_s=0.05, books=books)
    yield side, loop, books
    side.close()


ALICE = principal("alice", sessions=1, queue=1, blocks_per_hour=1)


def test_a_start_waiting_for_its_lease_answers_its_sequence_s_later_requests_after_it(booked) -> None:
    """The books take their time over a start's lease: nothing of it reaches the group before their answer, and the
    pause and the second start its sequence sent meanwhile are answered after it, as if the books had answered at
    once (the pause held on its stream until the next request, the start told its sequence has a session); its lease
    is released once, as it ends."""
    side, loop, books = booked
    books.gate.clear()
    first, pause, again = RecordingResponder(), RecordingResponder(), RecordingResponder()
    side.arrive(STEERED_SEQUENCE, steered_start(), first, principal=ALICE)
    wait_until(lambda: books.calls == ["take"], 5, "the books asked for the start's lease")
    side.arrive(STEERED_SEQUENCE, StepRequest(STEERED_SEQUENCE, None, pause=True), pause, principal=ALICE)
    side.arrive(STEERED_SEQUENCE, steered_start(), again, principal=ALICE)
    with pytest.raises(queue.Empty):  # no work before the key's limits across the fleet let it in
        loop.letters.get(timeout=0.3)
    assert not (pause.closed.is_set() or again.closed.is_set())
    books.gate.set()
    sid = loop.next(mail.Submitted).session.id
    assert again.closed.wait(5) and again.code == c.SESSION_EXISTS
    assert pause.closed.is_set() and pause.error is None  # held on its session's stream, answered by the next request
    side.post(mail.Ended(sid, None, Refusal(c.SESSION_UNKNOWN, "it finished")))
    assert first.closed.wait(5) and first.error is None
    wait_until(lambda: "release" in books.calls, 5, "the lease released")
    side.close()
    assert books.calls.count("release") == 1


def test_the_books_answers_are_told_with_their_codes_and_a_key_without_limits_never_waits_for_them(booked) -> None:
    side, loop, books = booked
    books.kind = "full"
    full = RecordingResponder()
    side.arrive("", tiny_request(decode=False), full, principal=ALICE)
    assert full.closed.wait(5) and (full.code, full.error) == (c.USER_SESSION_LIMIT,
                                                               messages.user_session_limit("alice", 1, 1).sentence)
    books.down = True
    down, soon = RecordingResponder(), RecordingResponder()
    side.arrive("", tiny_request(decode=False), down, principal=ALICE)
    assert down.closed.wait(5) and (down.code, down.error) == (c.BOOKS_UNAVAILABLE, messages.BOOKS_UNAVAILABLE.sentence)
    asked = len(books.calls)
    side.arrive("", tiny_request(decode=False), soon, principal=ALICE)  # within RETRY_S: the store is not asked
    assert soon.closed.wait(5) and soon.code == c.BOOKS_UNAVAILABLE and len(books.calls) == asked
    books.gate.clear()  # a key without limits the books count never waits for them
    side.arrive("", tiny_request(decode=False), RecordingResponder(), principal=principal("carol"))
    assert loop.next(mail.Submitted).session.user == "carol"
    assert loop.quiet() and not full.blocks


def test_a_drain_or_a_close_while_a_start_waits_for_its_lease_refuses_it_and_its_lease_goes(booked) -> None:
    side, loop, books = booked
    books.gate.clear()
    drained = RecordingResponder()
    side.arrive("7", steered_start("7"), drained, principal=ALICE)
    wait_until(lambda: books.calls == ["take"], 5, "the books asked for the start's lease")
    side.post(mail.Drain())
    books.gate.set()
    assert drained.closed.wait(5) and drained.code == c.SERVER_STOPPING and drained.error == messages.DRAINING.sentence
    wait_until(lambda: books.calls == ["take", "release"], 5, "the drained start's lease released")
    assert loop.quiet()


def test_a_close_while_a_start_waits_for_its_lease_answers_it_at_once(booked) -> None:
    side, loop, books = booked
    books.gate.clear()
    waiting, pause = RecordingResponder(), RecordingResponder()
    side.arrive("7", steered_start("7"), waiting, principal=ALICE)
    wait_until(lambda: books.calls == ["take"], 5, "the books asked for the start's lease")
    side.arrive("7", StepRequest("7", None, pause=True), pause, principal=ALICE)
    side.post(mail.Closed(messages.GROUP_FAILED))
    for r in (waiting, pause):  # before the books answer
        assert r.closed.wait(5) and r.code == c.GROUP_FAILED
    books.gate.set()
    side.close()
    assert books.calls == ["take", "release"] and loop.quiet()  # the lease went as the books thread closed


def test_a_waiting_lease_s_seat_and_its_key_s_hour_reach_the_group_after_its_start(booked) -> None:
    """Told by the books thread, handed on by the intake: a session waiting in its key's queue is seated after the
    group was given it, and one whose key used its hour across the fleet ends."""
    side, loop, books = booked
    books.kind, books.promoted = "queue", True
    side.arrive("", tiny_request(decode=False), RecordingResponder(), principal=ALICE)
    shared = loop.next(mail.Submitted).session
    assert shared.status is Status.WAITING_SEAT
    assert loop.next(mail.Seated) == mail.Seated((shared.id,))
    side.post(mail.Decoded(shared.id, block(0), np.zeros(1), 0.0, False))
    assert loop.next(mail.Delivered).blocks == 1
    over = loop.next(mail.OverQuota)
    assert over.session_id == shared.id and over.why.code == c.QUOTA_EXHAUSTED
