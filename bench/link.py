"""The player on a bad link: the page (headless Chromium) in a network namespace behind a NAT, over coturn's relay
(bench/natlink.py), its link made bad inside the NAT's namespace, in turn: unshaped (the baseline), 150 ms round
trip and 1% loss, then also a rate cap, then the cap lifted (150 ms and 1% loss again), for each cap in turn: 1.5
Mbit/s, then 0.2 (under the stream of the replayed clip, ~0.27 Mbit/s) by default.

    python -m bench.link [--seconds 15] [--blocks 4] [--caps-kbit 1500 200] [--world replay|tiny]

The world: by default a replayed one at 480x832 (bench/replay_world: a block of 12 frames every 0.75 s, the world's
own 16 fps, frames made beforehand; its encoder's range is 0.5 to 1.9 Mbit/s); `--world tiny`: a real tritonserver
on the tiny checkpoint (SP1, CPU) at 64x64 (its encoder's range: 0.1 Mbit/s only). Root only (namespaces, iptables,
tc). For each setting, over `--seconds` and `--blocks` at least: the video's bitrate as received
(getStats' bytesReceived), the bridge's estimate of the link (the receiver's REMB, the last the bridge logged: it
logs a move by more than a tenth) and the bitrate it encodes this picture at, the frames decoded per second and the
freezes (count and total time, getStats), the world's blocks per second as the page got them, the blocks that
used the key held (sent on the data channel), and action-to-frame: from the setting's key press (a new key: W and
J in turns) to the first frame on the video of the first block that used it (bench.action_latency's WebRTC trace:
requestVideoFrameCallback and the data channel's on_air), one press per setting ("-": not on the video within
SHOWN_S past the setting's blocks).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import imageio.v3 as iio
import numpy as np

from backend.launch.paths import REPO_ROOT
from backend.parallel.ports import free_port
from bench.action_latency import TRACE_JS, answers, on_screen
from bench.common import PROMPT, TINY, add_checkpoint_args, ensure_checkpoint, format_table
from bench.natlink import Link, Nat, bridge_args, browser_in, natted_namespace, running_turn

REPLAY_SIZE, TINY_SIZE = (480, 832), (64, 64)  # (height, width)
REPLAY_BLOCK_S = 0.75  # 12 frames at 16 fps
BOUND_S = 120.0  # any one wait for the server, the bridge or the page
ESTIMATE = re.compile(r"link estimate (\d+) kbit/s(?:, encoding at (\d+) kbit/s)?")
KEYS = ("j", "w")  # each setting presses the other one
SHOWN_S = 20.0  # how long a setting waits, past its blocks, for the key's first block on the video


def settings(caps_kbit: list[int]) -> list[tuple[str, Mapping[str, float]]]:
    """Unshaped, 150 ms round trip and 1% loss, then for each cap: that too, then it lifted."""
    bad = {"delay_ms": 75, "loss": 0.01}
    out = [("unshaped", {}), ("150 ms + 1% loss", bad)]
    for cap in caps_kbit:
        out += [(f"+ {cap / 1000:g} Mbit/s cap", bad | {"rate_kbit": cap}), ("cap lifted", bad)]
    return out


# The page's video as getStats has it (its own peer connection: bench.natlink's RECORD_PEERS).
VIDEO_STATS = """async () => {
  const pc = window.peers[window.peers.length - 1];
  if (!pc) return null;
  let out = null;
  (await pc.getStats()).forEach((s) => {
    if (s.type === "inbound-rtp" && s.kind === "video")
      out = {t: performance.now(), decoded: s.framesDecoded || 0, fps: s.framesPerSecond || 0,
             freezes: s.freezeCount || 0, frozen_s: s.totalFreezesDuration || 0, bytes: s.bytesReceived || 0,
             lost: s.packetsLost || 0};
  });
  return out;
}"""


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    kbit: float  # received
    estimate_kbit: int | None  # the bridge's estimate of the link at the end (the last logged), and its encode's
    encoding_kbit: int | None
    fps: float  # frames decoded per second
    freezes: int
    frozen_s: float
    blocks_per_s: float
    blocks: int
    keyed: int  # blocks that used the key held
    action_ms: float | None  # key press to its first frame on the video


def estimates(log: Path) -> list[tuple[int, int | None]]:
    """The bridge's logged estimates of the page's link, in order: (kbit/s, the bitrate it encodes at)."""
    return [(int(m[1]), int(m[2]) if m[2] else None) for m in ESTIMATE.finditer(log.read_text())]


def wait(condition, what: str, timeout: float = BOUND_S):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout:g} s")
        time.sleep(0.05)
    return value


def trace(page) -> dict:
    return page.evaluate("() => window.__latency")


def measure(page, log: Path, name: str, key: str, held: str | None, blocks: int, seconds: float) -> Phase:
    """Press `key` (releasing `held`) and measure the page's video and blocks until `blocks` more have come and
    `seconds` have passed."""
    before, count = page.evaluate(VIDEO_STATS), len(trace(page)["blocks"])
    page.keyboard.down(key)
    if held:
        page.keyboard.up(held)
    pressed = trace(page)["keys"][-1]["t"]
    until = time.monotonic() + seconds
    wait(lambda: len(trace(page)["blocks"]) >= count + blocks and time.monotonic() >= until,
         f"{blocks} blocks and {seconds:g} s ({name})", BOUND_S * blocks + seconds)

    def key_shown() -> bool:  # the first block that used the key is on the video (or no block used it)
        final = trace(page)
        keyed = [b["index"] for b in final["blocks"][count:] if key in (b["keys"] or "")]
        return not keyed or keyed[0] in dict(on_screen(final["onAir"], final["frames"]))

    shown_by = time.monotonic() + SHOWN_S
    while not key_shown() and time.monotonic() < shown_by:  # else its action-to-frame is "-"
        time.sleep(0.05)
    after, final = page.evaluate(VIDEO_STATS), trace(page)
    dt = (after["t"] - before["t"]) / 1000
    came = final["blocks"][count:]
    arrivals = [b["t"] / 1000 for b in came]
    keyed = [b for b in came if key in (b["keys"] or "")]
    shown = dict(on_screen(final["onAir"], final["frames"]))
    first = next((shown[b["index"]] for b in keyed if b["index"] in shown), None)
    last = (estimates(log) or [(None, None)])[-1]
    return Phase(name, dt, 8 * (after["bytes"] - before["bytes"]) / dt / 1000, last[0], last[1],
                 (after["decoded"] - before["decoded"]) / dt, after["freezes"] - before["freezes"],
                 after["frozen_s"] - before["frozen_s"],
                 (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]) if len(arrivals) > 1 else 0.0,
                 len(came), len(keyed), None if first is None else first * 1000 - pressed)


def table(phases: list[Phase]) -> str:
    def kbit(v: int | None) -> str:
        return "-" if v is None else str(v)

    return format_table(
        ["link", "received kbit/s", "estimate kbit/s", "encoding kbit/s", "frames/s", "freezes", "frozen s",
         "blocks/s", "keyed blocks", "action-to-frame ms"],
        [[p.name, f"{p.kbit:.0f}", kbit(p.estimate_kbit), kbit(p.encoding_kbit), f"{p.fps:.1f}", str(p.freezes),
          f"{p.frozen_s:.2f}", f"{p.blocks_per_s:.2f}", f"{p.keyed}/{p.blocks}",
          "-" if p.action_ms is None else f"{p.action_ms:.0f}"] for p in phases], left=1)


def start_page(page, base: str, image: Path, size: tuple[int, int]) -> None:
    """The page, traced (bench.action_latency's TRACE_JS), starts a world from `image` at `size` (height, width)."""
    page.add_init_script(TRACE_JS)
    page.goto(base)
    page.select_option("#source", "upload")
    page.set_input_files("#image", str(image))
    page.fill("#prompt", PROMPT)
    page.fill("#height", str(size[0]))
    page.fill("#width", str(size[1]))
    page.click("#start")


@contextlib.contextmanager
def bridge(url: str | None, nat: Nat, args: list[str], log: Path) -> Iterator[str]:
    """`python -m client serve` against `url` (None: on replayed worlds, bench.replay_world at REPLAY_SIZE) on this
    machine's end of the NAT's link; yields its page's URL."""
    port = free_port()
    serve = ["-m", "client", "serve", "--url", url] if url else [
        "-m", "bench.replay_world", "--height", str(REPLAY_SIZE[0]), "--width", str(REPLAY_SIZE[1]), "--block-s",
        str(REPLAY_BLOCK_S), "--save-every", "0", "--url", "replayed:1"]
    with log.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, *serve, "--host", nat.host, "--port", str(port), *args],
                                cwd=REPO_ROOT, stdout=sink, stderr=subprocess.STDOUT)
    base = f"http://{nat.host}:{port}/"
    try:
        wait(lambda: answers(base) or proc.poll() is not None, "bridge serving its page")
        if proc.poll() is not None:
            raise SystemExit(f"error: the bridge exited {proc.returncode}:\n{log.read_text()}")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


