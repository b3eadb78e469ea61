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
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import imageio.v3 as iio
import pytest

from backend.parallel.ports import free_port
from client.web.rtc import TURN_CREDENTIAL_TTL_S
from bridge_harness import running_bridge
from factories import sample_image
from polling import wait_until
from system_tools import requires_tool, tools_required
from test_web_player import CHROMIUM, CHROMIUM_ARGS, start, status

TURNSERVER = "/usr/bin/turnserver"  # Debian's coturn
CONNECT_S = 60  # the page's first block and its connection over the relay, on a busy CPU
FRAMES = 20  # decoded frames, beyond those already counted, that show the relay carries the video

pytestmark = [
    pytest.mark.server,
    requires_tool(Path(CHROMIUM).is_file(), f"Chromium at {CHROMIUM} (Debian's chromium)"),
    requires_tool(Path(TURNSERVER).is_file(), f"coturn's turnserver at {TURNSERVER} (Debian's coturn)"),
    requires_tool(shutil.which("ip") is not None, "iproute2's ip (Debian's iproute2)"),
    requires_tool(shutil.which("iptables") is not None, "iptables (Debian's iptables)"),
]

# The page's getStats: the selected candidate pair's two ends, the video's decoded frames. The page's peer
# connections are recorded as it makes them (an init script), so the test reads the page's own connection.
RECORD_PEERS = """(() => { const Made = window.RTCPeerConnection; window.peers = [];
  window.RTCPeerConnection = function (...a) { const pc = new Made(...a); window.peers.push(pc); return pc; };
  window.RTCPeerConnection.prototype = Made.prototype; })();"""
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


