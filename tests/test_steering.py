"""Steered sessions over Triton sequences, against real servers on the tiny checkpoint: what Triton's sequence
batcher and the gRPC client add. What the group does with a steered session is test_group_sessions.py's."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from backend.api.request import Controls, SessionRequest
from client.steer import SteeredSession
from client.stream import StreamError
from factories import TINY_SIZE, forward_poses, sample_image, tiny_request

pytestmark = pytest.mark.server  # starts real tritonservers


@pytest.fixture(scope="module")
def server(sp2_server):
    """Two instances (SP2), one session per forward (so latents compare bit for bit), a short idle timeout."""
    return sp2_server


def steered(controls: Controls, seed: int = 42, **changes) -> SessionRequest:
    base = tiny_request(num_frames=9, seed=seed, decode=False)
    return dataclasses.replace(base, num_frames=None, poses=controls.poses, keys=controls.keys, **changes)


def play(url: str, steps: list[Controls], seed: int = 42, **changes) -> list:
    """Steer a session through `steps` (the first is the first block's camera), one block per request."""
    with SteeredSession(url) as session:
        session.start(steered(steps[0], seed, **changes))
        blocks = [session.next_block(60)]
        for i, controls in enumerate(steps[1:], start=1):
            session.step(controls, end=i == len(steps) - 1)
            blocks.append(session.next_block(60))
    return blocks


def test_sessions_are_not_capped_at_the_instance_count(server) -> None:
    """Triton's sequence batcher (oldest first) holds max_sessions=3 open sessions on 2 instances at once."""
    sessions = [SteeredSession(server.grpc_url) for _ in range(3)]
    try:
        for i, session in enumerate(sessions):
            session.start(steered(Controls(keys="w"), seed=i))
        firsts = [session.next_block(60) for session in sessions]  # none has ended: all three run together
        assert [b.block_index for b in firsts] == [0, 0, 0]
        for session in sessions:
            session.end()
            assert session.next_block(60) is None  # an end without a camera: an empty final response
    finally:
        for session in sessions:
            session.close()


def test_triton_answers_what_no_session_can_and_the_model_stays_ready(server) -> None:
    """The group's own refusals (tested in test_group_sessions) reach the client as stream errors; Triton's
    sequence batcher answers a step whose sequence has no start."""
    with SteeredSession(server.grpc_url) as session:
        session.start(steered(Controls(keys="w")))
        session.next_block(60)
        session.step(Controls(poses=forward_poses(5)))
        with pytest.raises(StreamError, match=r"camera_poses must be FP32 \[12, 4, 4\]; got float32 \[5, 4, 4\]"):
            session.next_block(30)
        session.step(Controls(keys="w"), end=True)
        assert session.next_block(60).block_index == 1
        session.step(Controls(keys="w"))  # after the end flag: Triton's sequence batcher answers it
        with pytest.raises(StreamError, match=r"must specify the START flag on the first request of the sequence"):
            session.next_block(30)
    with SteeredSession(server.grpc_url) as stranger:
        stranger.step(Controls(keys="w"))  # a step for a session that never started
        with pytest.raises(StreamError, match=r"must specify the START flag on the first request of the sequence"):
            stranger.next_block(30)
    assert len(play(server.grpc_url, [Controls(keys="w")] * 2)) == 2


def test_play_cli_writes_the_steered_video(sp1_server, tmp_path: Path, capsys) -> None:
    import imageio.v3 as iio

    from client.__main__ import main

    out = tmp_path / "play.mp4"
    size = str(TINY_SIZE)
    sheet = tmp_path / "play.png"
    code = main(["play", "--url", sp1_server.grpc_url, "--prompt", "a castle", "--keys", "w*2,@it starts to snow,wj",
                 "--height", size, "--width", size, "--out", str(out), "--image", _image(tmp_path),
                 "--contact-sheet", str(sheet)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "time to first block" in printed and "real-time factor" in printed
    assert re.search(r"block 2: .*prompt now 'it starts to snow'", printed) and sheet.is_file()
    assert len(list(iio.imiter(out, plugin="FFMPEG"))) == 9 + 12 + 12


def _image(tmp_path: Path) -> str:
    import imageio.v3 as iio

    path = tmp_path / "first.png"
    iio.imwrite(path, sample_image())
    return str(path)