def run(browser, base: str, nat: Nat, turn_port: int, log: Path, image: Path, size: tuple[int, int],
        caps_kbit: list[int], blocks: int, seconds: float) -> list[Phase]:
    nat.forward_only([int(base.rsplit(":", 1)[1].rstrip("/")), turn_port], [turn_port])
    page = browser.new_page()
    try:
        start_page(page, base, image, size)
        wait(lambda: (s := page.evaluate(VIDEO_STATS)) and s["decoded"] > 0, "video over the relay")
        phases, held = [], None
        with Link(nat) as link:
            for i, (name, setting) in enumerate(settings(caps_kbit)):
                link.set(**setting)
                key = KEYS[i % 2]
                phases.append(measure(page, log, name, key, held, blocks, seconds))
                held = key
                print(table(phases[-1:]).splitlines()[-1], flush=True)
        page.click("#stop")
        return phases
    finally:
        page.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_checkpoint_args(parser, preset="tiny")
    parser.add_argument("--world", choices=("replay", "tiny"), default="replay",
                        help="a replayed world at 480x832, or a tritonserver on the tiny checkpoint at 64x64")
    parser.add_argument("--blocks", type=int, default=4, help="blocks measured per link setting, at least")
    parser.add_argument("--seconds", type=float, default=15, help="seconds measured per link setting, at least")
    parser.add_argument("--caps-kbit", type=int, nargs="+", default=[1500, 200],
                        help="the rate caps, kbit/s, each in turn (then lifted)")
    parser.add_argument("--chromium", default=os.environ.get("CHROMIUM", "/usr/bin/chromium"))
    args = parser.parse_args(argv)
    size = TINY_SIZE if args.world == "tiny" else REPLAY_SIZE
    with contextlib.ExitStack() as stack:
        url = None
        if args.world == "tiny":
            from bench.streaming import sp_server

            url = stack.enter_context(sp_server(ensure_checkpoint(args.checkpoint, args.preset), TINY, 1)).grpc_url
        out = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        nat = stack.enter_context(natted_namespace(f"lbb{os.getpid() % 100000}", 200 + os.getpid() % 50))
        turn = stack.enter_context(running_turn(nat, out))
        log = out / "bridge.log"
        base = stack.enter_context(bridge(url, nat, bridge_args(nat, turn), log))
        browser = stack.enter_context(browser_in(nat, args.chromium))
        image = out / "first.png"
        iio.imwrite(image, np.random.default_rng(0).integers(0, 256, (*size, 3), dtype=np.uint8))
        phases = run(browser, base, nat, turn.port, log, image, size, args.caps_kbit, args.blocks, args.seconds)
    print(f"\n{args.world} world at {size[0]}x{size[1]}, {args.seconds:g} s and {args.blocks} blocks at least per "
          "setting, the page behind a NAT over coturn (UDP):\n")
    print(table(phases))

if __name__ == "__main__":
    main()
