"""`python -m client play`: steer a session block by block from a key script, writing the MP4 as blocks arrive.

    python -m client play --prompt "a castle" --keys "w*6,wa*2,j*3" --out out/play.mp4

Each step of the script is one block (see backend/api/controls.py for the keys and step sizes); an entry
"@text" is a world event: the prompt is "text" from the next block on ("w*6,@it starts to snow,w*4"); "@!text"
also recomputes the cached frames under it, so the old prompt does not linger (request parameter recache). The client
keeps `--lookahead` steps in flight, so the server has the next block's camera while the current one streams.
Per block it prints the step latency (request sent to block received) and the real-time factor: seconds of
video at 16 fps delivered per second since the first block (>= 1 keeps up with playback). With --record FILE
it also writes what the server ran (held blocks' cameras included) for `python -m client replay FILE`.
"""
from __future__ import annotations

import argparse
import statistics
import sys

from backend.api import contract
from backend.api.controls import parse_play_script
from backend.api.errors import InputError
from backend.api.request import SessionRequest
from client.images import load_image, synthetic_image
from client.pace import DeliveryRate
from client.recording import Recorder, RecordingError
from client.steer import SteeredSession
from client.connection import connection_of
from client.stream import StreamError, add_server_args, fill_size, show_place
from client.used_steps import UsedSteps
from client.video import DEFAULT_FPS, ContactSheet, Mp4Writer


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m client play", description=__doc__.split("\n\n")[0])
    add_server_args(p)
    p.add_argument("--prompt", required=True, help="text prompt")
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
                   help="seconds to wait for any one block (default: %(default)s)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        fill_size(args)
    except (StreamError, ValueError, OSError) as exc:  # a server error, a bad --client-cert or --key-file
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        steps = parse_play_script(args.keys)
        image = load_image(args.image) if args.image else synthetic_image(args.height, args.width)
    except (InputError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # return_used: each block is labelled with what the server ran it on (its prompt_used, its held flag)
    request = SessionRequest(image=image, prompt=args.prompt, poses=None, num_frames=None, seed=args.seed,
                             height=args.height, width=args.width, keys=steps[0].keys, on_starve=args.on_starve,
                             return_used=True)
    recorder = Recorder(request) if args.record else None
    sheet = ContactSheet() if args.contact_sheet else None
    latencies: list[float] = []
    rate = DeliveryRate(DEFAULT_FPS)
    try:
        with SteeredSession(args.url, model_name=args.model, on_place=lambda p: print(show_place(p), flush=True),
                            connection=connection_of(args)) as session, Mp4Writer(args.out, DEFAULT_FPS) as mp4:
            session.start(request)
            used = UsedSteps(steps[0], args.prompt)
            sent = 1
            for received in range(len(steps)):
                while sent < len(steps) and sent - received <= args.lookahead:
                    session.step(steps[sent], end=sent == len(steps) - 1)
                    used.sent(steps[sent])
                    sent += 1
                block = session.next_block(args.timeout)
                latency = block.arrival_s - session.sent_s[received]
                latencies.append(latency)
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
                      f"step latency {latency * 1000:.0f} ms, real-time factor {rtf}"
                      f"{', HELD (step late: the last motion repeated)' if block.held else ''}{event}", flush=True)
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
    if sheet is not None:
        sheet.save(args.contact_sheet)
        print(f"contact sheet: {args.contact_sheet}")
    if recorder is not None:
        recorder.save(args.record)
        print(f"recording: {args.record} ({len(recorder.recording.blocks)} blocks; replay: python -m client replay "
              f"{args.record})")
    return 0


def save_partial(recorder: Recorder | None, path: str | None) -> None:
    """Keep the blocks recorded before a failure or an interrupt (a bug report's evidence)."""
    if recorder is not None and recorder.save(path) is not None:
        print(f"partial recording kept: {path} ({len(recorder.recording.blocks)} blocks)", file=sys.stderr)
