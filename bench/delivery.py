"""The player's video, JPEG over the websocket against WebRTC, side by side in one run:

    python -m bench.delivery [--blocks 16] [--changes 4] [--watchers 20] [--url HOST:PORT]

1. Per page, frames made once then streamed (bench/replay_world: the panned test scene, a block of 12 frames every
   0.75 s: the world's own 16 fps), at 128x128 and 480x832; for each path a fresh bridge and one page in headless
   Chromium (the JPEG path: the page with its WebRTC turned off, as a browser without it). Over `--blocks` blocks
   after 3 of warm-up: the bytes the page received a second and a block (its websocket's messages; for WebRTC also
   the transport's bytes from getStats: SRTP, RTCP, DTLS, STUN and the data channel), the frames it showed a second
   (canvas draws, or video frames), and the bridge's CPU (its process's user + system time over the window, in %
   of one core; the MP4 writer's ffmpeg, a process of its own, is left out: it runs on either path).
2. Action-to-frame latency on both paths: bench.action_latency's page and webrtc paths at lookahead 1, 128x128,
   on an SP1 tiny random-weights tritonserver (started here, unless --url).
3. One player and `--watchers` watchers on that server (the player's page over WebRTC in Chromium; the watchers
   aiortc peers in this process): the player's block interval at its page and the bridge's CPU, first alone, then
   with the watchers, in one session. The watchers stand for other machines: they receive every frame whole but do
   not decode it (`bench.rtc_peers.undecoded`; the tests' watchers decode), and run at nice 10, taking the cores
   the server, the bridge and Chromium leave; this process's CPU is shown beside.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import random
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

from bench.action_latency import CHROMIUM_ARGS, NO_WEBRTC_JS, TRACE_JS, bridge, poll, run_page, table
from bench.common import TINY, add_checkpoint_args, ensure_checkpoint, format_table
from bench.rtc_peers import LoopThread, Peer, loopback_media, undecoded

SIZES = ((128, 128), (480, 832))
BLOCK_S = 0.75  # 12 frames at 16 fps: a server that keeps up with playback, no faster
WARMUP_BLOCKS = 3
WATCHERS_NICE = 10  # the watchers stand for other machines: they take the cores the server and bridge leave
TICKS_S = os.sysconf("SC_CLK_TCK")

# Added to the page before its own script: every byte its websocket received, every frame it showed.
COUNT_JS = """(() => {
  const count = {wsBytes: 0, drawn: 0, shown: 0};
  window.__count = count;
  window.WebSocket = class extends window.WebSocket {
    constructor(...args) {
      super(...args);
      this.addEventListener("message", (e) => {
        count.wsBytes += typeof e.data === "string" ? new Blob([e.data]).size : e.data.size;
      });
    }
  };
  const draw = CanvasRenderingContext2D.prototype.drawImage;
  CanvasRenderingContext2D.prototype.drawImage = function (...args) { count.drawn += 1; return draw.apply(this, args); };
  document.addEventListener("DOMContentLoaded", () => {
    const video = document.getElementById("video");
    const frame = () => { count.shown += 1; video.requestVideoFrameCallback(frame); };
    video.requestVideoFrameCallback(frame);
  });
})();"""
COUNTS = """async () => {
  const c = Object.assign({}, window.__count, {rtcBytes: 0, codec: ""});
  if (typeof rtc !== "undefined" && rtc) {
    const v = await videoStats(rtc.pc);
    c.rtcBytes = v.transportBytes;
    c.codec = v.codec;
  }
  c.blocks = Number(document.getElementById("status").dataset.blocks);
  c.t = performance.now() / 1000;
  return c;
}"""


def cpu_s(pid: int) -> float:
    """A process's user + system CPU seconds so far (its threads included, its children not)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_S


@dataclass
class Window:
    wall_s: float
    cpu_s: float
    blocks: int
    ws_bytes: int
    rtc_bytes: int
    frames_shown: int
    codec: str


