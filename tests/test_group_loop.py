"""The group loop alone, on one rank: fed only through its inbox (the letters an intake would post), its answers
read from the queue an intake would read. No intake, no Triton, no responders."""
from __future__ import annotations

import dataclasses
import queue

import pytest

from backend.api.request import Controls
from backend.engine.rollout import WorldModelEngine
from backend.serving import mail, messages
from backend.serving.admission import Admission
from backend.serving.settings import ServingSettings
from backend.serving.loop import GroupLoop
from backend.serving.news import StepEvent
from factories import tiny_request


class Answers:
    """The letters the loop and its decode sender hand the intake, in order."""

    def __init__(self) -> None:
        self.letters: queue.SimpleQueue = queue.SimpleQueue()

    def next(self, timeout: float = 60.0) -> mail.IntakeLetter:
        return self.letters.get(timeout=timeout)

    def until(self, kind: type, session_id: str | None = None, timeout: float = 60.0) -> list[mail.IntakeLetter]:
        """Every letter up to and including the first of `kind` (of `session_id`, if given)."""
        seen = [self.next(timeout)]
        while not (isinstance(seen[-1], kind) and session_id in (None, seen[-1].session_id)):
            seen.append(self.next(timeout))
        return seen


def of(letters: list[mail.IntakeLetter], session_id: str) -> list[str]:
    """One session's letters, by kind and block: the order the intake gets them in (per session, it is kept)."""
    return [type(x).__name__ + (f" {x.output.block_index}" if isinstance(x, mail.Decoded) else "")
            + (f" {x.place}" if isinstance(x, mail.Placed) else "") for x in letters if x.session_id == session_id]


@pytest.fixture()
def loop(engine: WorldModelEngine):
    settings = ServingSettings(max_sessions=1, max_queue=1, max_blocks_ahead=2)
    answers = Answers()
    group = GroupLoop(engine, settings, None, answers.letters.put)
    yield group, answers, Admission(settings, engine.spec)
    group.stop()


def test_sessions_stream_wait_in_the_queue_and_end_through_the_inbox(loop) -> None:
    group, answers, admission = loop
    for sid, frames in (("a", 21), ("b", 9), ("c", 9)):
        group.post(mail.Submitted(admission.session(tiny_request(decode=False, num_frames=frames), sid, 0)))
    got = answers.until(mail.Ended, "b")
    # One slot, one place in the queue: "a" opens and runs its two blocks; "b" waits first in the queue, then takes the slot
    # "a" frees; "c" finds the line full and is refused with the line's retry time.
    assert of(got, "a") == ["Opened", "Decoded 0", "Decoded 1", "Ended"]
    assert of(got, "b") == ["Placed 1", "Opened", "Placed 0", "Decoded 0", "Ended"]
    assert of(got, "c") == ["Ended"]
    ended = {x.session_id: x for x in got if isinstance(x, mail.Ended)}
    assert ended["a"].error is None and ended["b"].error is None
    assert ended["c"].error.code == "CAPACITY_EXHAUSTED" and ended["c"].error.retry_after_s > 0
    finals = [x.final for x in got if isinstance(x, mail.Decoded) and x.session_id == "a"]
    assert finals == [False, True]


def test_backpressure_holds_a_session_until_the_intake_reports_deliveries(loop) -> None:
    group, answers, admission = loop
    group.post(mail.Submitted(admission.session(tiny_request(decode=False, num_frames=57), "a", 0)))
    got = answers.until(mail.Decoded) + answers.until(mail.Decoded)  # max_blocks_ahead=2 blocks, nothing delivered
    assert [x.output.block_index for x in got if isinstance(x, mail.Decoded)] == [0, 1]
    with pytest.raises(queue.Empty):  # held back: its client has received nothing
        answers.next(timeout=1.0)
    group.post(mail.Delivered("a", 2))
    assert answers.until(mail.Decoded)[-1].output.block_index == 2


def test_steps_cancellation_and_stop_arrive_as_letters(loop) -> None:
    group, answers, admission = loop
    start = dataclasses.replace(tiny_request(decode=False, num_frames=9), num_frames=None, poses=None, keys="w",
                                sequence_id="7")
    group.post(mail.Submitted(admission.session(start, "a", 0)))
    assert answers.until(mail.Decoded)[-1].output.block_index == 0
    with pytest.raises(queue.Empty):  # a steered session waits for its next camera
        answers.next(timeout=0.5)
    group.post(mail.Stepped(StepEvent("a", Controls(keys="d"))))
    assert answers.until(mail.Decoded)[-1].output.block_index == 1
    group.post(mail.Cancelled("a"))
    ended = answers.until(mail.Ended)[-1]
    assert ended.session_id == "a" and ended.error is None and "cancelled" in ended.told.sentence
    assert not group.here  # the loop holds nothing of it
    group.stop()
    assert answers.next(timeout=10) == mail.Closed(messages.MODEL_UNLOADING)
