"""The intake alone: Triton's side of one rank driven with recording responders and a fake group loop (a list of
the letters the intake hands it). No engine, no loop thread: the letters a loop would send are posted by hand,
in the orders that race in a server."""
from __future__ import annotations

import dataclasses
import queue
from pathlib import Path

import numpy as np
import pytest
import torch

from backend.api.refusal import Refusal
from backend.api.request import Controls, StepRequest
from backend.engine.blocks import BlockOutput
from backend.engine.snapshot.store import staging_folder
from backend.engine.validation import checked_spec
from backend.serving import mail, messages
from backend.serving.admission import Admission
from backend.serving.bootstrap import owner_side
from backend.serving.news import FilesWritten
from backend.serving.saves import Saves
from backend.serving.settings import ServingSettings
from backend.serving.intake import Intake
from factories import tiny_settings, tiny_request
from test_one_rank import RecordingResponder

STEERED_KEY = "7"


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


def steered_start():
    return dataclasses.replace(tiny_request(decode=False, num_frames=9), num_frames=None, poses=None, keys="w",
                               session_key=STEERED_KEY)


def block(index: int) -> BlockOutput:
    return BlockOutput("r0-0", index, 0, torch.zeros(1), 0.0, 0)


def start(side: Intake, loop: FakeLoop) -> tuple[str, RecordingResponder]:
    first = RecordingResponder()
    side.arrive(STEERED_KEY, steered_start(), first)
    shared = loop.next(mail.Submitted).session
    return shared.id, first


def test_a_start_is_admitted_once_and_a_bad_one_refused_without_news(intake) -> None:
    side, loop = intake
    sid, _ = start(side, loop)
    assert sid == "r0-0"
    again, bad = RecordingResponder(), RecordingResponder()
    side.arrive(STEERED_KEY, steered_start(), again)  # the sequence already steers a session
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
    side.arrive(STEERED_KEY, StepRequest(STEERED_KEY, Controls(keys="d")), racing)
    assert loop.next(mail.Stepped).step.session_id == sid  # the loop ends the session before it reads this step
    gone = Refusal("EXPIRED", "the session sent no step for session_idle_timeout_s=60 s and was ended")
    side.post(mail.Ended(sid, gone, gone))
    assert racing.closed.wait(5) and racing.code == "EXPIRED" and not racing.blocks
    late = RecordingResponder()
    side.arrive(STEERED_KEY, StepRequest(STEERED_KEY, Controls(keys="d")), late)
    assert late.closed.wait(5) and late.code == "EXPIRED"
    assert late.error.startswith(f"no running session {STEERED_KEY}: the session sent no step")
    assert loop.quiet()  # a step of an ended session is no news for the loop


def test_a_pause_racing_a_cancel_is_told_once_and_closed_by_the_ending(intake) -> None:
    side, loop = intake
    sid, first = start(side, loop)
    side.post(mail.Opened(sid))
    side.post(mail.Decoded(sid, block(0), np.zeros(1), 0.0, False))
    loop.next(mail.Delivered)
    paused = RecordingResponder()
    side.arrive(STEERED_KEY, StepRequest(STEERED_KEY, None, pause=True), paused)
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
    side.arrive(STEERED_KEY, StepRequest(STEERED_KEY, Controls(keys="d")), step)
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
    side.arrive(STEERED_KEY, StepRequest(STEERED_KEY, Controls(keys="d")), later)
    for r in (first, whole, later):
        assert r.closed.wait(5) and r.code == "GROUP_FAILED"
    side.post(mail.Decoded(sid, block(0), np.zeros(1), 0.0, False))  # a late block of a closed stream is dropped
    marker = RecordingResponder()  # answered after the intake has read the block (one inbox, in order)
    side.arrive("", tiny_request(decode=False), marker)
    assert marker.closed.wait(5) and marker.code == "GROUP_FAILED"
    assert not first.blocks and loop.quiet()


@pytest.fixture()
def saving_intake(engine, tmp_path):
    """An intake whose server keeps snapshots: a drain reserves an id for each steered session it moves."""
    loop = FakeLoop()
    side = owner_side(0, 1, ServingSettings(snapshot_dir=str(tmp_path)), engine, loop.post, queue.SimpleQueue())
    yield side, loop
    side.close()


def files_written(side: Intake, snapshot_id: str) -> FilesWritten:
    """A rank's report of its files of a snapshot, written small but whole into its staging folder (the store checks
    their form and sizes when it publishes, not their meaning)."""
    from backend.engine.snapshot import files

    folder = staging_folder(Path(side.settings.snapshot_dir), snapshot_id)
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
    side.arrive(STEERED_KEY, StepRequest(STEERED_KEY, Controls(keys="d")), waiting)
    loop.next(mail.Stepped)
    side.post(mail.Drain())
    snapshot_id = loop.next(mail.Moving).snapshot_id
    moved = messages.moved(snapshot_id)
    side.post(mail.Ended(sid, moved, moved))
    late = RecordingResponder()
    side.arrive(STEERED_KEY, StepRequest(STEERED_KEY, Controls(keys="w")), late)
    refused = RecordingResponder()  # answered after the intake has read the late step (one inbox, in order)
    side.arrive("", tiny_request(decode=False), refused)
    assert refused.closed.wait(5) and refused.code == "SERVER_STOPPING"
    return snapshot_id, waiting, late


def test_a_moved_world_is_named_to_any_request_only_once_its_snapshot_is_durable(saving_intake) -> None:
    """Neither the waiting step nor a late one hears MOVED, which names the snapshot, before the snapshot is
    published: a client that resumed on the id at once found no snapshot in the store, and its world was lost."""
    side, loop = saving_intake
    snapshot_id, waiting, late = drained_while_a_step_waits(side, loop)
    assert not waiting.closed.is_set() and not late.closed.is_set()
    side.post(files_written(side, snapshot_id))  # every rank's files (one rank here): published, durable now
    for r in (waiting, late):
        assert r.closed.wait(5) and r.code == "MOVED" and f"resume={snapshot_id}" in r.error
    after = RecordingResponder()
    side.arrive(STEERED_KEY, StepRequest(STEERED_KEY, Controls(keys="w")), after)
    assert after.closed.wait(5) and after.code == "MOVED" and f"resume={snapshot_id}" in after.error
    assert loop.quiet()  # the late steps are no news for the loop


def test_a_move_whose_save_failed_names_no_snapshot(saving_intake) -> None:
    side, loop = saving_intake
    snapshot_id, waiting, late = drained_while_a_step_waits(side, loop)
    side.post(FilesWritten(snapshot_id, 0, 0, (), messages.save_failed(snapshot_id)))
    for r in (waiting, late):
        assert r.closed.wait(5) and r.code == "SERVER_STOPPING" and snapshot_id not in r.error
