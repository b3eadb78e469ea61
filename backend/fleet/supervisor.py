"""Many groups behind one address: N sequence-parallel groups (each its own launcher and tritonserver) behind
HAProxy, one gRPC address for every client.

    python -m backend.fleet --groups 2 --sp 1 --kind cpu --param checkpoint=... --wait
    python -m backend.fleet --group host1:8001:8000:8003 --group host2:8001:8000:8003   # started elsewhere
    python -m backend.fleet restart --out build/fleet --group 0   # a running fleet's group (fleet/restart.py)
    python -m backend.fleet rolling-restart --out build/fleet     # every local group, one at a time

Local groups bind loopback on ports of their own; each serves its capacity to the balancer (launch/agent.py) and is
restarted when its launcher exits: at once when it was asked to (SIGTERM: it drained its worlds elsewhere first,
launch/drain.py), else (its tritonserver died) bounded restarts with backoff. Every group must serve one model
(fleet/one_model.py), checked before the balancer opens. The balancer (fleet/balancer.py) listens only on
`--address:--grpc-port`; SIGTERM drains and stops every group, then the balancer. What was started is written to
`--out`/fleet.json (ports, pids, logs, the bounds a restart waits for) for operators, `restart` and tests.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from ..api.contract import MODEL_NAME
from ..launch.drain import DRAIN_TIMEOUT_S
from ..launch.launcher import gpu_count, instance_count, parse_param
from ..launch.paths import BUILD_DIR, DEFAULT_BACKENDS_DIR
from ..launch.server import terminate_with_parent
from ..launch.wheel import prepare_backends
from ..parallel.ports import free_port, port_in_use
from .fleet_books import FleetBooks
from .balancer import (MAX_REQUEST_BYTES, BalancerTls, GroupAddress, check_config, render_haproxy, server_states,
                       start_haproxy)
from .one_model import check_one_model, read_parameters
from .restart import COMMANDS as RESTART_COMMANDS, main as restart_main

LOOPBACK = "127.0.0.1"
RESTARTS = 5  # a group's restarts in a row before the fleet leaves it down
FIRST_BACKOFF_S = 1.0  # doubles with each restart in a row, up to MAX_BACKOFF_S
MAX_BACKOFF_S = 30.0
STABLE_S = 30.0  # a group that has served this long since its start is no longer in a crash loop: its count clears
SUPERVISE_S = 0.5  # how often the fleet looks at its groups and its balancer
STOP_S = 10.0  # a launcher's stop after its drain (it takes at most ~4 s: docs/serving.md, "Stopping")
# A launcher's exit on SIGTERM (launcher.Termination; killed by it before its handler was set): asked for, no crash.
ASKED_EXITS = (143, -signal.SIGTERM)

log = logging.getLogger("backend.fleet")


class SupervisedGroup:
    """One local group: a launcher child process, restarted with backoff when it exits."""

    def __init__(self, address: GroupAddress, metrics_port: int, command: list[str], env: dict[str, str],
                 log_path: Path) -> None:
        self.address, self.metrics_port, self.command, self.env, self.log_path = (address, metrics_port, command, env,
                                                                                  log_path)
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.restarts = 0  # in a row: exits of a launcher whose group had not served STABLE_S since its start
        self.serving_since: float | None = None  # when its group first read ready since its start
        self.next_start_s: float | None = None  # a restart waiting out its backoff
        self.given_up = False

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out:
            self.process = subprocess.Popen(self.command, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True, preexec_fn=terminate_with_parent)
        self.starts += 1
        self.serving_since = None

    def ready(self) -> bool:
        url = f"http://{self.address.host}:{self.address.http_port}/v2/models/{MODEL_NAME}/ready"
        try:
            urllib.request.urlopen(url, timeout=1.0).close()
            return True
        except OSError:
            return False

    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def supervise(self, now: float) -> None:
        """Restart a launcher that exited: at once when it was asked to (a restart), else (its tritonserver died)
        after its backoff; give up after RESTARTS of those in a row. A group that served STABLE_S since its start
        (however it ended: a drain, a kill) clears the count, so faults spread over a group's life never add up."""
        if self.given_up:
            return
        if self.next_start_s is not None:
            if now >= self.next_start_s:
                self.next_start_s = None
                log.warning("%s: restarting its launcher (restart %d of %d)", self.address.name, self.restarts,
                            RESTARTS)
                self.start()
            return
        rc = self.exited()
        if self.serving_since is None and rc is None and self.ready():
            self.serving_since = now
        if self.serving_since is not None and now - self.serving_since >= STABLE_S:
            self.restarts = 0
        if rc is None:
            return
        if rc in ASKED_EXITS:  # the fleet's own stop gives up on the group first
            log.warning("%s: its launcher drained and stopped on SIGTERM; starting it again", self.address.name)
            self.start()
            return
        if self.restarts >= RESTARTS:
            self.given_up = True
            log.error("%s: its launcher exited with %d after %d restarts in a row; it stays down (log %s)",
                      self.address.name, rc, RESTARTS, self.log_path)
            return
        backoff = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** self.restarts)
        self.restarts += 1
        self.next_start_s = now + backoff
        log.warning("%s: its launcher exited with %d; restarting it in %g s (log %s)", self.address.name, rc,
                    backoff, self.log_path)

    def reload_keys(self) -> None:
        """SIGHUP to its launcher: it reloads its keys file (launch/launcher.py)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGHUP)

    def ask_stop(self) -> None:
        """SIGTERM the launcher (it stops its server) and restart it no more."""
        self.next_start_s, self.given_up = None, True
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait_stopped(self, deadline_s: float) -> None:
        """Kill the launcher's process group if it is still up at `deadline_s` (time.monotonic())."""
        if self.process is None:
            return
        try:
            self.process.wait(max(0.0, deadline_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s: its launcher did not stop in time; killed it", self.address.name)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def balancer_tls(args: argparse.Namespace) -> BalancerTls | None:
    if args.tls_client_ca is not None and args.tls_pem is None:
        raise ValueError("--tls-client-ca needs --tls-pem (mutual TLS is TLS first)")
    return None if args.tls_pem is None else BalancerTls(args.tls_pem, args.tls_client_ca)


def stop_groups(groups: Sequence[SupervisedGroup], stop_s: float) -> None:
    """Every group at once: each launcher drains (a group with snapshots) and stops within `stop_s`."""
    for g in groups:
        g.ask_stop()
    deadline = time.monotonic() + stop_s
    for g in groups:
        g.wait_stopped(deadline)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m backend.fleet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=0, help="local groups to start (each --sp instances)")
    parser.add_argument("--group", action="append", default=[], metavar="HOST:GRPC:HTTP:AGENT",
                        help="a group started elsewhere (python -m backend.launch --agent-port ...), repeatable")
    parser.add_argument("--sp", type=instance_count, default=1, help="model instances of each local group")
    parser.add_argument("--kind", choices=("cpu", "gpu", "auto"), default="auto",
                        help="of each local group; gpu gives group i the visible GPUs i*sp .. i*sp+sp-1")
    parser.add_argument("--param", type=parse_param, action="append", default=[], metavar="KEY=VALUE",
                        help="a config.pbtxt parameter of every local group (repeatable)")
    parser.add_argument("--address", default=LOOPBACK,
                        help="where the balancer listens (default: %(default)s, this host only; 0.0.0.0 opens it "
                             "to every network: see docs/security.md)")
    parser.add_argument("--grpc-port", type=int, default=8001, help="the balancer's gRPC port (default 8001)")
    parser.add_argument("--tls-pem", type=Path, help="the balancer speaks TLS only, with this PEM file: its "
                        "certificate chain and private key (docs/security.md)")
    parser.add_argument("--tls-client-ca", type=Path, help="mutual TLS: only clients with a certificate this PEM CA "
                        "signed may connect")
    parser.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
                        help="refuse a stream whose first message is larger (HTTP 413) before any group reads it "
                             "(default %(default)s: the largest first frame a server takes by default, and 1 MiB)")
    parser.add_argument("--keys-file", type=Path, help="every local group serves these users' keys only, their quotas "
                        "counted across the groups in the fleet's books; SIGHUP to the fleet pushes the file again and "
                        "every group takes it (docs/security.md)")
    parser.add_argument("--books-url", help="the fleet's books in an existing store (redis:// or rediss:// for TLS; "
                        "Redis or Valkey, no password in it) instead of a redis-server the fleet runs on loopback; "
                        "groups on other hosts share them with the same --books-url")
    parser.add_argument("--books-password-file", type=Path, help="the books' password, in a file readable by its "
                        "owner only")
    parser.add_argument("--books-ca", type=Path, help="the PEM CA that signed a rediss:// store's certificate")
    parser.add_argument("--drain-timeout-s", type=float, default=DRAIN_TIMEOUT_S,
                        help="each local launcher's bound on its drain at SIGTERM (a restart, or the fleet's stop), "
                             "before it stops (default %(default)g s: backend/launch/drain.py)")
    parser.add_argument("--check-interval", type=float, default=1.0,
                        help="seconds between the balancer's checks of each group (default 1)")
    parser.add_argument("--out", type=Path, default=BUILD_DIR / "fleet",
                        help="haproxy.cfg, fleet.json and every log (default build/fleet)")
    parser.add_argument("--wait-timeout", type=float, default=600.0, help="seconds the groups may take to load")
    parser.add_argument("--render-only", action="store_true",
                        help="with --group only: write haproxy.cfg, print its path and exit (haproxy run elsewhere)")
    return parser


