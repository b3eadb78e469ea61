"""HAProxy in front of several groups: its configuration, and the haproxy process (fleet/supervisor.py runs both).

A session is one gRPC stream, so one HTTP/2 stream: HAProxy (`mode http`, `proto h2` on both sides) balances
streams, not connections, and a stream stays on the group it started on. `balance leastconn` counts each group's
open streams; each group's agent (launch/agent.py) scales its weight by its free slots (0 when every slot is held)
and drains it while its launcher moves its worlds elsewhere; its HTTP readiness is the health check. A group that
fails a check leaves the rotation at once (one check interval) and its streams are cut (`on-marked-down
shutdown-sessions`), so none of its clients waits on a stream nobody answers; it returns after two good checks.
Every group is listed twice: the second line is a backup that tracks the first (its state: up, down, drained) but
not its weight, used only while every first line is full, drained or down, so a session that meets every group
full still reaches one and waits in its queue (or gets CAPACITY_EXHAUSTED with a retry time when that queue is full),
and none reaches a draining group.

Open to the internet, the balancer terminates TLS (`BalancerTls`: ALPN h2, optionally mutual) and speaks HTTP/2 to
the groups on their private addresses. It refuses a stream whose first gRPC message (a session's start, which
carries the image) declares more than `max_request_bytes` (HTTP 413) from its 5-byte length prefix, before any
group reads a byte of it; HAProxy cannot frame the later messages of a stream (a step's) without an experimental
Lua filter, so those are not capped here (docs/security.md).
"""
from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..api.contract import MAX_INPUT_PIXELS, MODEL_NAME
from ..launch.server import terminate_with_parent

HAPROXY = "/usr/sbin/haproxy"  # Debian's package
STREAM_TIMEOUT = "1h"  # a stream may be quiet this long (a paused player renews its pause every 20 s)
# A start request's largest first message: the largest first frame the servers accept by default (MAX_INPUT_PIXELS
# RGB bytes), and 1 MiB for its other inputs (a prompt is at most 4 KiB, a whole trajectory's poses 64 B a frame).
MAX_REQUEST_BYTES = MAX_INPUT_PIXELS * 3 + 2**20
FIRST_MESSAGE_WAIT = "10s"  # how long the balancer waits for a stream's first 5 bytes before it forwards it


@dataclass(frozen=True)
class BalancerTls:
    """The balancer's TLS: `pem` holds its certificate chain and private key (HAProxy's `crt`); with `client_ca`,
    only clients with a certificate that CA signed may connect (mutual TLS)."""

    pem: Path
    client_ca: Path | None = None

    def bind(self) -> str:
        for path in (self.pem, self.client_ca):
            if path is not None and not Path(path).is_file():
                raise FileNotFoundError(f"TLS file {path} does not exist")
        verify = f" ca-file {Path(self.client_ca).resolve()} verify required" if self.client_ca else ""
        return f"ssl crt {Path(self.pem).resolve()} alpn h2{verify}"


@dataclass(frozen=True)
class GroupAddress:
    """Where the balancer reaches one group: its server's gRPC and HTTP ports and its agent's port."""

    name: str
    host: str
    grpc_port: int
    http_port: int
    agent_port: int

    @classmethod
    def parse(cls, text: str, name: str) -> GroupAddress:
        """HOST:GRPC:HTTP:AGENT (a group started elsewhere, e.g. on its own host)."""
        host, *ports = text.rsplit(":", 3)
        if len(ports) != 3 or not host or not all(p.isdigit() for p in ports):
            raise ValueError(f"--group {text!r}: expected HOST:GRPC_PORT:HTTP_PORT:AGENT_PORT")
        grpc, http, agent = map(int, ports)
        return cls(name, host, grpc, http, agent)

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"


@dataclass(frozen=True)
class DnsGroups:
    """Groups found by DNS (Kubernetes: deploy/kubernetes/): group i answers at `<prefix>-i.<domain>` (a
    StatefulSet's pod behind its headless Service), every one on the same ports; `slots` names are listed, each
    resolved again every check interval: a name that resolves is a group in the rotation, one that stops resolving
    (its pod gone) leaves it. `nameservers` ("HOST:PORT"); empty: the pod's own (/etc/resolv.conf)."""

    prefix: str
    domain: str
    slots: int
    grpc_port: int
    http_port: int
    agent_port: int
    nameservers: tuple[str, ...] = ()

    def host(self, i: int) -> str:
        return f"{self.prefix}-{i}.{self.domain}"


RESOLVERS = "groups"


def _resolvers(dns: DnsGroups, inter: str) -> list[str]:
    servers = [f"    nameserver dns{i} {ns}" for i, ns in enumerate(dns.nameservers)] or ["    parse-resolv-conf"]
    return ["resolvers " + RESOLVERS, *servers, "    resolve_retries 2", f"    timeout resolve {inter}",
            f"    timeout retry {inter}", f"    hold valid {inter}", f"    hold nx {inter}", f"    hold obsolete {inter}",
            "    accepted_payload_size 8192"]


