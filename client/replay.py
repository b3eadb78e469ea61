"""`python -m client replay FILE`: run a recorded world again and check its latents, block by block, bit for bit.

    python -m client replay out/world.npz --url localhost:8001 --out out/replay.mp4
    python -m client replay out/world.npz --steps
    python -m client replay out/world.npz --from-snapshot ID

By default one whole trajectory carries every recorded pose (pose_scale=running, as the steered session scaled
its translations); --steps replays it as a steered session again, one step per block with its prompt event. Both
send the recording's settings as expect_settings, so a server with other settings refuses before any work.
--from-snapshot resumes one of the snapshots the recording notes and replays, step by step, only the recorded
blocks after it (a server with other settings refuses the snapshot, naming them); the table lists those blocks.
Exit status: 0 when every block's latents equal the recorded hashes, 1 when one differs or the stream fails,
2 for a recording that cannot be replayed.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass

import numpy as np

from backend.api.codec import BlockResponse, request_parameters
from backend.api.provenance import latents_sha256
from backend.api.request import Controls, SessionRequest
from client.recording import Recording, RecordingError
from client.steer import SteeredSession
from client.connection import Connection, connection_of
from client.stream import CAPACITY_RETRIES, StreamError, StreamingSession, add_server_args, request_inputs, show_place
from client.video import DEFAULT_FPS, Mp4Writer


@dataclass(frozen=True)
class BlockCheck:
    index: int
    recorded: str
    replayed: str | None  # None: the block did not come back

    @property
    def same(self) -> bool:
        return self.recorded == self.replayed


def base_request(recording: Recording, decode: bool, **kinds: object) -> SessionRequest:
    return SessionRequest(
        image=recording.image, prompt=recording.prompt, seed=recording.seed, height=recording.height,
        width=recording.width, intrinsics=recording.intrinsics, decode=decode, return_latents=False,
        return_used=True, expect_settings=recording.settings, **kinds,
    )


def whole_request(recording: Recording, decode: bool) -> SessionRequest:
    """The recording as one whole trajectory; a recording with prompt events needs --steps (one prompt here)."""
    if recording.events:
        raise RecordingError(f"prompt events at block(s) {sorted(recording.events)}: a whole trajectory takes one "
                             f"prompt; replay it with --steps")
    poses = np.concatenate([b.camera for b in recording.blocks])
    return base_request(recording, decode, poses=poses, num_frames=len(poses), pose_scale="running")


def replay_whole(recording: Recording, url: str, model: str, decode: bool, timeout: float,
                 connection: Connection = Connection()) -> list[BlockResponse]:
    request = whole_request(recording, decode)
    with StreamingSession(url, model_name=model, on_place=lambda p: print(show_place(p), flush=True),
                          capacity_retries=CAPACITY_RETRIES, connection=connection) as session:
        session.send(request_inputs(request), request_id="replay", parameters=request_parameters(request))
        return list(session.responses(timeout))


def replay_steps(recording: Recording, url: str, model: str, decode: bool, timeout: float,
                 connection: Connection = Connection()) -> list[BlockResponse]:
    """A steered session again: the first request with block 0's poses, then one step per block (lookahead 1),
    each with its recorded poses and prompt event; on_starve=wait, so no block is held this time."""
    blocks = recording.blocks
    steps = [Controls(poses=b.camera, prompt=b.event, recache=b.recache) for b in blocks[1:]]
    received: list[BlockResponse] = []
    with SteeredSession(url, model_name=model, on_place=lambda p: print(show_place(p), flush=True),
                        connection=connection) as session:
        session.start(base_request(recording, decode, poses=blocks[0].camera, num_frames=None))
        sent = 0
        for _ in blocks:
            if sent < len(steps):
                session.step(steps[sent], end=sent == len(steps) - 1)
                sent += 1
            block = session.next_block(timeout)
            if block is None:
                raise StreamError(f"the session ended after {len(received)} of {len(blocks)} blocks")
            received.append(block)
        if not steps:  # one block: close the session (its answer is an empty final response)
            session.end()
            session.next_block(timeout)
    return received


def replay_from_snapshot(recording: Recording, snapshot_id: str, url: str, model: str, timeout: float,
                         connection: Connection = Connection()) -> list[BlockResponse]:
    """The recorded blocks after a noted snapshot, as a steered session resumed from it (lookahead 1)."""
    after = recording.snapshots.get(snapshot_id)
    if after is None:
        raise RecordingError(f"the recording notes no snapshot {snapshot_id} (it notes "
                             f"{sorted(recording.snapshots) or 'none'})")
    steps = [Controls(poses=b.camera, prompt=b.event, recache=b.recache) for b in recording.blocks[after + 1:]]
    if not steps:
        raise RecordingError(f"snapshot {snapshot_id} follows the recording's last block: nothing to replay")
    received: list[BlockResponse] = []
    with SteeredSession(url, model_name=model, connection=connection) as session:
        session.resume(snapshot_id, steps[0], return_latents=False, return_used=True)
        for i in range(len(steps)):
            if i + 1 < len(steps):
                session.step(steps[i + 1], end=i + 2 == len(steps))
            block = session.next_block(timeout)
            if block is None:
                raise StreamError(f"the session ended after {len(received)} of {len(steps)} blocks")
            received.append(block)
        if len(steps) == 1:
            session.end()
            session.next_block(timeout)
    return received


def check_blocks(recording: Recording, blocks: list[BlockResponse], first: int = 0) -> list[BlockCheck]:
    """Each recorded block from `first` on against what came back (the server's hash, checked against the latents
    if sent)."""
    checks = []
    for i, recorded in enumerate(recording.blocks[first:], start=first):
        block = blocks[i - first] if i - first < len(blocks) else None
        replayed = block.used.latents_sha256 if block is not None and block.used is not None else None
        if block is not None and block.latents is not None and replayed != latents_sha256(block.latents):
            raise StreamError(f"block {i}: the server's latents_sha256 does not match the latents it sent")
        checks.append(BlockCheck(i, recorded.latents_sha256, replayed))
    return checks


def table(recording: Recording, checks: list[BlockCheck]) -> str:
    lines = [f"{'block':>5}  {'frames':>6}  {'held':>4}  {'recorded':<16}  {'replayed':<16}  same  event"]
    for check in checks:
        block = recording.blocks[check.index]
        lines.append(f"{check.index:>5}  {len(block.camera):>6}  {'yes' if block.held else '-':>4}  "
                     f"{check.recorded[:16]:<16}  {(check.replayed or 'missing')[:16]:<16}  "
                     f"{'yes' if check.same else 'NO':<4}  {block.event or ''}{' (recache)' if block.recache else ''}")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m client replay", description=__doc__.split("\n\n")[0])
    p.add_argument("recording", help="a recording from `python -m client play --record` or the page")
    add_server_args(p)
    p.add_argument("--steps", action="store_true", help="replay step by step as a steered session")
    p.add_argument("--from-snapshot", metavar="ID", help="resume this snapshot (one the recording notes) and replay "
                   "only the blocks after it, step by step")
    p.add_argument("--out", help="also decode and write the replayed video here (MP4)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds for the whole trajectory, or for each block with --steps (default: %(default)s)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        recording = Recording.load(args.recording)
        first = 0 if args.from_snapshot is None else recording.snapshots.get(args.from_snapshot, -1) + 1
        if args.from_snapshot is not None and not 0 < first < len(recording.blocks):
            raise RecordingError(f"the recording notes no snapshot {args.from_snapshot} with blocks after it "
                                 f"(it notes {recording.snapshots or 'none'})")
        if not args.steps and args.from_snapshot is None:
            whole_request(recording, decode=False)  # refuse a whole replay of prompt events before connecting
    except RecordingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    kind = f"from snapshot {args.from_snapshot} (blocks {first} on)" if args.from_snapshot else \
        "step by step" if args.steps else "as one whole trajectory"
    print(f"replaying {args.recording} ({len(recording.blocks)} blocks, {recording.settings}) {kind} at {args.url}")
    try:
        connection = connection_of(args)
        if args.from_snapshot is not None:
            blocks = replay_from_snapshot(recording, args.from_snapshot, args.url, args.model, args.timeout,
                                          connection)
        else:
            replay = replay_steps if args.steps else replay_whole
            blocks = replay(recording, args.url, args.model, args.out is not None, args.timeout, connection)
        checks = check_blocks(recording, blocks, first)
        with Mp4Writer(args.out, DEFAULT_FPS) if args.out else contextlib.nullcontext() as mp4:
            for block in blocks if mp4 is not None else ():
                mp4.append(block.frames)
    except (StreamError, ValueError, OSError) as exc:  # a server's refusal, a bad --client-cert or --key-file
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(table(recording, checks))
    same = sum(c.same for c in checks)
    print(f"latents bit-identical to the recording: {same} of {len(checks)} blocks"
          + ("" if same == len(checks) else f" (differ: {[c.index for c in checks if not c.same]})"))
    if args.out:
        print(f"video: {args.out}")
    return 0 if same == len(checks) else 1
