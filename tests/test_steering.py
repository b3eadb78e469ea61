"""Steered sessions over Triton sequences, against real servers on the tiny checkpoint."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from backend.api.controls import integrate, parse_key_script
from backend.api.request import Controls, SessionRequest
from client.steer import SteeredSession
from client.stream import StreamError
from factories import TINY_SIZE, forward_poses, sample_image, tiny_request
from polling import wait_until
from triton_harness import SP2_IDLE_S, latents_of, running_server, stream

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


def pose_steps(poses: np.ndarray) -> list[Controls]:
    return [Controls(poses=poses[:9])] + [Controls(poses=poses[i : i + 12]) for i in range(9, len(poses), 12)]


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


def test_a_long_session_streams_every_block_once_in_order(server) -> None:
    window_blocks = 3  # the tiny checkpoint's 9-frame window
    steps = [Controls(keys="w")] * (3 * window_blocks)
    blocks = play(server.grpc_url, steps)
    assert [b.block_index for b in blocks] == list(range(len(steps)))
    assert all(b.latents.shape == (4, 3, 8, 8) and not b.held for b in blocks)


def test_whole_trajectory_and_steps_give_identical_latents(server) -> None:
    poses = forward_poses(57, step=0.25)  # constant speed: the running scale is the clip's from block 0 on
    whole = latents_of(stream(server.grpc_url, tiny_request(num_frames=57, poses=poses, decode=False)))
    steps = latents_of(play(server.grpc_url, pose_steps(poses)))
    assert np.array_equal(whole, steps)


def test_a_key_script_equals_the_poses_it_integrates_to(server) -> None:
    keys = parse_key_script("w*2,wj,d")
    first = np.concatenate([np.eye(4, dtype=np.float32)[None], integrate(np.eye(4), keys[0], 8)])
    poses = [first]
    for k in keys[1:]:
        poses.append(integrate(poses[-1][-1], k, 12))
    by_keys = latents_of(play(server.grpc_url, [Controls(keys=k) for k in keys]))
    by_poses = latents_of(play(server.grpc_url, [Controls(poses=p) for p in poses]))
    assert np.array_equal(by_keys, by_poses)


def test_idle_session_expires_and_frees_its_caches(server) -> None:
    log = Path(server.log_path)
    with SteeredSession(server.grpc_url, keep_alive=False) as session:  # a raw client: no pause held open
        pattern = re.compile(r"session (r\d-\d+) expired after 1 block \(steered: no set length\); "
                             r"freed (\d+) cache bytes \(left: 0\)")
        before = len(pattern.findall(log.read_text()))  # other tests' sessions on this shared server
        session.start(steered(Controls(keys="w")))
        session.next_block(60)
        found = wait_until(lambda: pattern.findall(log.read_text())[before:], SP2_IDLE_S + 30,
                           "the idle session to expire")
        assert int(found[-1][1]) > 0
        session.step(Controls(keys="w"))
        with pytest.raises(StreamError, match=r"no running session \d+: the session sent no step for "
                                              r"session_idle_timeout_s=4 s and was ended; start a new one"):
            session.next_block(30)


def test_hold_keeps_playing_and_flags_held_blocks(server) -> None:
    log = Path(server.log_path)
    with SteeredSession(server.grpc_url) as session:
        session.start(steered(Controls(keys="d"), on_starve="hold"))
        assert not session.next_block(60).held
        # No step sent: the session repeats its last motion for one block ahead, then waits.
        wait_until(lambda: re.search(r"block 1 of session r\d-\d+ runs on held controls", log.read_text()), 60,
                   "a held block")
        session.step(Controls(keys="d"))
        late = session.next_block(60)
        assert late.held and late.block_index == 1
        session.step(Controls(keys="d"), end=True)
        last = session.next_block(60)
        assert not last.held and last.block_index == 2


def test_two_sessions_on_both_instances_one_cancelled_then_a_third(server) -> None:
    a, b = SteeredSession(server.grpc_url), SteeredSession(server.grpc_url)
    try:
        a.start(steered(Controls(keys="w"), seed=1))
        b.start(steered(Controls(keys="a"), seed=2))
        assert a.next_block(60).block_index == 0 and b.next_block(60).block_index == 0
        a.step(Controls(keys="w"))
        b.step(Controls(keys="a"))
        assert a.next_block(60).block_index == 1
    finally:
        a.close()  # cancelled mid-session
    assert b.next_block(60).block_index == 1
    b.step(Controls(keys="a"), end=True)
    assert b.next_block(60).block_index == 2
    b.close()
    assert len(play(server.grpc_url, [Controls(keys="s")] * 2, seed=3)) == 2
    owners = set(re.findall(r"rank (\d): session r\d-\d+ (?:finished|cancelled)", Path(server.log_path).read_text()))
    assert owners == {"0", "1"}, "sessions were served by both instances"


def test_bad_steps_get_clear_errors_and_the_model_stays_ready(server) -> None:
    with SteeredSession(server.grpc_url) as session:
        session.start(steered(Controls(keys="w")))
        session.next_block(60)
        session.step(Controls(poses=forward_poses(5)))
        with pytest.raises(StreamError, match=r"camera_poses must be FP32 \[12, 4, 4\]; got float32 \[5, 4, 4\]"):
            session.next_block(30)
        session._send({"action": np.array([b"wq"], dtype=object)})
        with pytest.raises(StreamError, match=r"action 'wq' holds unknown key\(s\) \['q'\]"):
            session.next_block(30)
        session.start(steered(Controls(keys="w")))  # a second start on the live sequence
        with pytest.raises(StreamError, match=r"session \d+ is already running"):
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


def test_a_session_lives_at_most_max_session_s(tmp_path: Path, tiny_checkpoint: str) -> None:
    with running_server(tmp_path, tiny_checkpoint, sp=1, max_session_s="3", decode_frames="false") as short:
        with SteeredSession(short.grpc_url) as session:
            session.start(steered(Controls(keys="w")))
            session.next_block(60)
            with pytest.raises(StreamError, match=r"max_session_s=3 s"):
                for _ in range(200):  # keep stepping: the cap, not idleness, ends it
                    session.step(Controls(keys="w"))
                    session.next_block(60)


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
