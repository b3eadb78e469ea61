"""Command line: stream one camera-controlled generation and write the MP4 as blocks arrive.

    python -m client --prompt "a sunny street" --camera forward --out out/session.mp4
    python -m client play --prompt "a sunny street" --keys "w*6,wa*2,j*3"   (a steered session)
    python -m client serve --url localhost:8001 --port 8080                  (the browser player)
    python -m client replay out/world.npz                                    (a recording, checked bit for bit)
    python -m client saves --key-file alice.key                              (your key's snapshots)
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np

from backend.api import contract
from backend.api.codec import BlockResponse, Place
from backend.api.description import DEFAULT_VIDEO_FRAMES, ServerDescription
from backend.api.request import DEFAULT_HFOV_DEG, default_intrinsics
from client.action import load_action_dir
from client.camera import PRESETS, camera_preset
from client.images import load_image, synthetic_image
from client.connection import connection_of
from client.stream import (CAPACITY_RETRIES, StreamError, StreamingSession, add_server_args, build_inputs, fill_size,
                           show_place)
from client.video import DEFAULT_FPS, ContactSheet, Mp4Writer

EXIT_STREAM_ERROR = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m client",
        description="Stream one camera-controlled generation from Triton, writing the MP4 as blocks arrive.",
        epilog="other commands:\n"
               "  python -m client play ...   a steered session from a key script (play --help)\n"
               "  python -m client serve ...  the browser player (serve --help)\n"
               "  python -m client replay ... a recorded world, checked bit for bit (replay --help)\n"
               "  python -m client saves ...  your key's snapshots, and sharing one (saves --help)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_server_args(p)
    p.add_argument("--prompt", required=True, help="text prompt")
    p.add_argument("--image", help="first frame (JPEG/PNG); default: a generated test scene")
    p.add_argument("--camera", choices=PRESETS, help="camera preset (default: forward)")
    p.add_argument("--action-dir", help="LingBot-World action dir: image.jpg, poses.npy, intrinsics.npy")
    p.add_argument("--hfov", type=float, default=DEFAULT_HFOV_DEG, help="preset horizontal FOV in degrees (default: %(default)s)")
    p.add_argument("--num-frames", type=int,
                   help=f"video frames, whole AR blocks: {contract.frames_rule()} on a server of 3 latent frames a "
                        f"block (default: the most whole blocks up to {DEFAULT_VIDEO_FRAMES}, 81 or 77 on 4)")
    p.add_argument("--block-frames", type=int,
                   help=f"the server's latent frames per AR block: {contract.BLOCK_FRAMES} for the diffusers download, 4 "
                        f"(13 + 16 x k frames) for the official one (default: what the server says of itself)")
    p.add_argument("--height", type=int, help="(default: the server's default_height, else 480)")
    p.add_argument("--width", type=int, help="(default: the server's default_width, else 832)")
    p.add_argument("--seed", type=int, default=42, help="(default: %(default)s)")
    p.add_argument("--out", default="out/session.mp4", help="MP4 written as blocks arrive (default: %(default)s)")
    p.add_argument("--fps", type=float, default=DEFAULT_FPS, help="MP4 frame rate (default: %(default)s)")
    p.add_argument("--contact-sheet", help="also write a PNG grid of every --sheet-every-th frame")
    p.add_argument("--sheet-every", type=int, default=8, help="contact sheet frame stride (default: %(default)s)")
    p.add_argument("--no-decode", action="store_true", help="skip the server's VAE decode (no MP4)")
    p.add_argument("--save-latents", help="request the latents and save them as one .npy [C, T, h, w]")
    p.add_argument("--timeout", type=float, help="give up (and cancel) after this many seconds")
    args = p.parse_args(argv)
    if args.action_dir and (args.image or args.camera):
        p.error("--action-dir brings its own image and camera; drop --image/--camera")
    if args.no_decode and args.contact_sheet:
        p.error("--contact-sheet needs decoded frames; drop --no-decode")
    return args


def print_place(place: Place) -> None:
    print(f"\n{show_place(place)}", flush=True)


def fill_from_server(args: argparse.Namespace) -> None:
    """--block-frames, --num-frames, --height and --width the user left out, from what the server says of itself
    (its block size: neither checkpoint layout needs a flag); a server that says nothing gets the diffusers
    layout's."""
    described = fill_size(args, more=args.block_frames is None or args.num_frames is None)
    if args.block_frames is None:
        args.block_frames = described.block_frames if described else contract.BLOCK_FRAMES
    if args.num_frames is None:
        args.num_frames = ServerDescription.whole_frames_up_to(DEFAULT_VIDEO_FRAMES, args.block_frames)


