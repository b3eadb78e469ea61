"""The fleet's books (docs/security.md): what they add to a session's start, and a key's quota held across the fleet.

    python -m bench.books [--starts 2000] [--tries 20] [--no-fleet]

1. The admission's added latency per session start, in this process: what the owner's intake runs for a start
   (`Admission.session`, then `Leases.take`) with its group's books in process and with the fleet's books on a
   redis-server on loopback (run as the fleet runs its own). Two owners (two groups, each its own connection) take
   turns with a key of sessions=2 queue=0: starts admitted (each one's lease released at once: its end, timed too),
   and starts refused while the key's two seats are held, one by each group.
2. A fleet of 2 SP1 groups (tiny checkpoint) on its own books (`python -m backend.fleet --keys-file`): alice
   (sessions=2 queue=0) plays one world on each group; her third start, sent `--tries` times each to group 0, group 1
   and the balancer: how it is answered and how soon (request to refusal); beside it, time to first block of a start
   of alice's (the books asked) and of bob's (no limits: not asked), taking turns on group 0.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from backend.api.contract import USER_SESSION_LIMIT
from backend.api.errors import Refused
from backend.engine.validation import checked_spec
from backend.fleet.books_server import BooksServer
from backend.launch import keys as keys_tool
from backend.launch.polling import wait_for
from backend.parallel.ports import free_port
from backend.serving.admission import Admission
from backend.serving.keys import KeyRing, Quota
from backend.serving.leases import Leases
from backend.serving.sessions import Status
from backend.serving.settings import ServingSettings
from bench.common import (BUILD_DIR, TINY, engine_settings, ensure_checkpoint, format_table, make_request, percentile,
                          server_parameters)
from client.connection import Connection
from client.steer import SteeredSession
from client.stream import StreamError

ALICE = Quota(sessions=2, queue=0)


def ms(values: list[float]) -> tuple[str, str]:
    return f"{percentile(values, 50) * 1e3:.3f}", f"{percentile(values, 99) * 1e3:.3f}"


def timed(call: Callable[[], object]) -> float:
    began = time.perf_counter()
    call()
    return time.perf_counter() - began


def admission_latency(checkpoint: Path, starts: int) -> str:
    """Part 1: the start's admission with the books in process and in Redis, two owners taking turns."""
    spec = checked_spec(engine_settings(checkpoint, TINY, 1), 1)
    admission = Admission(ServingSettings(), spec)
    request = dataclasses.replace(make_request(TINY, decode=False), num_frames=None, poses=None, keys="w",
                                  sequence_id="1")
    text = f"alice sha256:{'0' * 64} {' '.join(ALICE.words())}\n"
    alice = KeyRing.parse(text).entries[0].principal
    rows = []

    def start(owner: Leases, sid: str) -> None:
        """What the owner's intake runs for a start: admission, then its lease in the books."""
        shared = admission.session(request, sid, 0, alice)
        if not owner.take(sid, alice):
            shared.status = Status.WAITING_SEAT

    with tempfile.TemporaryDirectory() as folder:
        server = BooksServer(Path(folder) / "books").start()
        try:
            for label, books in (("in process (a lone group)", None), ("Redis 7 on loopback, 2 groups", server)):
                owners = [Leases(None if books is None else books.connect(), 15.0, print) for _ in range(2)]
                admitted, ended, refused = [], [], []
                for n in range(starts):
                    owner, sid = owners[n % 2], f"a{n}"
                    admitted.append(timed(lambda: start(owner, sid)))  # noqa: B023 - called at once
                    ended.append(timed(lambda: owner.ended(sid)))  # noqa: B023
                if books is not None:  # the key's two seats held, one by each group
                    start(owners[0], "held0")
                    start(owners[1], "held1")
                    for n in range(starts):
                        owner, sid = owners[n % 2], f"r{n}"
                        refused.append(timed(lambda: _refused(lambda: start(owner, sid))))  # noqa: B023
                warm = slice(min(100, starts // 10), None)  # the first calls load the scripts, open the connections
                rows.append([label, *ms(admitted[warm]), *(ms(refused[warm]) if refused else ("-", "-")),
                             *ms(ended[warm])])
        finally:
            server.stop()
    return format_table(["books", "start admitted p50 ms", "p99 ms", "third start refused p50 ms", "p99 ms",
                         "its end (release) p50 ms", "p99 ms"], rows)


def _refused(call: Callable[[], object]) -> None:
    try:
        call()
    except Refused as exc:
        assert exc.refusal.code == USER_SESSION_LIMIT, exc.refusal
        return
    raise AssertionError("the third start was admitted")


@contextlib.contextmanager
def books_fleet(checkpoint: Path, out: Path) -> Iterator[tuple[dict, dict[str, str]]]:
    """A fleet of 2 SP1 groups on its own books; (fleet.json, name -> key)."""
    keys_file = out / "keys.txt"
    keys_file.unlink(missing_ok=True)
    keys = {"alice": keys_tool.add(keys_file, "alice", ALICE), "bob": keys_tool.add(keys_file, "bob", Quota())}
    parameters = server_parameters(engine_settings(checkpoint, TINY, 1)) | {"max_sessions": "3", "max_queue": "2"}
    for own in ("rendezvous_port", "snapshot_dir"):
        parameters.pop(own, None)
    with (out / "fleet.log").open("wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "backend.fleet", "--groups", "2", "--sp", "1", "--kind",
                                    "cpu", "--grpc-port", str(free_port()), "--out", str(out), "--keys-file",
                                    str(keys_file), *(a for k, v in parameters.items() for a in ("--param", f"{k}={v}"))],
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "fleet ready" in (out / "fleet.log").read_text() or process.poll() is not None, 300, "fleet")
        if process.poll() is not None:
            raise RuntimeError((out / "fleet.log").read_text())
        yield json.loads((out / "fleet.json").read_text()), keys
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


def first_answer(url: str, key: str) -> tuple[str, float]:
    """A new world's start: (its refusal's code, or "served"; seconds from its request to that answer)."""
    request = dataclasses.replace(make_request(TINY, decode=False), num_frames=None, poses=None, keys="w")
    with SteeredSession(url, connection=Connection(key=key)) as session:
        session.start(request)
        try:
            block = session.next_block(60)
            answer, at = "served", block.arrival_s
            session.end()
            session.next_block(60)
        except StreamError as exc:
            answer, at = exc.refusal.code if exc.refusal else str(exc), time.perf_counter()
    return answer, at - session.sent_s[0]


def across_the_fleet(checkpoint: Path, tries: int) -> str:
    """Part 2: alice's third start on each group and through the balancer, and a start's first block with and
    without the books asked."""
    out = BUILD_DIR / "bench_books"
    out.mkdir(parents=True, exist_ok=True)
    with books_fleet(checkpoint, out) as (fleet, keys):
        urls = {g["name"]: f"{g['host']}:{g['grpc_port']}" for g in fleet["groups"]} | {"balancer": fleet["grpc_url"]}
        rows = []
        with contextlib.ExitStack() as stack:
            playing = [stack.enter_context(SteeredSession(urls[name], connection=Connection(key=keys["alice"])))
                       for name in ("group0", "group1")]  # one world of alice's on each group
            for session in playing:
                session.start(dataclasses.replace(make_request(TINY, decode=False), num_frames=None, poses=None,
                                                  keys="w"))
                session.next_block(60)
            for name, url in urls.items():
                answers = [first_answer(url, keys["alice"]) for _ in range(tries)]
                codes = sorted({a for a, _ in answers})
                rows.append([f"alice's third start, sent to {name}", ", ".join(codes),
                             *ms([s for _, s in answers])])
            for session in playing:  # ended: their seats go with them
                session.end()
                session.next_block(60)
        served: dict[str, list[float]] = {"alice": [], "bob": []}
        for _ in range(tries):
            for name in served:
                answer, seconds = first_answer(urls["group0"], keys[name])
                assert answer == "served", answer
                served[name].append(seconds)
        rows += [["alice's start, her books asked: first block", "served", *ms(served["alice"])],
                 ["bob's start, no limits (books not asked): first block", "served", *ms(served["bob"])]]
    return format_table(["what (2 SP1 groups, tiny checkpoint)", "answer", "p50 ms", "p99 ms"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.books", description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=2000, help="starts of part 1, per kind")
    parser.add_argument("--tries", type=int, default=20, help="starts of part 2, per row")
    parser.add_argument("--no-fleet", action="store_true", help="part 1 only")
    args = parser.parse_args(argv)
    checkpoint = ensure_checkpoint(None, "tiny")
    print(admission_latency(checkpoint, args.starts), flush=True)
    if not args.no_fleet:
        print()
        print(across_the_fleet(checkpoint, args.tries), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