def window(page, pid: int, blocks: int, shown: str) -> Window:
    """Counters over the next `blocks` blocks at the page."""
    before, cpu = page.evaluate(COUNTS), cpu_s(pid)
    poll(lambda: page.evaluate(COUNTS)["blocks"] >= before["blocks"] + blocks, f"{blocks} blocks",
         blocks * BLOCK_S * 4 + 30)
    after, cpu = page.evaluate(COUNTS), cpu_s(pid) - cpu
    return Window(after["t"] - before["t"], cpu, after["blocks"] - before["blocks"], after["wsBytes"] - before["wsBytes"],
                  after["rtcBytes"] - before["rtcBytes"], after[shown] - before[shown], after["codec"])


def start_page(browser, base: str, size: tuple[int, int], webrtc: bool, *scripts: str):
    page = browser.new_page()
    for script in scripts if webrtc else (*scripts, NO_WEBRTC_JS):
        page.add_init_script(script)
    page.goto(base + "/")
    page.fill("#prompt", "a panned test scene")
    page.fill("#height", str(size[0]))
    page.fill("#width", str(size[1]))
    page.click("#start")
    poll(lambda: int(page.get_attribute("#status", "data-blocks")) >= WARMUP_BLOCKS, "the warm-up blocks")
    via = page.get_attribute("#video-note", "data-video")
    if via != ("webrtc" if webrtc else "jpeg"):
        raise SystemExit(f"error: the page plays over {via}: {page.inner_text('#video-note')}")
    return page


def per_page(browser, size: tuple[int, int], webrtc: bool, blocks: int, out: Path) -> Window:
    serve = ("-m", "bench.replay_world", "--height", str(size[0]), "--width", str(size[1]), "--block-s", str(BLOCK_S),
             "--save-every", "0")
    log = out / f"bridge_{size[0]}x{size[1]}_{'webrtc' if webrtc else 'jpeg'}.log"
    with bridge("replayed:1", 1, log, serve) as (base, pid):
        page = start_page(browser, base, size, webrtc, COUNT_JS)
        measured = window(page, pid, blocks, "shown" if webrtc else "drawn")
        page.click("#stop")
        page.close()
    return measured


def path_rows(results: dict[tuple[tuple[int, int], bool], Window]) -> list[list[str]]:
    rows = []
    for (size, webrtc), w in results.items():
        total = w.ws_bytes + w.rtc_bytes
        rows.append([f"{size[0]}x{size[1]}", f"WebRTC {w.codec.replace('video/', '')}" if webrtc else "JPEG q90",
                     f"{total / w.wall_s / 1e3:,.0f}", f"{total * 8 / w.wall_s / 1e6:.2f}",
                     f"{total / w.blocks / 1e3:,.1f}", f"{w.ws_bytes / w.wall_s / 1e3:,.1f}",
                     f"{w.frames_shown / w.wall_s:.1f}", f"{100 * w.cpu_s / w.wall_s:.1f}"])
    return rows


async def _made(count: int) -> list[Peer]:  # aiortc's objects belong to the loop they are made on
    return [Peer("watch") for _ in range(count)]


async def _joined(peers: list[Peer], base: str, link: str) -> list[int]:
    async with aiohttp.ClientSession() as http:
        return [status for status, _ in await asyncio.gather(*(peer.watch(http, base, link) for peer in peers))]


async def _closed(peers: list[Peer]) -> None:
    await asyncio.gather(*(peer.close() for peer in peers))


def block_interval(page) -> Callable[[], float]:
    """The median interval between the block headers the page got in the last window (TRACE_JS's stamps)."""
    first = len(page.evaluate("() => window.__latency.blocks"))

    def median() -> float:
        times = [b["t"] for b in page.evaluate("() => window.__latency.blocks")][first - 1:]
        return float(np.median(np.diff(times))) / 1000

    return median