@dataclass(frozen=True)
class Nat:
    page_ns: str  # where the page runs: 10.79.N.2, its default route the NAT
    nat_ns: str  # the NAT: 10.79.N.1 towards the page, 10.78.N.2 towards this machine
    host: str  # this machine's end of the NAT's outside link: 10.78.N.1, where the bridge and coturn listen
    outside: str  # the NAT's end of it, 10.78.N.2: the page's packets leave the NAT from there

    def run(self, *args: str) -> None:
        subprocess.run(["ip", "netns", "exec", self.nat_ns, *args], check=True, capture_output=True, timeout=30)

    def forward_only(self, tcp_ports: list[int], udp_ports: list[int]) -> None:
        """The NAT forwards the page's new connections to these ports of `host` only (and their replies)."""
        self.run("iptables", "-F", "PAGE")
        for proto, ports in (("tcp", tcp_ports), ("udp", udp_ports)):
            for port in ports:
                self.run("iptables", "-A", "PAGE", "-d", self.host, "-p", proto, "--dport", str(port), "-j", "ACCEPT")


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def natted_namespace(tag: str, n: int) -> Iterator[Nat]:
    """The page's namespace <tag>p behind the NAT namespace <tag>r, joined to this machine by the veth <tag>h.
    The page's range is routed here to the NAT (which forwards nothing new to it), so no packet for it leaves this
    machine. Both namespaces, and with them the veths and the route, are deleted however the test ends."""
    nat = Nat(f"{tag}p", f"{tag}r", f"10.78.{n}.1", f"10.78.{n}.2")
    made = subprocess.run(["ip", "netns", "add", nat.nat_ns], capture_output=True, text=True)
    if made.returncode != 0:  # not root, or no CAP_SYS_ADMIN: where the whole suite must run, a failure
        why = f"cannot create a network namespace here: {made.stderr.strip()}"
        pytest.fail(why) if tools_required() else pytest.skip(why)
    try:
        ip("netns", "add", nat.page_ns)
        ip("link", "add", f"{tag}h", "type", "veth", "peer", "name", "wan", "netns", nat.nat_ns)
        ip("addr", "add", f"{nat.host}/24", "dev", f"{tag}h")
        ip("link", "set", f"{tag}h", "up")
        ip("link", "add", "lan", "netns", nat.nat_ns, "type", "veth", "peer", "name", "lan", "netns", nat.page_ns)
        for ns, dev, address in ((nat.nat_ns, "wan", nat.outside), (nat.nat_ns, "lan", f"10.79.{n}.1"),
                                 (nat.page_ns, "lan", f"10.79.{n}.2")):
            ip("-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", nat.page_ns, "route", "add", "default", "via", f"10.79.{n}.1")
        ip("-n", nat.nat_ns, "route", "add", "default", "via", nat.host)
        ip("route", "add", f"10.79.{n}.0/24", "via", nat.outside, "dev", f"{tag}h")
        nat.run("sysctl", "-w", "net.ipv4.ip_forward=1")
        nat.run("iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE")
        nat.run("iptables", "-P", "FORWARD", "DROP")
        nat.run("iptables", "-N", "PAGE")
        nat.run("iptables", "-A", "FORWARD", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT")
        nat.run("iptables", "-A", "FORWARD", "-i", "lan", "-o", "wan", "-j", "PAGE")
        yield nat
    finally:
        for ns in (nat.page_ns, nat.nat_ns):  # deleting the NAT's namespace deletes both veth pairs
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def nat() -> Iterator[Nat]:
    with natted_namespace(f"lbn{os.getpid() % 100000}", os.getpid() % 250) as made:
        yield made


@dataclass(frozen=True)
class Turn:
    port: int
    secret: Path
    log: Path


def answers_tcp(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False


@pytest.fixture(scope="module")
def turn(nat: Nat, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Turn]:
    """coturn on the host's side of the NAT, UDP and TCP on one port, with the TURN REST API's shared secret."""
    where = tmp_path_factory.mktemp("turn")
    made = Turn(free_port(), where / "turn.secret", where / "turnserver.log")
    made.secret.write_text(os.urandom(16).hex())
    with (where / "turnserver.out").open("wb") as out:
        proc = subprocess.Popen([TURNSERVER, "-n", "--listening-ip", nat.host, "--relay-ip", nat.host,
                                 "--listening-port", str(made.port), "--use-auth-secret",
                                 "--static-auth-secret", made.secret.read_text(), "--realm", "lingbot.test",
                                 "--fingerprint", "--no-tls", "--no-dtls", "--no-cli", "--no-multicast-peers",
                                 "--pidfile", str(where / "turnserver.pid"), "--userdb", str(where / "turndb"),
                                 "--log-file", str(made.log), "--simple-log", "--no-stdout-log", "--verbose"],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: answers_tcp(nat.host, made.port) or proc.poll() is not None, 30, "coturn to listen")
        assert proc.poll() is None, (where / "turnserver.out").read_text()
        yield made
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def bridge(sp1_server, nat: Nat, turn: Turn, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """The bridge on the host's side of the NAT, naming coturn over UDP and over TCP; yields (its URL, its port)."""
    log = tmp_path_factory.mktemp("bridge") / "bridge.log"
    with running_bridge(sp1_server.grpc_url, log, "--turn-secret-file", str(turn.secret),
                        "--ice-server", f"turn:{nat.host}:{turn.port}?transport=udp",
                        "--ice-server", f"turn:{nat.host}:{turn.port}?transport=tcp", host=nat.host) as base:
        yield base + "/", int(base.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def browser(nat: Nat):
    """Chromium run inside the page's namespace (Playwright drives it over its pipes, which `ip netns exec` keeps)."""
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as profile, sync_playwright() as p:
        inside = Path(profile) / "chromium-in-namespace"
        inside.write_text(f'#!/bin/sh\nexec ip netns exec {nat.page_ns} {CHROMIUM} "$@"\n')
        inside.chmod(0o755)
        context = p.chromium.launch_persistent_context(str(Path(profile) / "profile"), executable_path=str(inside),
                                                       args=CHROMIUM_ARGS, headless=True)
        context.add_init_script(RECORD_PEERS)
        yield context
        context.close()


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