def visible_gpus() -> list[str]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES where set, else every one `nvidia-smi -L` lists."""
    if (visible := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
        return [d for d in visible.split(",") if d.strip()]
    return [str(d) for d in range(gpu_count())]


def local_groups(args: argparse.Namespace, books: FleetBooks | None = None) -> list[SupervisedGroup]:
    """The launchers of `--groups`, each on free loopback ports (on the fleet's `books` where it keeps them)."""
    gpus = visible_gpus() if args.kind in ("gpu", "auto") else []
    on_gpu = args.kind == "gpu" or (args.kind == "auto" and bool(gpus))
    if on_gpu and len(gpus) < args.groups * args.sp:
        raise ValueError(f"--groups {args.groups} --sp {args.sp} needs {args.groups * args.sp} GPUs; "
                         f"{len(gpus)} are visible")
    if not args.groups:
        return []  # a balancer of groups started elsewhere needs no tritonserver here
    backends = prepare_backends(DEFAULT_BACKENDS_DIR)  # once, before the launchers share it
    groups = []
    for i in range(args.groups):
        name, out = f"group{i}", args.out / f"group{i}"
        grpc, http, metrics, agent = (free_port() for _ in range(4))
        # Its own rendezvous port, SP1 too: a server's instances claim their rank on this host by that port.
        params = [f"{k}={v}" for k, v in args.param] + [f"rendezvous_port={free_port()}"]
        if "snapshot_dir" not in dict(args.param):  # one store for every group: a world resumes on any of them
            params.append(f"snapshot_dir={(args.out / 'snapshots').resolve()}")
        command = [sys.executable, "-m", "backend.launch", "--sp", str(args.sp), "--kind", "gpu" if on_gpu else "cpu",
                   "--address", LOOPBACK, "--grpc-port", str(grpc), "--http-port", str(http),
                   "--metrics-port", str(metrics), "--agent-port", str(agent), "--backends-out", str(backends),
                   "--repository-out", str(out / "model_repository"), "--log-file", str(out / "tritonserver.log"),
                   "--admin-key-file", str(out / "admin.key"), "--drain-timeout-s", str(args.drain_timeout_s),
                   *(a for p in params for a in ("--param", p)),
                   *(books.launcher_args() if books is not None else
                     ["--keys-file", str(args.keys_file.resolve())] if args.keys_file else [])]
        env = dict(os.environ)
        if on_gpu:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i * args.sp:(i + 1) * args.sp])
        groups.append(SupervisedGroup(GroupAddress(name, LOOPBACK, grpc, http, agent), metrics, command, env,
                                      out / "launcher.log"))
    return groups


