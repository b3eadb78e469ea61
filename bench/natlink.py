"""A page's network for the tests and benches of the player across a NAT: headless Chromium in a network namespace of
its own (a private range) behind a masquerading NAT in a second namespace, this machine's side joined to the NAT by
a veth; Debian's coturn on this machine's side; and the page's link made bad inside the NAT's namespace (`Link`), so
no interface of this machine's own is ever shaped. Root (or CAP_NET_ADMIN) only.
"""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from backend.launch.paths import REPO_ROOT
from backend.parallel.ports import free_port

TURNSERVER = "/usr/bin/turnserver"  # Debian's coturn
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
DELAY_QUEUE = 7  # the NFQUEUE number the NAT's delay listens on (its own namespace's queues)

# The page's peer connections, recorded as it makes them (a page init script), so getStats reads its own.
RECORD_PEERS = """(() => { const Made = window.RTCPeerConnection; window.peers = [];
  window.RTCPeerConnection = function (...a) { const pc = new Made(...a); window.peers.push(pc); return pc; };
  window.RTCPeerConnection.prototype = Made.prototype; })();"""


class NoNamespace(RuntimeError):
    """A network namespace cannot be made here (not root, or no CAP_SYS_ADMIN)."""


@dataclass(frozen=True)
class Nat:
    page_ns: str  # where the page runs: 10.79.N.2, its default route the NAT
    nat_ns: str  # the NAT: 10.79.N.1 towards the page (`lan`), 10.78.N.2 towards this machine (`wan`)
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
    machine. Both namespaces, and with them the veths and the route, are deleted however it ends."""
    nat = Nat(f"{tag}p", f"{tag}r", f"10.78.{n}.1", f"10.78.{n}.2")
    made = subprocess.run(["ip", "netns", "add", nat.nat_ns], capture_output=True, text=True)
    if made.returncode != 0:
        raise NoNamespace(f"cannot create a network namespace here: {made.stderr.strip()}")
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


@dataclass(frozen=True)
class Turn:
    port: int
    secret: Path
    log: Path


def answers_tcp(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


@contextlib.contextmanager
def running_turn(nat: Nat, where: Path) -> Iterator[Turn]:
    """coturn on the host's side of the NAT, UDP and TCP on one port, with the TURN REST API's shared secret."""
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
        wait_for(lambda: answers_tcp(nat.host, made.port) or proc.poll() is not None, 30, "coturn to listen")
        if proc.poll() is not None:
            raise RuntimeError((where / "turnserver.out").read_text())
        yield made
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def bridge_args(nat: Nat, turn: Turn) -> list[str]:
    """The bridge's arguments naming coturn over UDP and over TCP, with its shared secret."""
    return ["--turn-secret-file", str(turn.secret), "--ice-server", f"turn:{nat.host}:{turn.port}?transport=udp",
            "--ice-server", f"turn:{nat.host}:{turn.port}?transport=tcp"]


@contextlib.contextmanager
def browser_in(nat: Nat, chromium: str) -> Iterator[object]:
    """Chromium run inside the page's namespace (Playwright drives it over its pipes, which `ip netns exec` keeps),
    recording its peer connections."""
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as profile, sync_playwright() as p:
        inside = Path(profile) / "chromium-in-namespace"
        inside.write_text(f'#!/bin/sh\nexec ip netns exec {nat.page_ns} {chromium} "$@"\n')
        inside.chmod(0o755)
        context = p.chromium.launch_persistent_context(str(Path(profile) / "profile"), executable_path=str(inside),
                                                       args=CHROMIUM_ARGS, headless=True)
        context.add_init_script(RECORD_PEERS)
        try:
            yield context
        finally:
            context.close()


class Link:
    """The page's link, made bad in the NAT's namespace: a delay each way (iptables NFQUEUE to bench.link_delay,
    as this kernel has no netem), random loss towards the page (iptables' statistic match) and a rate cap towards
    the page (a tbf qdisc on the NAT's `lan`). `set` replaces the whole setting; `clear` (and leaving the `with`)
    puts the link back as it was."""

    def __init__(self, nat: Nat) -> None:
        self.nat = nat
        self._delay: subprocess.Popen | None = None

    def __enter__(self) -> Link:
        self.nat.run("iptables", "-t", "mangle", "-N", "LINK")
        self.nat.run("iptables", "-t", "mangle", "-A", "FORWARD", "-j", "LINK")
        return self

    def __exit__(self, *exc: object) -> None:
        self.clear()

    def set(self, delay_ms: float = 0, loss: float = 0, rate_kbit: int | None = None) -> None:
        """delay_ms: each way (so the round trip is twice it); loss: the share of packets towards the page
        dropped; rate_kbit: the most towards the page (a burst of 50 ms at it), its queue at most 200 ms long."""
        self.clear()
        if loss:
            self.nat.run("iptables", "-t", "mangle", "-A", "LINK", "-o", "lan", "-m", "statistic", "--mode",
                         "random", "--probability", str(loss), "-j", "DROP")
        if delay_ms:
            self._delay = subprocess.Popen(["ip", "netns", "exec", self.nat.nat_ns, sys.executable, "-m",
                                            "bench.link_delay", "--queue", str(DELAY_QUEUE), "--delay-ms",
                                            str(delay_ms)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, text=True)  # ip netns exec execs it
            if self._delay.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the link's delay did not start: {self._delay.stdout.read()}")
            self.nat.run("iptables", "-t", "mangle", "-A", "LINK", "-j", "NFQUEUE", "--queue-num", str(DELAY_QUEUE))
        if rate_kbit:
            burst = max(1600, rate_kbit * 1000 // 8 // 20)  # bytes: 50 ms at the rate, at least a packet
            self.nat.run("tc", "qdisc", "replace", "dev", "lan", "root", "tbf", "rate", f"{rate_kbit}kbit",
                         "burst", str(burst), "latency", "200ms")

    def clear(self) -> None:
        self.nat.run("iptables", "-t", "mangle", "-F", "LINK")
        subprocess.run(["ip", "netns", "exec", self.nat.nat_ns, "tc", "qdisc", "del", "dev", "lan", "root"],
                       capture_output=True, timeout=30)  # none there is no failure
        if self._delay is not None:
            self._delay.terminate()
            self._delay.wait(timeout=30)
            self._delay = None