def request_arrays(args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(image, poses, intrinsics) from the action dir, or the image/preset options."""
    if args.action_dir:
        action = load_action_dir(args.action_dir, args.num_frames, args.height, args.width)
        return action.image, action.poses, action.intrinsics
    image = load_image(args.image) if args.image else synthetic_image(args.height, args.width)
    poses = camera_preset(args.camera or "forward", args.num_frames)
    return image, poses, default_intrinsics(args.num_frames, args.height, args.width, args.hfov)


@dataclass
class Progress:
    """One progress line per block: redrawn in place on a TTY, appended otherwise."""

    out: TextIO
    sent_s: float
    frames: int = 0
    arrivals: list[float] = field(default_factory=list)
    timings: list[tuple[float, ...]] = field(default_factory=list)

    def update(self, block: BlockResponse) -> None:
        self.frames += len(block.frames)
        previous = self.arrivals[-1] if self.arrivals else None
        self.arrivals.append(block.arrival_s)
        self.timings.append(block.timing_ms)
        done = block.block_index + 1
        filled = round(24 * done / max(block.num_blocks, 1))
        latency = (f"first block {block.arrival_s - self.sent_s:6.2f}s" if previous is None
                   else f"+{block.arrival_s - previous:5.2f}s after previous")
        server = ""
        if len(block.timing_ms) >= 2:
            server = f"  dit {block.timing_ms[0]:6.0f}ms vae {block.timing_ms[1]:5.0f}ms"
        line = (f"[{'#' * filled}{'.' * (24 - filled)}] block {done:>3}/{block.num_blocks}"
                f"  frames {self.frames:>4}  {latency}{server}")
        if self.out.isatty():
            end = "\n" if done >= block.num_blocks else ""
            self.out.write(f"\r{line}\x1b[K{end}")
        else:
            self.out.write(line + "\n")
        self.out.flush()

    def summary(self, fps: float) -> str:
        if not self.arrivals:
            return "no blocks received"
        elapsed = self.arrivals[-1] - self.sent_s
        lines = [f"done: {len(self.arrivals)} blocks, {self.frames} frames in {elapsed:.2f} s",
                 f"  time to first block: {self.arrivals[0] - self.sent_s:.2f} s"]
        gaps = [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]
        if gaps:
            lines.append(f"  inter-block latency: mean {statistics.fmean(gaps):.2f} s, "
                         f"min {min(gaps):.2f} s, max {max(gaps):.2f} s")
        if all(len(t) >= 2 for t in self.timings):
            lines.append(f"  server per block: DiT mean {statistics.fmean(t[0] for t in self.timings):.0f} ms, "
                         f"VAE mean {statistics.fmean(t[1] for t in self.timings):.0f} ms")
        if self.frames and elapsed > 0:
            lines.append(f"  real-time factor: {self.frames / fps / elapsed:.2f}x at {fps:g} fps")
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["play"]:  # a steered session (client/play.py)
        from client.play import main as play

        return play(argv[1:])
    if argv[:1] == ["serve"]:  # the browser player (client/web/)
        from client.web.serve import main as serve

        return serve(argv[1:])
    if argv[:1] == ["replay"]:  # a recording (client/replay.py)
        from client.replay import main as replay

        return replay(argv[1:])
    if argv[:1] == ["saves"]:  # the key's snapshots (client/saves.py)
        from client.saves import main as saves

        return saves(argv[1:])
    args = parse_args(argv)
    try:
        fill_from_server(args)
    except (StreamError, ValueError, OSError) as exc:  # a server error, a bad --client-cert or --key-file
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_STREAM_ERROR
    try:
        image, poses, intrinsics = request_arrays(args)
        inputs = build_inputs(image, args.prompt, poses, intrinsics, num_frames=args.num_frames,
                              seed=args.seed, height=args.height, width=args.width, block_frames=args.block_frames)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    parameters = {contract.PARAM_DECODE: not args.no_decode,
                  contract.PARAM_RETURN_LATENTS: args.save_latents is not None}
    request_id = f"cli-{uuid.uuid4().hex[:8]}"
    sheet = ContactSheet(every=args.sheet_every) if args.contact_sheet else None
    latents: list[np.ndarray] = []
    writer = None if args.no_decode else Mp4Writer(args.out, fps=args.fps)
    progress: Progress | None = None
    print(f"request {request_id}: {args.num_frames} frames at {args.height}x{args.width} from {args.url}")
    try:
        with StreamingSession(args.url, model_name=args.model, on_place=print_place,
                              capacity_retries=CAPACITY_RETRIES, connection=connection_of(args)) as session, \
                (writer or contextlib.nullcontext()):
            progress = Progress(sys.stdout, session.send(inputs, request_id=request_id, parameters=parameters))
            for block in session.responses(args.timeout):
                if writer is not None:
                    writer.append(block.frames)
                if sheet is not None:
                    sheet.add(block.frames, block.block_index)
                if block.latents is not None and args.save_latents:
                    latents.append(block.latents)
                progress.update(block)
    except (StreamError, OSError, ValueError) as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        if writer is not None and writer.frames_written:
            print(f"partial video kept: {writer.path} ({writer.frames_written} frames)", file=sys.stderr)
        return EXIT_STREAM_ERROR
    except KeyboardInterrupt:
        print("\ninterrupted: request cancelled", file=sys.stderr)
        return EXIT_INTERRUPTED
    assert progress is not None  # set once send() succeeded
    print(progress.summary(args.fps))
    try:
        return write_extras(args, writer, sheet, latents)
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_STREAM_ERROR


def write_extras(args: argparse.Namespace, writer: Mp4Writer | None, sheet: ContactSheet | None,
                 latents: list[np.ndarray]) -> int:
    """Report the video; write the contact sheet and latents collected during the stream."""
    if writer is not None:
        print(f"  video: {writer.path} ({writer.frames_written} frames)" if writer.frames_written
              else "  video: not written, the server sent no decoded frames")
    if sheet is not None and sheet.frames_seen:
        sheet.save(args.contact_sheet)
        print(f"  contact sheet: {args.contact_sheet}")
    if args.save_latents:
        if not latents:
            print("error: the server sent no latents to save", file=sys.stderr)
            return EXIT_STREAM_ERROR
        path = Path(args.save_latents)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, np.concatenate(latents, axis=1))
        print(f"  latents: {path}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