def wait_ready(groups: Sequence[SupervisedGroup], timeout_s: float, stop: threading.Event) -> None:
    """Until every group reads ready (or `stop` is set); names a launcher that exits first."""
    deadline = time.monotonic() + timeout_s
    waiting = list(groups)
    while waiting and not stop.is_set():
        for g in list(waiting):
            if (rc := g.exited()) is not None:
                tail = "\n".join(g.log_path.read_text(errors="replace").splitlines()[-15:])
                raise RuntimeError(f"{g.address.name}'s launcher exited with {rc} before it was ready "
                                   f"(log {g.log_path}):\n{tail}")
            if g.ready():
                waiting.remove(g)
        if waiting and time.monotonic() > deadline:
            raise TimeoutError(f"{', '.join(g.address.name for g in waiting)} not ready after {timeout_s:.0f} s "
                               f"(logs under {waiting[0].log_path.parent.parent})")
        stop.wait(0.25)


def wait_balancing(haproxy: subprocess.Popen[bytes], stats_socket: Path, names: Sequence[str],
                   stop: threading.Event, timeout_s: float = 30.0) -> None:
    """Until haproxy has checked every group UP (two good checks each), so a client can connect now."""
    deadline = time.monotonic() + timeout_s
    while not stop.wait(0.1):
        if (rc := haproxy.poll()) is not None:
            raise RuntimeError(f"haproxy exited with {rc} at start (log {stats_socket.parent / 'haproxy.log'})")
        with contextlib.suppress(OSError):
            if all(server_states(stats_socket).get(name) == "UP" for name in names):
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"haproxy did not see every group UP within {timeout_s:.0f} s "
                               f"(log {stats_socket.parent / 'haproxy.log'})")


