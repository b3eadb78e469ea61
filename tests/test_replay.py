"""Record a played world at SP2 and replay it at SP1 and SP2, whole and step by step, bit for bit (real servers)."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from backend.api.provenance import latents_sha256
from backend.api.request import Controls
from backend.engine.blocks import BlockControls
from backend.engine.rollout import WorldModelEngine
from client.__main__ import main
from client.recording import Recorder, Recording
from client.replay import base_request, check_blocks, replay_steps, replay_whole
from client.steer import SteeredSession
from client.stream import StreamError
import golden
from factories import TINY_SIZE, sample_image, tiny_settings, tiny_request
from polling import wait_until

pytestmark = pytest.mark.server  # starts real tritonservers


@pytest.fixture(scope="module")
def recorded(sp2_server, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A session played at SP2 with on_starve=hold: block 1 held (its step came late), then key changes."""
    request = dataclasses.replace(tiny_request(num_frames=9, decode=False), num_frames=None, poses=None, keys="w",
                                  on_starve="hold", return_used=True, return_latents=True)
    recorder = Recorder(request)
    log = Path(sp2_server.log_path)
    held_before = len(re.findall(r"block 1 of session r\d-\d+ runs on held controls", log.read_text()))
    with SteeredSession(sp2_server.grpc_url) as session:
        session.start(request)
        recorder.add(session.next_block(60))
        wait_until(lambda: len(re.findall(r"block 1 of session r\d-\d+ runs on held controls", log.read_text()))
                   > held_before, 60, "a held block")
        for i, keys in enumerate(["j", "wa", "d", "-"]):
            session.step(Controls(keys=keys), end=i == 3)
            block = session.next_block(60)
            assert block.used is not None and block.used.latents_sha256 == latents_sha256(block.latents)
            recorder.add(block)
    recording = recorder.recording
    assert [b.held for b in recording.blocks][:2] == [False, True] and len(recording.blocks) == 5
    return recorder.save(tmp_path_factory.mktemp("rec") / "world.npz")


@pytest.mark.parametrize("server", ["sp1_server", "sp2_server"])
@pytest.mark.parametrize("replay", [replay_whole, replay_steps], ids=["whole", "steps"])
def test_a_recorded_world_replays_bit_for_bit(recorded: Path, server: str, replay, request) -> None:
    recording = Recording.load(recorded)
    url = request.getfixturevalue(server).grpc_url
    blocks = replay(recording, url, "lingbot_world", False, 120)
    checks = check_blocks(recording, blocks)
    assert [c.same for c in checks] == [True] * 5, [(c.recorded[:8], (c.replayed or "")[:8]) for c in checks]
    # What came back is what was recorded: the held block's camera too, now sent as poses.
    for block, kept in zip(blocks, recording.blocks):
        assert np.array_equal(block.used.camera, kept.camera)


# Played by the server of stop 29 (commit 8c13b8a) on two AMD EPYC machines: float32 kernels (MKL's sgemm, ATen's
# vectorised ops) round differently on AVX2 and AVX-512, and MKL picks its kernels by vendor too (golden.machine), so
# a recording replays bit for bit on its own kernel family and vendor.
BEFORE_THE_LIFECYCLE = {
    "AVX512": Path(__file__).parent / "data" / "recording_stop29.npz",  # an AMD EPYC with AVX-512
    "AVX2": Path(__file__).parent / "data" / "recording_stop29_avx2.npz",  # an AMD EPYC (Zen 3), AVX2 only
}
PLAYED_ON_VENDOR = "AuthenticAMD"


