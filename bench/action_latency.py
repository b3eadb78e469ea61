"""Action-to-frame latency: from a key change at the client to the first frame that shows it, at lookahead 0, 1, 2,
through `python -m client play` and through the browser page (`python -m client serve`, real headless Chromium).

    python -m bench.action_latency [--lookahead 0 1 2] [--paths play page webrtc] [--changes 4] [--url HOST:PORT]

Against a real tritonserver on the tiny checkpoint (SP1, CPU; --url: an existing server). "Shows it": the first
block whose camera, as the server reports it used (camera_used, kept in the session's recording), moves with the
changed key; keys alternate between W and J, so every change presses a key the blocks before it did not hold.

* play: `python -m client play --lookahead L --record FILE` in its own process, a key script alternating W and J
  every L + 3 blocks. Each block's line on play's stdout is stamped as it arrives: that block is shown. play reads
  a step's keys when it sends the step, right after writing block k - L - 1 (steady state); so the key change is
  that moment, and the block shown at it is k - L - 1. A cross-check compares the stamped interval with play's own
  step latency (its send to its block's arrival).
* page: the bridge with `--lookahead L`, the page in Chromium over JPEG (its WebRTC turned off, as a browser
  without it), with a trace script added before the page's own (no change to the page): the page's clock stamps
  each keydown, each block header and each frame drawn on the canvas. The frames play from a queue at 16 fps, in
  order, skipping the oldest when the page falls behind (its status counts them in data-skipped), so a draw shows
  frame (draws before it + frames skipped by then); at each keydown it also reads the length of the page's queue.
  Every L + 3 blocks a key is pressed at a random moment within a block interval after a block arrives; the block
  shown then is the one whose frame was drawn last. The server's camera_used comes from the page session's
  recording.
* webrtc: the same page over WebRTC. The trace stamps each video frame when the browser expects to show it
  (requestVideoFrameCallback's expectedDisplayTime, with the frame's RTP timestamp) and each "on_air" message of
  the data channel (a block's first frame went out, with its pts); a frame's RTP timestamp is the stream's origin
  plus its pts (`on_screen` finds the origin), so block k is on screen from the first frame at or after
  origin + pts(k).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from backend.api.contract import MODEL_NAME
from backend.api.controls import frame_motion, parse_keys
from backend.launch.paths import REPO_ROOT
from backend.parallel.ports import free_port
from bench.common import PROMPT, TINY, add_checkpoint_args, ensure_checkpoint, format_table
from client.recording import Recording
from client.video import DEFAULT_FPS

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
CHANGE_KEYS = ("j", "w")  # each change presses one of these and releases the other; the session starts on W
WARMUP_BLOCKS = 5  # blocks on W before the first change: the KV window fills and the condition encode settles
BLOCK_LINE = re.compile(r"block (\d+): .*step latency (\d+) ms")
BOUND_S = 120.0  # any one wait for the server, the bridge or the page

# Added to the page before its own script: stamps keydowns, block headers and canvas draws with the page's clock.
TRACE_JS = """(() => {
  const trace = {keys: [], blocks: [], draws: []};
  window.__latency = trace;
  const skipped = () => Number(document.getElementById("status").dataset.skipped || 0);
  // at a keydown, also the page's own frame queue (its global `queue`: frames decoding or decoded, not yet drawn)
  document.addEventListener("keydown", (e) => trace.keys.push({key: e.key.toLowerCase(), t: performance.now(),
                                                               queued: queue.length}), true);
  const draw = CanvasRenderingContext2D.prototype.drawImage;
  CanvasRenderingContext2D.prototype.drawImage = function (...args) {
    trace.draws.push({t: performance.now(), frame: trace.draws.length + skipped()});
    return draw.apply(this, args);
  };
  window.WebSocket = class extends window.WebSocket {
    constructor(...args) {
      super(...args);
      this.addEventListener("message", (e) => {
        if (typeof e.data !== "string") return;
        const m = JSON.parse(e.data);
        if (m.type === "block") trace.blocks.push({index: m.index, frames: m.frames, keys: m.keys, t: performance.now()});
      });
    }
  };
  // WebRTC: each video frame as the browser expects to show it, and each block's first frame going out
  trace.frames = [];
  trace.onAir = [];
  document.addEventListener("DOMContentLoaded", () => {
    const video = document.getElementById("video");
    const frame = (now, meta) => {
      trace.frames.push({t: meta.expectedDisplayTime, rtp: meta.rtpTimestamp});
      video.requestVideoFrameCallback(frame);
    };
    video.requestVideoFrameCallback(frame);
  });
  const open = RTCPeerConnection.prototype.createDataChannel;
  RTCPeerConnection.prototype.createDataChannel = function (...args) {
    const channel = open.apply(this, args);
    channel.addEventListener("message", (e) => {
      const m = JSON.parse(e.data);
      if (m.type === "on_air") trace.onAir.push({block: m.block, pts: m.pts, t: performance.now()});
    });
    return channel;
  };
})();"""
NO_WEBRTC_JS = "delete window.RTCPeerConnection;"  # the page as a browser without WebRTC: JPEG on its websocket
RTP_WRAP = 1 << 32


# ---------------------------------------------------------------- the measurement (no server)


@dataclass(frozen=True)
class KeyChange:
    t: float  # seconds, on the clock of the Shown events
    key: str  # the key pressed


@dataclass(frozen=True)
class Shown:
    block: int
    t: float  # the block's first frame is on screen from here
    arrived: float  # the block reached the client (play: t; the page: its header, before the frame queue)


@dataclass(frozen=True)
class ChangeLatency:
    change: KeyChange
    shown_block: int  # on screen when the key changed
    first_block: int | None  # the first block after it that moves with the key (None: none in the session)
    wall_s: float | None  # key change to that block's first frame

    @property
    def blocks_later(self) -> int | None:
        return None if self.first_block is None else self.first_block - self.shown_block


def measure(changes: Sequence[KeyChange], shown: Sequence[Shown], used: Mapping[int, str | None]) -> list[ChangeLatency]:
    """Each change's latency: `shown` in display order, `used` the keys each block ran on (None: not keys). A block
    that had reached the client before the change cannot show it, however late it is drawn (a frame queue)."""
    out = []
    for change in changes:
        before = [s for s in shown if s.t <= change.t]
        if not before:
            raise ValueError(f"a key change at {change.t:.3f} s, before the first frame was shown")
        at = before[-1].block
        first = next((s for s in shown if s.block > at and s.arrived > change.t
                      and change.key in (used.get(s.block) or "")), None)
        out.append(ChangeLatency(change, at, None if first is None else first.block,
                                 None if first is None else first.t - change.t))
    return out


def keys_of_camera(camera: np.ndarray) -> str | None:
    """The held keys whose motion made these poses (float32 [n, 4, 4], n >= 2), or None if no keys did (opposite
    keys cancel: "ad" reads as "")."""
    poses = camera.astype(np.float64)
    motions = np.linalg.inv(poses[:-1]) @ poses[1:]
    m, eps = motions[0], 1e-6
    axes = ((m[2, 3], "w", "s"), (m[0, 3], "d", "a"), (m[0, 2], "l", "j"), (m[2, 1], "i", "k"))
    keys = parse_keys("".join(plus if v > eps else minus if v < -eps else "" for v, plus, minus in axes) or "-")
    return keys if np.allclose(motions, frame_motion(keys), atol=1e-4) else None


def used_keys(recording: Recording) -> dict[int, str | None]:
    """Block index -> the keys the server ran it on (its camera_used, as recorded)."""
    return {i: keys_of_camera(block.camera) for i, block in enumerate(recording.blocks)}


# ---------------------------------------------------------------- one path, one lookahead


@dataclass
class Run:
    path: str
    lookahead: int
    latencies: list[ChangeLatency]
    block_s: list[float]  # intervals between block arrivals after the warm-up
    queued: list[int]  # page: frames in the page's queue at each change (received, neither drawn nor skipped)
    arrival_s: list[float]  # page: each change to its first block's header reaching the page (before the queue)
    note: str = ""
    skipped: int | None = None  # page: frames the page skipped to keep up, of `frames`
    frames: int = 0


def segment_blocks(lookahead: int) -> int:
    """Blocks between changes: more than the L + 1 a change needs to reach the server's blocks."""
    return lookahead + 3