def write_manifest(path: Path, args: argparse.Namespace, addresses: Sequence[GroupAddress],
                   groups: Sequence[SupervisedGroup], haproxy: subprocess.Popen[bytes]) -> None:
    local = {g.address.name: g for g in groups}
    entries = []
    for a in addresses:
        entry: dict[str, object] = {"name": a.name, "host": a.host, "grpc_port": a.grpc_port,
                                    "http_port": a.http_port, "agent_port": a.agent_port}
        if (g := local.get(a.name)) is not None and g.process is not None:
            entry |= {"metrics_port": g.metrics_port, "launcher_pid": g.process.pid, "log": str(g.log_path)}
        entries.append(entry)
    host = LOOPBACK if args.address in ("0.0.0.0", "::", "") else args.address  # where a client here connects
    manifest = {"grpc_url": f"{host}:{args.grpc_port}", "fleet_pid": os.getpid(), "haproxy_pid": haproxy.pid,
                "stats_socket": str(args.out / "haproxy.sock"), "launcher_stop_s": launcher_stop_s(args),
                "wait_timeout_s": args.wait_timeout, "groups": entries}
    partial = path.with_suffix(".partial")  # whole or not at all: `restart` reads it while the fleet runs
    partial.write_text(json.dumps(manifest, indent=2) + "\n")
    partial.replace(path)


def launcher_stop_s(args: argparse.Namespace) -> float:
    """The most a local launcher takes from SIGTERM to its exit: its drain, then its stop."""
    return args.drain_timeout_s + STOP_S


