"""`python -m client play`: steer a session block by block from a key script, writing the MP4 as blocks arrive.

    python -m client play --prompt "a castle" --keys "w*6,wa*2,j*3" --out out/play.mp4

Each step of the script is one block (see backend/api/controls.py for the keys and step sizes); an entry
"@text" is a prompt event: the prompt is "text" from the next block on ("w*6,@it starts to snow,w*4"); "@!text"
also recomputes the cached frames under it, so the old prompt does not linger (request parameter recache). The client
keeps `--lookahead` steps in flight, so the server has the next block's camera while the current one streams.
Per block it prints the step latency (request sent to block received) and the real-time factor: seconds of
video at 16 fps delivered per second since the first block (>= 1 keeps up with playback). With --record FILE
it also writes what the server ran (held blocks' cameras included) for `python -m client replay FILE`.

The world survives its server (client/world.py): it is saved every --save-every blocks (each snapshot's id is
printed once durable, and noted in the recording; each periodic save releases the one two before it, which is
printed and dropped from the recording, so a world keeps at most three), and when the stream fails the client
resumes it from the last snapshot through the same --url and makes the blocks since again, printing "server lost,
resuming at block K" and then how long it took. `--resume ID` plays on from a saved world (the key script's first
entry is its next block).
"""
from __future__ import annotations

import argparse
import statistics
import sys