def watched(browser, url: str, blocks: int, watchers: int, size: int, out: Path) -> list[list[str]]:
    rows = []
    with bridge(url, 1, out / "bridge_watchers.log") as (base, pid), loopback_media(), undecoded(), \
            LoopThread(nice=WATCHERS_NICE) as loop:
        page = start_page(browser, base, (size, size), True, TRACE_JS, COUNT_JS)
        interval, own = block_interval(page), cpu_s(os.getpid())
        alone = window(page, pid, blocks, "shown")
        own = cpu_s(os.getpid()) - own
        rows.append(["alone", f"{interval():.3f}", f"{alone.rtc_bytes * 8 / alone.wall_s / 1e6:.2f}",
                     f"{100 * alone.cpu_s / alone.wall_s:.1f}", f"{alone.frames_shown / alone.wall_s:.1f}", "-",
                     f"{100 * own / alone.wall_s:.0f}"])
        page.click("#watch")
        poll(lambda: page.is_visible("#watch-link"), "the watch link")
        peers = loop.run(_made(watchers))
        try:
            statuses = loop.run(_joined(peers, base, page.get_attribute("#watch-link", "href")))
            if statuses != [200] * watchers:
                raise SystemExit(f"error: watchers refused: {statuses}")
            poll(lambda: all(len(p.frames) >= 12 for p in peers), "12 frames at every watcher")
            received = [len(p.frames) for p in peers]
            interval, own = block_interval(page), cpu_s(os.getpid())
            many = window(page, pid, blocks, "shown")
            own = cpu_s(os.getpid()) - own
            rate = [(len(p.frames) - r) / many.wall_s for p, r in zip(peers, received)]
            rows.append([f"with {watchers} watchers", f"{interval():.3f}", f"{many.rtc_bytes * 8 / many.wall_s / 1e6:.2f}",
                         f"{100 * many.cpu_s / many.wall_s:.1f}", f"{many.frames_shown / many.wall_s:.1f}",
                         f"{min(rate):.1f}-{max(rate):.1f}", f"{100 * own / many.wall_s:.0f}"])
        finally:
            loop.run(_closed(peers))
        page.click("#stop")
        page.close()
    return rows


def machine() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "?")
    return f"{model}, {os.cpu_count()} cores, {platform.machine()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_checkpoint_args(parser, preset="tiny")
    parser.add_argument("--url", help="an existing server for parts 2 and 3 (default: start an SP1 CPU server)")
    parser.add_argument("--blocks", type=int, default=16, help="blocks in each measured window")
    parser.add_argument("--changes", type=int, default=4, help="key changes in each latency row")
    parser.add_argument("--watchers", type=int, default=20)
    parser.add_argument("--size", type=int, default=128, help="height and width in parts 2 and 3")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--seed", type=int, default=0, help="of the moments the page's keys are pressed")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    began = time.monotonic()
    with contextlib.ExitStack() as stack:
        out = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="delivery-")))
        from playwright.sync_api import sync_playwright

        playwright = stack.enter_context(sync_playwright())
        browser = playwright.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS, headless=True)
        stack.callback(browser.close)
        paths = {}
        for size in SIZES:
            for webrtc in (False, True):
                paths[size, webrtc] = per_page(browser, size, webrtc, args.blocks, out)
                print(f"{size[0]}x{size[1]} {'WebRTC' if webrtc else 'JPEG'}: {paths[size, webrtc]}", flush=True)
        url = args.url
        if url is None:
            from bench.streaming import sp_server

            server = stack.enter_context(sp_server(ensure_checkpoint(args.checkpoint, args.preset), TINY, 1))
            url = server.grpc_url
        rng = random.Random(args.seed)
        latency = [run_page(browser, url, 1, args.changes, args.size, out, rng, webrtc=webrtc) for webrtc in (False, True)]
        watchers = watched(browser, url, args.blocks, args.watchers, args.size, out)
    print(f"\nmachine: {machine()}; load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after; "
          f"{time.monotonic() - began:.0f} s\n")
    print(f"Per page, frames made once (the panned test scene, a block of 12 every {BLOCK_S} s), {args.blocks} blocks:")
    print(format_table(["size", "path", "kB/s", "Mbit/s", "kB/block", "of it websocket kB/s", "frames shown/s",
                        "bridge CPU %"], path_rows(paths), left=2))
    print(f"\nAction to frame, lookahead 1, {args.size}x{args.size}, {args.changes} key changes per row (the tiny "
          f"server at {url}):")
    print(table(latency))
    print(f"\nOne player (WebRTC, {args.size}x{args.size}) and {args.watchers} watchers, {args.blocks} blocks each:")
    print(format_table(["player", "block interval p50 (s)", "player's video Mbit/s", "bridge CPU %",
                        "player frames shown/s",
                        "each watcher's frames received/s", "this process's CPU % (the watchers)"], watchers, left=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