def segments(changes: int, lookahead: int) -> list[str]:
    """Each block's keys: W for the warm-up, then J and W in turns, a segment each."""
    keys = ["w"] * WARMUP_BLOCKS
    for i in range(changes):
        keys += [CHANGE_KEYS[i % 2]] * segment_blocks(lookahead)
    return keys


def run_play(url: str, lookahead: int, changes: int, size: int, out: Path) -> Run:
    keys = segments(changes, lookahead)
    script = ",".join(f"{k}*1" for k in keys)
    record = out / f"play_l{lookahead}.npz"
    cmd = [sys.executable, "-u", "-m", "client", "play", "--url", url, "--prompt", PROMPT, "--keys", script,
           "--lookahead", str(lookahead), "--height", str(size), "--width", str(size),
           "--out", str(out / f"play_l{lookahead}.mp4"), "--record", str(record), "--timeout", str(BOUND_S)]
    shown, step_latency, lines = [], {}, []
    with subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            stamp = time.perf_counter()
            lines.append(line)
            if match := BLOCK_LINE.match(line):
                shown.append(Shown(int(match[1]), stamp, stamp))
                step_latency[int(match[1])] = int(match[2]) / 1000
    if proc.returncode != 0:
        raise SystemExit(f"error: play at lookahead {lookahead} exited {proc.returncode}:\n{''.join(lines[-20:])}")
    # The step of block k is sent right after block k - L - 1 is written: that is when play reads its keys.
    starts = [k for k in range(1, len(keys)) if keys[k] != keys[k - 1]]
    at = {s.block: s.t for s in shown}
    latencies = measure([KeyChange(at[k - lookahead - 1], keys[k]) for k in starts], shown,
                        used_keys(Recording.load(record)))
    # Cross-check: the stamped interval from block k - L - 1 to block k against play's own step latency of block k.
    drift = max(abs(at[k] - at[k - lookahead - 1] - step_latency[k]) for k in starts)
    arrivals = [s.t for s in shown[WARMUP_BLOCKS:]]
    return Run("play", lookahead, latencies, list(np.diff(arrivals)), [], [],
               f"stamped interval vs play's step latency: within {drift * 1000:.0f} ms")