def test_a_recording_written_before_the_one_lifecycle_replays_on_torch_s_vae_kernels_bit_for_bit(
        tiny_checkpoint: str, sp1_server, capsys, one_torch_thread) -> None:
    """`client play --record` on the code before sessions had one writer (commit 8c13b8a): 3 blocks, a world
    event on block 1, keys w, wj, d, on the tiny checkpoint (the two recordings differ only in their latents
    hashes). Today's server replays it step by step (the recording format and the wire contract hold); on its default
    oneDNN VAE kernels the condition encode sums in another order, so the hashes differ; on torch's own kernels
    (cpu_vae_kernels=torch, as that server ran) on the CPU it was played on (its kernel family and vendor) every block
    is bit for bit the recorded one: the same request and steps, run by the engine on one thread (as the server's DiT
    loop on two cores; the encoder's bits depend on its thread count). Elsewhere no recording's bits are this CPU's."""
    capability = torch.backends.cpu.get_cpu_capability()
    path = BEFORE_THE_LIFECYCLE.get(capability, BEFORE_THE_LIFECYCLE["AVX2"])
    played_here = capability in BEFORE_THE_LIFECYCLE and golden.cpu_vendor() == PLAYED_ON_VENDOR
    onednn = torch.backends.mkldnn.is_available()  # else the default server runs torch's kernels too
    rc = main(["replay", str(path), "--url", sp1_server.grpc_url, "--steps"])
    assert rc == 1 if onednn else rc in ((0,) if played_here else (0, 1))
    out = capsys.readouterr().out
    assert "latents bit-identical to the recording: " in out and "missing" not in out  # all 3 came back

    recording = Recording.load(path)
    engine = WorldModelEngine.load(tiny_settings(tiny_checkpoint, cpu_vae_kernels="torch"))
    with engine.session(base_request(recording, False, poses=recording.blocks[0].camera, num_frames=None)) as session:
        hashes = []
        for block in recording.blocks:
            if block.event is not None:
                engine.set_prompt(session, block.event)
            (out,) = engine.run_block([session], {session.id: BlockControls(Controls(poses=block.camera))})
            hashes.append(latents_sha256(out.latents[0].numpy()))
    recorded = [block.latents_sha256 for block in recording.blocks]
    assert hashes == recorded if played_here else len(hashes) == len(recorded), (hashes, recorded)


def test_the_replay_cli_reports_a_differing_block(recorded: Path, sp1_server, tmp_path: Path, capsys) -> None:
    """A recording whose block 3 hash is not what the server computes: the table says which, the exit is 1."""
    with np.load(recorded, allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    arrays["meta"] = np.array(str(arrays["meta"]).replace(Recording.load(recorded).blocks[3].latents_sha256, "0" * 64))
    changed = tmp_path / "changed.npz"
    np.savez(changed, **arrays)
    assert main(["replay", str(changed), "--url", sp1_server.grpc_url]) == 1
    out = capsys.readouterr().out
    assert "latents bit-identical to the recording: 4 of 5 blocks (differ: [3])" in out
    assert re.search(r"^\s+3\s+12\s+-\s+0{16}\s+[0-9a-f]{16}\s+NO", out, re.M), out


def test_a_server_with_other_settings_refuses_the_replay_naming_them(recorded: Path, sp1_server) -> None:
    recording = Recording.load(recorded)
    shift = re.search(r"timestep_shift=([^;]+)", recording.settings).group(1)
    other = dataclasses.replace(recording, settings=recording.settings.replace(f"timestep_shift={shift}",
                                                                               "timestep_shift=10.0"))
    for replay in (replay_whole, replay_steps):
        with pytest.raises(StreamError, match=rf"settings differ .*timestep_shift: expected 10.0, this server {shift}"):
            replay(other, sp1_server.grpc_url, "lingbot_world", False, 60)


def test_play_records_and_replay_checks_it_from_the_command_line(sp1_server, tmp_path: Path, capsys) -> None:
    """`play --record` with two prompt events, one with recache, replayed step by step (exit 0); a whole replay of
    an event is refused before connecting (exit 2), as is a damaged file."""
    import imageio.v3 as iio

    image = tmp_path / "first.png"
    iio.imwrite(image, sample_image())
    record = tmp_path / "played.npz"
    size = str(TINY_SIZE)
    keys = "w,@it starts to snow,wj,@!a castle in the rain,d"  # the second event recomputes the cache
    assert main(["play", "--url", sp1_server.grpc_url, "--prompt", "a castle", "--keys", keys,
                 "--height", size, "--width", size, "--out", str(tmp_path / "p.mp4"), "--image", str(image),
                 "--record", str(record)]) == 0
    printed = capsys.readouterr().out
    assert f"recording: {record} (3 blocks" in printed and "(cache recomputed)" in printed
    kept = Recording.load(record)
    assert kept.events == {1: "it starts to snow", 2: "a castle in the rain"}
    assert [b.recache for b in kept.blocks] == [False, False, True]  # as the server said (recached)
    out_mp4 = tmp_path / "replayed.mp4"
    assert main(["replay", str(record), "--steps", "--url", sp1_server.grpc_url, "--out", str(out_mp4)]) == 0
    out = capsys.readouterr().out
    assert "latents bit-identical to the recording: 3 of 3 blocks" in out and "it starts to snow" in out
    assert "a castle in the rain (recache)" in out
    assert len(list(iio.imiter(out_mp4, plugin="FFMPEG"))) == 9 + 12 + 12
    assert main(["replay", str(record), "--url", "127.0.0.1:1"]) == 2
    assert "prompt events at block(s) [1, 2]" in capsys.readouterr().err
    record.write_bytes(record.read_bytes()[:100])
    assert main(["replay", str(record), "--url", sp1_server.grpc_url]) == 2
    assert "not a readable recording" in capsys.readouterr().err