def _dns_servers(dns: DnsGroups, checked: str, inter: str) -> list[str]:
    """Each slot's line and its backup: one name each (with `track`, which a server-template cannot give each of
    its servers); the two lines of one name share its address (allow-dup-ip)."""
    resolved = f"resolvers {RESOLVERS} init-addr none resolve-opts allow-dup-ip resolve-prefer ipv4"
    lines = [f"    server group{i} {dns.host(i)}:{dns.grpc_port} {checked} port {dns.http_port} weight 100 "
             f"agent-check agent-port {dns.agent_port} agent-inter {inter} {resolved}" for i in range(dns.slots)]
    lines += [f"    server group{i}-queue {dns.host(i)}:{dns.grpc_port} proto h2 track group{i} on-marked-down "
              f"shutdown-sessions backup {resolved}" for i in range(dns.slots)]
    return lines


def render_haproxy(groups: Sequence[GroupAddress] | DnsGroups, address: str, port: int, check_interval_s: float,
                   stats_socket: Path, model: str = MODEL_NAME, tls: BalancerTls | None = None,
                   max_request_bytes: int = MAX_REQUEST_BYTES, writer: str = "python -m backend.fleet") -> str:
    """The haproxy.cfg of a balancer on `address:port` in front of `groups` (listed, or found by DNS)."""
    inter = f"{round(check_interval_s * 1000)}ms"
    checked = f"proto h2 check check-proto h1 inter {inter} fall 1 rise 2 on-marked-down shutdown-sessions"
    lines = [
        f"# Written by {writer} (backend/fleet/balancer.py); rewritten at every start.",
        "global",
        f"    stats socket {stats_socket} mode 600 level user",
        "    log stderr format short local0 notice",
        "defaults",
        "    mode http",
        "    log global",
        "    timeout connect 2s",
        f"    timeout client {STREAM_TIMEOUT}",
        f"    timeout server {STREAM_TIMEOUT}",
        "    retries 2",
        "    option redispatch",  # a group that refuses the connection: the stream goes to another
        # A steered session is one long stream of small messages both ways: send each at once, not a full packet
        "    option http-no-delay",
        "frontend lingbot",
        f"    bind {address}:{port} {tls.bind() if tls else 'proto h2'}",
        # A gRPC message starts with a flag byte and its length (4 bytes, big-endian): the first message's is read
        # before anything is forwarded, and a stream that declares more than the cap never reaches a group.
        f"    http-request wait-for-body time {FIRST_MESSAGE_WAIT} at-least 5",
        "    http-request set-var(txn.first_message) req.body,bytes(1,4),be2dec(-,4)",
        f"    http-request deny deny_status 413 if {{ var(txn.first_message) -m int gt {max_request_bytes} }}",
        "    default_backend groups",
        "backend groups",
        "    balance leastconn",
        "    option allbackups",
        f"    option httpchk GET /v2/models/{model}/ready",
        "    http-check expect status 200",
    ]
    if isinstance(groups, DnsGroups):
        return "\n".join(lines[:1] + _resolvers(groups, inter) + lines[1:] + _dns_servers(groups, checked, inter)) + "\n"
    for g in groups:
        lines.append(f"    server {g.name} {g.grpc_url} {checked} port {g.http_port} weight 100 "
                     f"agent-check agent-addr {g.host} agent-port {g.agent_port} agent-inter {inter}")
    for g in groups:  # HAProxy passes an agent's drain (an admin state) on to a tracking line, not its weight
        lines.append(f"    server {g.name}-queue {g.grpc_url} proto h2 track {g.name} on-marked-down shutdown-sessions "
                     "backup")
    return "\n".join(lines) + "\n"


def haproxy_binary() -> str:
    found = shutil.which("haproxy") or (HAPROXY if Path(HAPROXY).is_file() else None)
    if found is None:
        raise FileNotFoundError("haproxy is not installed: apt-get install haproxy (Debian's package)")
    return found


def check_config(path: Path) -> None:
    """haproxy's own check of a configuration; ValueError with its words."""
    checked = subprocess.run([haproxy_binary(), "-c", "-q", "-f", str(path)], capture_output=True, text=True)
    if checked.returncode != 0:
        raise ValueError(f"haproxy refuses {path}:\n{checked.stderr.strip() or checked.stdout.strip()}")


def start_haproxy(config: Path, log_path: Path) -> subprocess.Popen[bytes]:
    """haproxy in the foreground (-db), logging to `log_path`, ended by the kernel if this process dies."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        return subprocess.Popen([haproxy_binary(), "-db", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=terminate_with_parent)


def server_stats(stats_socket: Path) -> dict[str, dict[str, str]]:
    """Each server line's row of HAProxy's `show stat` (status: UP, DOWN, DRAIN, ...; weight: its weight now),
    from its stats socket."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(2.0)
        sock.connect(str(stats_socket))
        sock.sendall(b"show stat\n")
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    header, *rows = b"".join(chunks).decode().splitlines()
    names = header.lstrip("# ").split(",")
    table = [dict(zip(names, row.split(","))) for row in rows if row]
    return {r["svname"]: r for r in table if r.get("svname") not in (None, "FRONTEND", "BACKEND")}


def server_states(stats_socket: Path) -> dict[str, str]:
    """Each server line's status as HAProxy sees it now (UP, DOWN, DRAIN, MAINT, ...)."""
    return {name: row["status"] for name, row in server_stats(stats_socket).items()}