@contextlib.contextmanager
def bridge(url: str, lookahead: int, log: Path,
           serve: Sequence[str] = ("-m", "client", "serve")) -> Iterator[tuple[str, int]]:
    """`python -m client serve --lookahead L` (or `serve`, taking its arguments) against `url`, in its own process;
    yields its base URL and its pid."""
    port = free_port()
    with log.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, *serve, "--url", url, "--port", str(port),
                                 "--lookahead", str(lookahead)], cwd=REPO_ROOT, stdout=sink, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        poll(lambda: answers(base + "/") or proc.poll() is not None, "the bridge to serve its page")
        if proc.poll() is not None:
            raise SystemExit(f"error: the bridge exited {proc.returncode}:\n{log.read_text()}")
        yield base, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # a page still open holds its graceful stop
            proc.kill()
            proc.wait(timeout=30)


def answers(url: str) -> bool:
    with contextlib.suppress(OSError):
        return urllib.request.urlopen(url, timeout=2).status == 200
    return False


def poll(condition, what: str, timeout: float = BOUND_S):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise SystemExit(f"error: no {what} within {timeout:g} s")
        time.sleep(0.05)
    return value


def run_page(browser, url: str, lookahead: int, changes: int, size: int, out: Path, rng: random.Random,
             webrtc: bool = False) -> Run:
    path = "webrtc" if webrtc else "page"
    with bridge(url, lookahead, out / f"bridge_{path}_l{lookahead}.log") as (base, _):
        page = browser.new_page()
        page.add_init_script(TRACE_JS)
        if not webrtc:
            page.add_init_script(NO_WEBRTC_JS)
        page.goto(base + "/")
        page.fill("#prompt", PROMPT)
        page.fill("#width", str(size))
        page.fill("#height", str(size))
        page.click("#start")

        def trace() -> dict:
            return page.evaluate("() => window.__latency")

        def headers() -> list[dict]:
            return trace()["blocks"]

        poll(headers, "first block")
        page.keyboard.down("w")
        poll(lambda: len(headers()) >= WARMUP_BLOCKS, "warm-up blocks")
        held = "w"
        for i in range(changes):  # as play's script: a change every segment_blocks arrivals
            key, count = CHANGE_KEYS[i % 2], len(headers())
            arrivals = [b["t"] for b in headers()]
            time.sleep(rng.uniform(0, statistics.median(np.diff(arrivals[1:]))) / 1000)  # within the interval
            page.keyboard.down(key)
            page.keyboard.up(held)
            held = key
            poll(lambda n=count: len(headers()) >= n + segment_blocks(lookahead), "the segment's blocks")
        page.click("#stop")
        poll(lambda: page.get_attribute("#status", "data-state") == "ended", "the session to end")
        frames = sum(b["frames"] for b in trace()["blocks"])
        if webrtc:  # the last block's first frame shown on the video
            poll(lambda: (on_air := trace()["onAir"]) and on_air[-1]["block"] == trace()["blocks"][-1]["index"]
                 and trace()["frames"][-1]["t"] > on_air[-1]["t"], "the last block on the video")
        else:
            poll(lambda: (draws := trace()["draws"]) and draws[-1]["frame"] >= frames - 1, "the last frame drawn",
                 BOUND_S + frames / DEFAULT_FPS)
        final = trace()
        recording = out / f"{path}_l{lookahead}.npz"
        href = page.get_attribute("#download-recording", "href")
        recording.write_bytes(urllib.request.urlopen(base + href, timeout=30).read())
        page.close()
    blocks, draws = final["blocks"], final["draws"]
    arrived_s = {b["index"]: b["t"] / 1000 for b in blocks}
    if webrtc:
        shown = [Shown(block, t, arrived_s[block]) for block, t in on_screen(final["onAir"], final["frames"])]
    else:
        shown = [Shown(b["index"], t / 1000, b["t"] / 1000) for b in blocks if (t := first_draw(final, b)) is not None]
    # keydowns of the change keys after the warm-up's W (a key held down repeats no keydown)
    presses = [k for k in final["keys"] if k["key"] in CHANGE_KEYS][1:]
    measured = measure([KeyChange(k["t"] / 1000, k["key"]) for k in presses], shown, used_keys(Recording.load(recording)))
    queued = [k["queued"] for k in presses]
    header = {s.block: s.arrived for s in shown}
    arrived = [header[lat.first_block] - lat.change.t for lat in measured if lat.first_block is not None]
    arrivals = [b["t"] / 1000 for b in blocks[WARMUP_BLOCKS:]]
    if webrtc:
        video = final["frames"]
        shows = (len(video) - 1) / (video[-1]["t"] - video[0]["t"]) * 1000
        return Run(path, lookahead, measured, list(np.diff(arrivals)), [], arrived,
                   f"the video showed {shows:.1f} frames/s", None, frames)
    drew = (len(draws) - 1) / (draws[-1]["t"] - draws[0]["t"]) * 1000
    return Run(path, lookahead, measured, list(np.diff(arrivals)), queued, arrived,
               f"the canvas drew {drew:.1f} frames/s (the page plays at most 16)", frames - len(draws), frames)


