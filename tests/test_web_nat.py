"""The player through a NAT and a real TURN server: headless Chromium in a network namespace of its own (a private
range), behind a masquerading NAT in a second namespace, with the bridge and Debian's coturn on this machine's side.
The NAT forwards the page's new connections to the bridge's page (TCP) and to coturn's port only, and nothing new
towards the page, so neither side's host candidates reach the other: the page plays over a relay, with the TURN
credential the bridge handed it, over UDP, and over TCP where the NAT drops all UDP."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import imageio.v3 as iio
import pytest

from bench.natlink import TURNSERVER, Nat, NoNamespace, Turn, bridge_args, browser_in, natted_namespace, running_turn
from client.web.rtc import TURN_CREDENTIAL_TTL_S
from bridge_harness import running_bridge
from factories import sample_image
from polling import wait_until
from system_tools import requires_tool, tools_required
from test_web_player import CHROMIUM, start, status

CONNECT_S = 60  # the page's first block and its connection over the relay, on a busy CPU
FRAMES = 20  # decoded frames, beyond those already counted, that show the relay carries the video

pytestmark = [
    pytest.mark.server,
    requires_tool(Path(CHROMIUM).is_file(), f"Chromium at {CHROMIUM} (Debian's chromium)"),
    requires_tool(Path(TURNSERVER).is_file(), f"coturn's turnserver at {TURNSERVER} (Debian's coturn)"),
    requires_tool(shutil.which("ip") is not None, "iproute2's ip (Debian's iproute2)"),
    requires_tool(shutil.which("iptables") is not None, "iptables (Debian's iptables)"),
]

# The page's getStats: the selected candidate pair's two ends, the video's decoded frames.
SELECTED_PAIR = """async () => {
  const pc = window.peers[window.peers.length - 1];
  if (!pc) return null;
  const stats = await pc.getStats();
  const out = {state: pc.connectionState, decoded: 0, local: null, remote: null,
               username: (pc.getConfiguration().iceServers.find((s) => s.username) || {}).username};
  const end = (c) => c && {type: c.candidateType, protocol: c.relayProtocol || c.protocol, address: c.address,
                           mapped: c.relatedAddress};
  stats.forEach((s) => {
    if (s.type === "inbound-rtp" && s.kind === "video") out.decoded = s.framesDecoded || 0;
    if (s.type === "transport" && s.selectedCandidatePairId) {
      const pair = stats.get(s.selectedCandidatePairId);
      out.local = end(stats.get(pair.localCandidateId));
      out.remote = end(stats.get(pair.remoteCandidateId));
    }
  });
  return out;
}"""


@contextlib.contextmanager
def page_network(tag: str, n: int) -> Iterator[Nat]:
    """natted_namespace; where none can be made, a skip, or a failure where the whole suite must run."""
    try:
        with natted_namespace(tag, n) as made:
            yield made
    except NoNamespace as why:
        pytest.fail(str(why)) if tools_required() else pytest.skip(str(why))


@pytest.fixture(scope="module")
def nat() -> Iterator[Nat]:
    with page_network(f"lbn{os.getpid() % 100000}", os.getpid() % 250) as made:
        yield made


@pytest.fixture(scope="module")
def turn(nat: Nat, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Turn]:
    with running_turn(nat, tmp_path_factory.mktemp("turn")) as made:
        yield made


@pytest.fixture(scope="module")
def bridge(sp1_server, nat: Nat, turn: Turn, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """The bridge on the host's side of the NAT, naming coturn over UDP and over TCP; yields (its URL, its port)."""
    log = tmp_path_factory.mktemp("bridge") / "bridge.log"
    with running_bridge(sp1_server.grpc_url, log, *bridge_args(nat, turn), host=nat.host) as base:
        yield base + "/", int(base.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def browser(nat: Nat):
    with browser_in(nat, CHROMIUM) as context:
        yield context


@pytest.fixture
def first_frame(tmp_path: Path) -> Path:
    path = tmp_path / "first.png"
    iio.imwrite(path, sample_image())
    return path


@pytest.mark.parametrize("udp", [True, False], ids=["turn_udp", "udp_blocked_turn_tcp"])
def test_page_behind_a_nat_plays_over_a_turn_relay(nat: Nat, turn: Turn, bridge: tuple[str, int], browser,
                                                   udp: bool, first_frame: Path) -> None:
    url, port = bridge
    nat.forward_only([port, turn.port], [turn.port] if udp else [])
    page = browser.new_page()
    try:
        start(page, url, first_frame)
        stats = wait_until(lambda: (s := page.evaluate(SELECTED_PAIR)) and s["local"] and s["decoded"] > 0 and s,
                           CONNECT_S, "the page's video over a selected candidate pair")
        assert page.get_attribute("#video-note", "data-video") == "webrtc", status(page, "state")
        # The page's end of the pair is coturn's relay (over UDP, or over TCP where UDP is dropped); the bridge's
        # end is its own address, which coturn reaches and the page does not.
        assert stats["local"]["type"] == "relay", stats
        assert stats["local"]["protocol"] == ("udp" if udp else "tcp"), stats
        assert stats["local"]["address"] == nat.host, stats
        assert stats["remote"]["address"] == nat.host, stats
        # The relay carries the video: decoded frames keep growing.
        wait_until(lambda: page.evaluate(SELECTED_PAIR)["decoded"] >= stats["decoded"] + FRAMES, CONNECT_S,
                   f"{FRAMES} more decoded frames over the relay")
        # coturn took the credential the bridge handed this page (EXPIRY:SESSION), from the NAT's outside address.
        assert stats["local"]["mapped"] == nat.outside, stats
        expiry, session = stats["username"].split(":")
        assert abs(int(expiry) - (time.time() + TURN_CREDENTIAL_TTL_S)) < 2 * CONNECT_S, stats
        assert re.fullmatch("[0-9a-f]{32}", session), stats
        wait_until(lambda: f"user <{stats['username']}>: incoming packet ALLOCATE processed, success"
                   in turn.log.read_text(), 10, "coturn's log of the page's allocation")
    finally:
        page.close()


@pytest.mark.slow  # 14 s of the page's ICE limits; test_web_player's failed WebRTC falls back to JPEG on loopback
def test_behind_the_nat_with_no_way_to_the_turn_server_the_page_falls_back_to_jpeg(
        nat: Nat, bridge: tuple[str, int], browser, first_frame: Path) -> None:
    """The control: no candidate pair but the relay connects through this NAT, so with coturn's port closed too
    the page's WebRTC does not connect and it plays over JPEG, as documented."""
    url, port = bridge
    nat.forward_only([port], [])
    page = browser.new_page()
    try:
        start(page, url, first_frame)
        wait_until(lambda: page.get_attribute("#video-note", "data-video") == "jpeg", CONNECT_S,
                   "the page's fallback to JPEG")
        assert "WebRTC failed" in page.inner_text("#video-note")
        wait_until(lambda: int(status(page, "blocks") or 0) >= 1, CONNECT_S, "a block over JPEG")
    finally:
        page.close()