def serve(args: argparse.Namespace) -> int:
    if args.groups < 0 or args.groups + len(args.group) == 0:
        raise ValueError("give --groups N (local groups) or --group HOST:GRPC:HTTP:AGENT (repeatable)")
    args.out.mkdir(parents=True, exist_ok=True)
    remote = [GroupAddress.parse(text, f"remote{i}") for i, text in enumerate(args.group)]
    config = args.out / "haproxy.cfg"
    if args.render_only:
        if args.groups:
            raise ValueError("--render-only balances groups started elsewhere: give --group, not --groups")
        config.write_text(render_haproxy(remote, args.address, args.grpc_port, args.check_interval,
                                         args.out / "haproxy.sock", tls=balancer_tls(args),
                                         max_request_bytes=args.max_request_bytes))
        check_config(config)
        print(config)
        return 0
    if port_in_use(args.grpc_port):
        raise ValueError(f"--grpc-port {args.grpc_port} is in use on this host: pass a free one")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    books = FleetBooks.of(args)
    groups = local_groups(args, books)
    with contextlib.ExitStack() as stack:
        if books is not None:  # last down: the groups' leases go with them
            books.start()
            stack.callback(books.stop)
            signal.signal(signal.SIGHUP, lambda *_: books.keys_file and books.push_keys("SIGHUP"))
        else:
            signal.signal(signal.SIGHUP, lambda *_: [g.reload_keys() for g in groups])
        stack.callback(stop_groups, groups, launcher_stop_s(args))  # should the balancer never start
        for g in groups:
            g.start()
        print(f"starting {len(groups)} group(s) of {args.sp} instance(s); logs under {args.out}", flush=True)
        wait_ready(groups, args.wait_timeout, stop)
        if stop.is_set():
            return 143
        addresses = [g.address for g in groups] + remote
        check_one_model({f"{a.name} ({a.grpc_url})": read_parameters(a.grpc_url) for a in addresses})
        config.write_text(render_haproxy(addresses, args.address, args.grpc_port, args.check_interval,
                                         args.out / "haproxy.sock", tls=balancer_tls(args),
                                         max_request_bytes=args.max_request_bytes))
        check_config(config)
        haproxy = start_haproxy(config, args.out / "haproxy.log")
        stack.callback(_stop_haproxy, haproxy)
        # First on the way out (callbacks run last first): the groups drain while the balancer still carries their
        # clients' MOVED; the snapshots stay in the fleet's store for when it is back.
        stack.callback(stop_groups, groups, launcher_stop_s(args))
        wait_balancing(haproxy, args.out / "haproxy.sock", [a.name for a in addresses], stop)
        write_manifest(args.out / "fleet.json", args, addresses, groups, haproxy)
        print(f"fleet ready: {len(addresses)} group(s) behind {args.address}:{args.grpc_port} (haproxy pid "
              f"{haproxy.pid}, {args.out / 'fleet.json'})", flush=True)
        starts = sum(g.starts for g in groups)
        while not stop.wait(SUPERVISE_S):
            if (rc := haproxy.poll()) is not None:
                raise RuntimeError(f"haproxy exited with {rc} (log {args.out / 'haproxy.log'})")
            now = time.monotonic()
            for g in groups:
                g.supervise(now)
            if books is not None:
                books.supervise()
            if (started := sum(g.starts for g in groups)) != starts:  # a restarted launcher has a new pid
                starts = started
                write_manifest(args.out / "fleet.json", args, addresses, groups, haproxy)
        print("SIGTERM: draining and stopping every group, then the balancer", flush=True)
    return 143


def _stop_haproxy(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(2.0)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in RESTART_COMMANDS:
        return restart_main(argv)
    args = build_parser().parse_args(argv)
    try:
        return serve(args)
    except (FileNotFoundError, ValueError, RuntimeError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