def on_screen(on_air: Sequence[dict], frames: Sequence[dict]) -> list[tuple[int, float]]:
    """(block, seconds) when each block's first frame was on the video: the first frame shown whose RTP timestamp
    is at or after the stream's origin + the block's pts. The origin is the difference between a frame's RTP
    timestamp and an on_air pts that recurs most, each on_air paired with the frames shown within a second of it: a
    pts is the wall time its frame went out, so frame intervals differ in their last ticks and only the true origin
    recurs for every block."""
    pairs = [(f["rtp"] - m["pts"]) % RTP_WRAP for m in on_air for f in frames if 0 <= f["t"] - m["t"] < 1000]
    if not pairs:
        return []
    origin = statistics.mode(pairs)
    out = []
    for m in on_air:
        start = (origin + m["pts"]) % RTP_WRAP
        after = [f for f in frames if (f["rtp"] - start) % RTP_WRAP < RTP_WRAP // 2]
        if after:
            out.append((m["block"], min(after, key=lambda f: (f["rtp"] - start) % RTP_WRAP)["t"] / 1000))
    return out


def first_draw(trace: dict, block: dict) -> float | None:
    """When the first drawn frame of `block` was drawn (None: the page skipped all its frames)."""
    first = sum(b["frames"] for b in trace["blocks"] if b["index"] < block["index"])
    return next((d["t"] for d in trace["draws"] if first <= d["frame"] < first + block["frames"]), None)


# ---------------------------------------------------------------- the table


def table(runs: Sequence[Run]) -> str:
    rows = []
    for run in runs:
        later = [lat.blocks_later for lat in run.latencies]
        walls = [lat.wall_s for lat in run.latencies if lat.wall_s is not None]
        block = statistics.median(run.block_s)
        wall = statistics.median(walls) if walls else None
        rows.append([run.path, str(run.lookahead), " ".join("-" if n is None else str(n) for n in later),
                     "-" if wall is None else f"{wall:.2f}", f"{max(walls):.2f}" if walls else "-",
                     f"{statistics.median(run.arrival_s):.2f}" if run.arrival_s else "= wall",
                     f"{block:.2f}", "-" if wall is None else f"{wall / block:.1f}",
                     " ".join(map(str, run.queued)) or "-",
                     "-" if run.skipped is None else f"{run.skipped} of {run.frames}"])
    return format_table(["path", "lookahead", "blocks later, each change", "wall p50 (s)", "wall max (s)",
                         "to arrival p50 (s)", "block interval p50 (s)", "wall p50 / interval",
                         "frames queued at change", "frames skipped"], rows, left=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_checkpoint_args(parser, preset="tiny")
    parser.add_argument("--url", help="an existing server (default: start an SP1 CPU server on the checkpoint)")
    parser.add_argument("--lookahead", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--paths", nargs="+", choices=("play", "page", "webrtc"), default=["play", "page", "webrtc"],
                        help="play: the CLI; page: the browser page over JPEG; webrtc: the page over WebRTC")
    parser.add_argument("--changes", type=int, default=4, help="key changes per path and lookahead")
    parser.add_argument("--size", type=int, default=TINY.height, help="height and width of the video")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--seed", type=int, default=0, help="of the moments the page's keys are pressed")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    load_before = os.getloadavg()[0]
    runs: list[Run] = []
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            from bench.streaming import sp_server

            server = stack.enter_context(sp_server(ensure_checkpoint(args.checkpoint, args.preset), TINY, 1))
            url = server.grpc_url
        out = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="action-latency-")))
        browser = None
        if {"page", "webrtc"} & set(args.paths):
            from playwright.sync_api import sync_playwright

            playwright = stack.enter_context(sync_playwright())
            browser = playwright.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS, headless=True)
            stack.callback(browser.close)
        for path in args.paths:
            for lookahead in args.lookahead:
                run = run_play(url, lookahead, args.changes, args.size, out) if path == "play" else \
                    run_page(browser, url, lookahead, args.changes, args.size, out, rng, webrtc=path == "webrtc")
                runs.append(run)
                print(f"{path} lookahead {lookahead}: " + json.dumps(
                    [[lat.shown_block, lat.first_block, None if lat.wall_s is None else round(lat.wall_s, 3)]
                     for lat in run.latencies]) + (f"; {run.note}" if run.note else ""), flush=True)
    print()
    print(f"{MODEL_NAME} at {url}, {args.size}x{args.size}, {args.changes} key changes (W and J in turns) per row; "
          f"load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")
    print(table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
