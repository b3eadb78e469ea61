"""The clients of saved worlds through a real tritonserver (the shared SP1 server, saving into the shared store):
`play --save-every` and `--resume`, `replay --from-snapshot`, and a world whose stream is cut going on bit for bit.
The failovers of killed groups are test_fleet.py's and test_robustness.py's; the world's own logic against a
stand-in server is test_played_world.py's."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from backend.api.controls import parse_play_script
from client.__main__ import main
from client.recording import Recording
from client.steer import SteeredSession
from client.world import PlayedWorld
from factories import TINY_SIZE, tiny_request

pytestmark = [pytest.mark.server, pytest.mark.timeout(300)]

# Block 4 is a prompt event: a resume from the save after block 3 carries it.
KEYS = "w,a,d,wa,@it starts to snow,j,l,w"


def test_play_saves_resumes_by_id_and_replays_from_a_snapshot_bit_for_bit(sp1_server, tmp_path: Path, capsys) -> None:
    url, size = sp1_server.grpc_url, str(TINY_SIZE)
    record = tmp_path / "world.npz"
    # One save in 7 blocks (after block 3): no periodic save releases another, so the recording keeps it.
    assert main(["play", "--url", url, "--prompt", "a castle", "--keys", KEYS, "--save-every", "4", "--height", size,
                 "--width", size, "--out", str(tmp_path / "p.mp4"), "--record", str(record)]) == 0
    printed = capsys.readouterr().out
    saved = {m[0]: int(m[1]) for m in re.findall(r"snapshot ([0-9a-f]{32}) after block (\d+): durable", printed)}
    recording = Recording.load(record)
    assert list(saved.values()) == [3] and recording.snapshots == saved and "released" not in printed, printed
    (first,) = saved
    # Resumed by its id, the world goes on from block 4 (its prompt event on the resume itself) ...
    steps = KEYS.split(",", 4)[4]
    assert main(["play", "--url", url, "--resume", first, "--keys", steps, "--save-every", "0",
                 "--out", str(tmp_path / "r.mp4")]) == 0
    resumed = capsys.readouterr().out
    assert re.findall(r"^block (\d+):", resumed, re.M) == [str(i) for i in range(4, len(recording.blocks))]
    assert re.search(r"^block 4: .*prompt now 'it starts to snow'", resumed, re.M), resumed
    # ... and the recorded steps after the snapshot replay from it bit for bit.
    assert main(["replay", str(record), "--url", url, "--from-snapshot", first]) == 0
    replayed = capsys.readouterr().out
    assert f"latents bit-identical to the recording: {len(recording.blocks) - 4} of {len(recording.blocks) - 4}" \
           f" blocks" in replayed and re.search(r"^\s+4\s+12 .* it starts to snow$", replayed, re.M), replayed
    assert main(["replay", str(record), "--url", url, "--from-snapshot", "f" * 32]) == 2
    assert "notes no snapshot" in capsys.readouterr().err


def test_a_world_whose_stream_is_cut_resumes_and_goes_on_bit_for_bit(sp1_server) -> None:
    """The stream is cut after 4 blocks (the client's own connection: as a dead group's would end): the world
    resumes from its last snapshot on the same address and every block equals the uninterrupted world's."""
    request = dataclasses.replace(tiny_request(num_frames=9, decode=False), num_frames=None, poses=None, keys="w")
    steps = parse_play_script(KEYS)
    worlds = [play(sp1_server.grpc_url, request, steps, cut_after=cut) for cut in (None, 4)]
    (uninterrupted, _), (cut, failovers) = worlds
    assert cut == uninterrupted and len(cut) == len(steps)
    (failover,) = failovers
    assert failover.resume_block is not None and failover.took_s is not None and failover.took_s < 30


def play(url: str, request, steps: list, cut_after: int | None) -> tuple[list[str], list]:
    """A world played with lookahead 1 and a save every 2 blocks: its blocks' latents hashes, its failovers."""
    sessions: list[SteeredSession] = []

    def opened(*args: object, **kwargs: object) -> SteeredSession:
        sessions.append(SteeredSession(*args, **kwargs))
        return sessions[-1]

    hashes: list[str] = []
    with PlayedWorld(url, save_every=2, session_factory=opened, strict=True) as world:
        world.start(dataclasses.replace(request, keys=steps[0].keys))
        sent = 1
        for received in range(len(steps)):
            while sent < len(steps) and sent - received <= 1:
                world.step(steps[sent], end=sent == len(steps) - 1)
                sent += 1
            if received == cut_after:
                sessions[-1].close()
            hashes.append(world.next_block(60).used.latents_sha256)
        world.finish(60)
    return hashes, world.failovers
