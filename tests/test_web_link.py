"""The player on a bad link: the page behind tests/test_web_nat.py's NAT, over coturn's relay (UDP), its link made
bad inside the NAT's namespace (bench/natlink.py's Link: this kernel has no netem, so the delay is an NFQUEUE
listener, the loss iptables' statistic match, the cap a tbf qdisc; this machine's own interfaces are never shaped).
The world is a replayed one at 480x832 (bench/replay_world: 12 frames every 0.75 s, the world's own pace; its
encoder's range is 0.5 to 1.9 Mbit/s, where the tiny model's 64x64 picture has 0.1 only). In turn: unshaped, then
150 ms round trip and 1% loss, then also a 1.5 Mbit/s cap, then the cap lifted. The bridge encodes under the cap
(within a bounded time) and what comes through stays under it; through all of it the picture keeps playing, the
keys the page sends on its data channel keep reaching the world's steps, and the world keeps its pace as the page
gets it. (The encoder hardly moves here: the receiver's estimate stays near or under its 0.5 Mbit/s floor, so the
cap is above the stream: docs/player.md, "On a bad link".)"""
from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest

from bench.link import REPLAY_SIZE, VIDEO_STATS, Phase, bridge, estimates, measure, start_page
from bench.natlink import TURNSERVER, Link, Nat, Turn, bridge_args, browser_in, running_turn
from polling import wait_until
from system_tools import requires_tool
from test_web_nat import page_network
from test_web_player import CHROMIUM

CONNECT_S = 60  # the page's first block and its connection over the relay, on a busy CPU
BLOCKS, PHASE_S = 4, 6.0  # blocks and seconds measured per link setting, at least
BAD = {"delay_ms": 75, "loss": 0.01}  # 75 ms each way: a 150 ms round trip
CAP_KBIT = 1500
FOLLOW_S = 30  # the encoder's bitrate under the cap once set
MIN_FPS = 10.0  # frames decoded per second in every setting: the picture keeps playing (of 16)
PACE = 0.25  # each setting's blocks per second within this share of the unshaped one's

pytestmark = [
    pytest.mark.server,
    requires_tool(Path(CHROMIUM).is_file(), f"Chromium at {CHROMIUM} (Debian's chromium)"),
    requires_tool(Path(TURNSERVER).is_file(), f"coturn's turnserver at {TURNSERVER} (Debian's coturn)"),
    requires_tool(shutil.which("ip") is not None, "iproute2's ip (Debian's iproute2)"),
    requires_tool(shutil.which("iptables") is not None, "iptables (Debian's iptables)"),
    requires_tool(shutil.which("tc") is not None, "iproute2's tc (Debian's iproute2)"),
]


@pytest.fixture(scope="module")
def nat() -> Iterator[Nat]:
    with page_network(f"lbl{os.getpid() % 100000}", (os.getpid() + 100) % 250) as made:
        yield made


@pytest.fixture(scope="module")
def turn(nat: Nat, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Turn]:
    with running_turn(nat, tmp_path_factory.mktemp("turn")) as made:
        yield made


@pytest.fixture(scope="module")
def replayed(nat: Nat, turn: Turn, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, Path]]:
    """The bridge, on replayed worlds, on the host's side of the NAT; yields (its URL, its port, its log)."""
    log = tmp_path_factory.mktemp("bridge") / "bridge.log"
    with bridge(None, nat, bridge_args(nat, turn), log) as base:
        yield base, int(base.rstrip("/").rsplit(":", 1)[1]), log


@pytest.fixture(scope="module")
def browser(nat: Nat):
    with browser_in(nat, CHROMIUM) as context:
        yield context


def encoding(log: Path) -> int | None:
    """The bitrate the bridge last logged it encodes the page's picture at, kbit/s (from its link's estimate)."""
    return (estimates(log) or [(None, None)])[-1][1]


@pytest.mark.slow  # about 30 s; test_web_nat plays the page through the same NAT and relay on a clean link
def test_on_a_bad_link_the_picture_plays_the_keys_arrive_and_the_world_keeps_its_pace(
        nat: Nat, turn: Turn, replayed: tuple[str, int, Path], browser, tmp_path: Path) -> None:
    url, port, log = replayed
    nat.forward_only([port, turn.port], [turn.port])
    first_frame = tmp_path / "first.png"
    iio.imwrite(first_frame, np.random.default_rng(0).integers(0, 256, (*REPLAY_SIZE, 3), dtype=np.uint8))
    page = browser.new_page()
    try:
        start_page(page, url, first_frame, REPLAY_SIZE)
        wait_until(lambda: (s := page.evaluate(VIDEO_STATS)) and s["decoded"] > 0, CONNECT_S, "video over the relay")
        with Link(nat) as link:
            phases: list[Phase] = [measure(page, log, "unshaped", "j", None, BLOCKS, PHASE_S)]
            link.set(**BAD)
            phases.append(measure(page, log, "150 ms + 1% loss", "w", "j", BLOCKS, PHASE_S))
            link.set(**BAD, rate_kbit=CAP_KBIT)
            wait_until(lambda: (e := encoding(log)) is not None and e < CAP_KBIT, FOLLOW_S,
                       f"the bridge's encoder under the {CAP_KBIT} kbit/s cap")
            phases.append(measure(page, log, "capped", "j", "w", BLOCKS, PHASE_S))
            link.set(**BAD)
            phases.append(measure(page, log, "lifted", "w", "j", BLOCKS, PHASE_S))
        summary = str(phases)
        base = phases[0]
        for phase in phases:
            assert phase.fps >= MIN_FPS, summary  # the picture keeps playing
            assert phase.keyed >= BLOCKS - 1, summary  # the data channel's key reached the world's steps
            assert abs(phase.blocks_per_s / base.blocks_per_s - 1) <= PACE, summary  # the world keeps its pace
        assert phases[2].kbit <= CAP_KBIT, summary  # what came through the cap
    finally:
        page.close()