from backend.api import contract
from backend.api.controls import parse_play_script
from backend.api.errors import InputError
from backend.api.request import SessionRequest, check_snapshot_id
from client.images import load_image, synthetic_image
from client.pace import DeliveryRate
from client.recording import Recorder, RecordingError
from client.connection import connection_of
from client.stream import StreamError, add_server_args, fill_size, show_place
from client.used_steps import UsedSteps
from client.video import DEFAULT_FPS, ContactSheet, Mp4Writer
from client.world import DEFAULT_SAVE_EVERY, Failover, PlayedWorld, Saved


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m client play", description=__doc__.split("\n\n")[0])
    add_server_args(p)
    p.add_argument("--prompt", help="text prompt (required unless --resume)")
    p.add_argument("--image", help="first frame (JPEG/PNG); default: a generated test scene")
    p.add_argument("--keys", default="w*6",
                   help='key script, e.g. "w*6,wa*2,@it starts to snow,j*3" (default: %(default)s)')
    p.add_argument("--height", type=int, help="(default: the server's default_height, else 480)")
    p.add_argument("--width", type=int, help="(default: the server's default_width, else 832)")
    p.add_argument("--seed", type=int, default=42, help="(default: %(default)s)")
    p.add_argument("--on-starve", choices=contract.ON_STARVE, default=contract.ON_STARVE[0],
                   help="when a step is late: the server waits, or holds the last motion (default: %(default)s)")
    p.add_argument("--lookahead", type=int, default=1,
                   help="steps sent ahead of the block on screen (default: %(default)s)")
    p.add_argument("--out", default="out/play.mp4", help="MP4 written as blocks arrive (default: %(default)s)")
    p.add_argument("--contact-sheet", help="also write a PNG grid of every 8th frame, world-event blocks framed")
    p.add_argument("--record", help="also write the session's recording here (.npz), for `python -m client replay`")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for any one block before a block time is measured (default: %(default)s)")
    p.add_argument("--save-every", type=int, default=DEFAULT_SAVE_EVERY, metavar="N",
                   help="save the world every N blocks, to resume it when the server is lost (0: never; default: "
                        "%(default)s, docs/worlds.md)")
    p.add_argument("--resume", metavar="ID", help="play on from a saved world (a snapshot id printed by play or the "
                   "page): its prompt, image and size are the snapshot's")
    p.add_argument("--fork-seed", type=int, help="with --resume: new noise from the resumed block on (a fork)")
    args = p.parse_args(argv)
    if args.resume is None and args.prompt is None:
        p.error("--prompt is required (unless --resume)")
    if args.resume is not None and (args.prompt or args.image or args.record):
        p.error("--resume plays on the snapshot's prompt and image, unrecorded: drop --prompt, --image, --record")
    if args.fork_seed is not None and (args.resume is None or args.fork_seed < 0):
        p.error("--fork-seed goes with --resume and is 0 or more")
    if args.save_every < 0:
        p.error("--save-every is 0 or more")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        fill_size(args)
    except (StreamError, ValueError, OSError) as exc:  # a server error, a bad --client-cert or --key-file
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        steps = parse_play_script(args.keys, resumed=args.resume is not None)
        image = load_image(args.image) if args.image else synthetic_image(args.height, args.width)
        if args.resume is not None:
            check_snapshot_id(args.resume)
    except (InputError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # return_used: each block is labelled with what the server ran it on (its prompt_used, its held flag)
    request = SessionRequest(image=image, prompt=args.prompt or "", poses=None, num_frames=None, seed=args.seed,
                             height=args.height, width=args.width, keys=steps[0].keys, on_starve=args.on_starve,
                             return_used=True)
    recorder = Recorder(request) if args.record else None
    try:
        with PlayedWorld(args.url, model_name=args.model, connection=connection_of(args), save_every=args.save_every,
                         on_place=lambda p: print(show_place(p), flush=True),
                         on_snapshot=lambda saved: show_saved(saved, recorder),
                         on_failover=show_failover) as world, Mp4Writer(args.out, DEFAULT_FPS) as mp4:
            if args.resume is None:
                world.start(request)
            else:
                world.resume(args.resume, steps[0], args.fork_seed)
            latencies = play_steps(args, world, steps, mp4, recorder)
            world.finish(args.timeout)  # every save's outcome told
    except (StreamError, RecordingError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        save_partial(recorder, args.record)
        return 1
    except KeyboardInterrupt:
        print("interrupted: session cancelled", file=sys.stderr)
        save_partial(recorder, args.record)
        return 130
    later = latencies[1:] or latencies
    print(f"time to first block: {latencies[0]:.2f} s; mean step latency {statistics.fmean(later):.2f} s")
    print(f"video: {args.out} ({mp4.frames_written} frames)")
    if recorder is not None:
        recorder.save(args.record)
        print(f"recording: {args.record} ({len(recorder.recording.blocks)} blocks; replay: python -m client replay "
              f"{args.record})")
    return 0


def play_steps(args: argparse.Namespace, world: PlayedWorld, steps: list, mp4: Mp4Writer,
               recorder: Recorder | None) -> list[float]:
    """Send the key script `--lookahead` steps ahead, print and write each block; the step latencies."""
    sheet = ContactSheet() if args.contact_sheet else None
    latencies: list[float] = []
    rate = DeliveryRate(DEFAULT_FPS)
    used = UsedSteps(steps[0], args.prompt)
    sent = 1
    for _ in range(len(steps)):
        while sent < len(steps) and sent - len(latencies) <= args.lookahead:
            world.step(steps[sent], end=sent == len(steps) - 1)
            used.sent(steps[sent])
            sent += 1
        block = world.next_block(args.timeout)
        if block is None:
            raise StreamError(f"the session ended after {len(latencies)} of {len(steps)} blocks")
        latencies.append(world.step_latency_s)
        mp4.append(block.frames)
        if recorder is not None:
            recorder.add(block)
        label = used.label(block)
        if sheet is not None:
            sheet.add(block.frames, block.block_index, event=label.event)
        factor = rate.add(len(block.frames), block.arrival_s)
        rtf = "n/a" if factor is None else f"{factor:.2f}x"
        event = "" if not label.event else \
            f", prompt now {label.prompt!r}{' (cache recomputed)' if block.used.recached else ''}"
        print(f"block {block.block_index}: keys {label.keys!r:6} {len(block.frames)} frames, "
              f"step latency {latencies[-1] * 1000:.0f} ms, real-time factor {rtf}"
              f"{', HELD (step late: the last motion repeated)' if block.held else ''}{event}", flush=True)
    if sheet is not None:
        sheet.save(args.contact_sheet)
        print(f"contact sheet: {args.contact_sheet}")
    return latencies


def show_saved(saved: Saved, recorder: Recorder | None) -> None:
    if saved.error is not None:
        print(f"save {'after block ' + str(saved.block_index) if saved.block_index is not None else 'refused'}: "
              f"{saved.error}", flush=True)
        return
    print(f"snapshot {saved.snapshot_id} after block {saved.block_index}: durable (play on from it: --resume "
          f"{saved.snapshot_id})", flush=True)
    if saved.released:
        print(f"snapshot {saved.released} released: the world keeps the newer ones", flush=True)
    if recorder is not None:
        recorder.note_snapshot(saved.snapshot_id, saved.block_index, saved.released)


def show_failover(failover: Failover) -> None:
    where = "its first block" if failover.resume_block is None else f"block {failover.resume_block}"
    source = f"snapshot {failover.snapshot_id}" if failover.snapshot_id else "its first request"
    if failover.took_s is None:
        print(f"server lost, resuming at {where} from {source} ({failover.reason}): {failover.replayed} block(s) "
              f"to make again, {failover.resent} step(s) to send again", flush=True)
    else:
        exact = "bit for bit" if not failover.differed else \
            f"{failover.differed} not bit for bit: batched otherwise than before, docs/fidelity.md"
        print(f"resumed at {where} in {failover.took_s:.2f} s ({failover.attempts} attempt(s); {failover.replayed} "
              f"block(s) made again, {exact})", flush=True)


def save_partial(recorder: Recorder | None, path: str | None) -> None:
    """Keep the blocks recorded before a failure or an interrupt (a bug report's evidence)."""
    if recorder is not None and recorder.save(path) is not None:
        print(f"partial recording kept: {path} ({len(recorder.recording.blocks)} blocks)", file=sys.stderr)
