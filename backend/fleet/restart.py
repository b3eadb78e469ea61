"""Restart the groups of a running fleet without losing a world (docs/scale-out.md, "Drain and restart").

    python -m backend.fleet restart --out build/fleet --group 0
    python -m backend.fleet rolling-restart --out build/fleet

A group's launcher is sent SIGTERM: it drains (its agent takes it out of the balancer's rotation, every steered
session is saved and ends MOVED, its client resumes through the balancer on another group: launch/drain.py) and
stops. The fleet's supervisor starts it again at once (an asked restart is no crash: no backoff, not counted), and
the command waits until the balancer has the group back in rotation. A rolling restart does every local group in
turn, each back before the next drains. What it reads is the running fleet's `fleet.json` (pids, ports, bounds).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..serving.parent_watch import alive
from ..launch.paths import BUILD_DIR
from ..launch.polling import wait_for
from .balancer import server_states

COMMANDS = ("restart", "rolling-restart")
POLL_S = 0.2
# The fleet's supervisor looks at its groups every 0.5 s (supervisor.SUPERVISE_S) and rewrites fleet.json at a start.
RESTARTED_S = 10.0


@dataclass(frozen=True)
class Restarted:
    name: str
    sigterm_s: float  # time.monotonic() when its launcher was sent SIGTERM
    stopped_s: float  # from SIGTERM to the launcher's exit (its drain and its stop)
    back_s: float  # from SIGTERM to the group back in the balancer's rotation


def read_manifest(out: Path) -> dict[str, Any]:
    path = out / "fleet.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist: is a fleet running with --out {out}?") from None


def parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def launcher_of(manifest: dict[str, Any], name: str) -> int:
    """The pid of the group's launcher, checked to be a live child of the running fleet (never a stale pid's
    successor)."""
    group = next((g for g in manifest["groups"] if g["name"] == name), None)
    if group is None:
        raise ValueError(f"no group {name} in this fleet (groups: {', '.join(g['name'] for g in manifest['groups'])})")
    fleet_pid, pid = manifest["fleet_pid"], group["launcher_pid"]
    if not alive(fleet_pid):
        raise ValueError(f"the fleet (pid {fleet_pid}) is not running: nothing would start {name} again")
    if not alive(pid) or parent_of(pid) != fleet_pid:
        raise ValueError(f"{name}'s launcher (pid {pid}) is not running: the fleet restarts it by itself, or gave up "
                         f"on it (its log: {group.get('log')})")
    return pid


def in_rotation(stats_socket: Path, name: str) -> bool:
    with contextlib.suppress(OSError):
        return server_states(stats_socket).get(name) == "UP"
    return False


def restart(out: Path, name: str) -> Restarted:
    """Drain and restart one local group of the fleet running with `--out out`; back when the balancer has it UP."""
    manifest = read_manifest(out)
    pid = launcher_of(manifest, name)
    others = [g["name"] for g in manifest["groups"] if g["name"] != name]
    stats = Path(manifest["stats_socket"])
    if not any(in_rotation(stats, other) for other in others):
        print(f"warning: no other group is in rotation: {name}'s worlds wait for its return to resume", flush=True)
    began = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    stopped_s = wait_for(lambda: not alive(pid), manifest["launcher_stop_s"] + RESTARTED_S,
                         f"{name}'s launcher (pid {pid}) stopping after SIGTERM", POLL_S)
    print(f"{name}: drained and stopped {stopped_s:.1f} s after SIGTERM", flush=True)
    wait_for(lambda: launcher_pid(out, name) not in (None, pid), RESTARTED_S, f"the fleet starting {name} again",
             POLL_S)
    wait_for(lambda: in_rotation(stats, name), manifest["wait_timeout_s"], f"{name} back in the balancer's rotation",
             POLL_S)
    back_s = time.monotonic() - began
    print(f"{name}: back in rotation {back_s:.1f} s after SIGTERM", flush=True)
    return Restarted(name, began, stopped_s, back_s)


def launcher_pid(out: Path, name: str) -> int | None:
    return next((g.get("launcher_pid") for g in read_manifest(out)["groups"] if g["name"] == name), None)


def rolling_restart(out: Path) -> list[Restarted]:
    """Every local group of the fleet in turn, each back in rotation before the next drains."""
    local = [g["name"] for g in read_manifest(out)["groups"] if "launcher_pid" in g]
    if not local:
        raise ValueError("this fleet has no local group to restart")
    return [restart(out, name) for name in local]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m backend.fleet",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=COMMANDS)
    parser.add_argument("--out", type=Path, default=BUILD_DIR / "fleet",
                        help="the running fleet's --out (its fleet.json; default build/fleet)")
    parser.add_argument("--group", type=int, metavar="N", help="restart: the local group N (groupN in fleet.json)")
    return parser


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "restart":
            if args.group is None:
                raise ValueError("restart needs --group N")
            restart(args.out, f"group{args.group}")
            return 0
        if args.group is not None:
            raise ValueError("rolling-restart restarts every local group: leave --group out")
        done = rolling_restart(args.out)
        print(f"rolling restart done: {', '.join(r.name for r in done)}", flush=True)
        return 0
    except (ValueError, TimeoutError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
