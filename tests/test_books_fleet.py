"""One fleet, one set of books (docs/security.md): `python -m backend.fleet` with two real SP1 tritonservers behind
HAProxy, on a real redis-server this module starts and hands the fleet (`--books-url`, a password file), with keys:
alice's quotas hold across both groups, whichever group her next start reaches; another key's resume is refused and
a shared snapshot resumes on the other group; a revoked key ends on every group; the books stopped refuse new
sessions with a code while running ones go on, and serve again once started; a group whose instance dies frees its
key's seats within the lease. One fleet for the module; its last test kills a group's instance."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from backend.api import contract as c
from backend.api.refusal import Refusal
from backend.api.request import Controls, SavesRequest
from backend.fleet.balancer import HAPROXY
from backend.fleet.books_server import BooksServer
from backend.launch import keys as keys_tool
from backend.launch.procfs import stub_pids, tritonserver_of
from backend.parallel.ports import free_port
from backend.serving.keys import Quota
from client.connection import Connection
from client.saves import key_saves
from client.steer import SteeredSession
from backend.api.codec import request_arrays, request_parameters
from client.stream import StreamError, pack_inputs
from books_harness import requires_redis, running_books
from factories import tiny_request
from polling import wait_until
from system_tools import requires_tool
from triton_harness import tiny_parameters

ROOT = Path(__file__).resolve().parent.parent
LEASE_S = 3.0  # the groups' books_lease_s: a dead instance's seats free within it
LIMITS = {"alice": Quota(sessions=2, queue=0), "bob": Quota(), "carol": Quota()}

pytestmark = [pytest.mark.server, requires_redis,
              requires_tool(Path(HAPROXY).is_file(), f"HAProxy at {HAPROXY} (Debian's haproxy)")]


@dataclass
class Fleet:
    process: subprocess.Popen[bytes]
    url: str  # the balancer
    groups: list[str]  # each group's own gRPC address
    keys: dict[str, str]  # name -> key
    keys_file: Path
    books: BooksServer
    log: Path

    def connection(self, name: str) -> Connection:
        return Connection(key=self.keys[name])


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: str) -> Iterator[Fleet]:
    out = tmp_path_factory.mktemp("books_fleet")
    keys_file = out / "keys.txt"
    keys = {name: keys_tool.add(keys_file, name, quota) for name, quota in LIMITS.items()}
    parameters = tiny_parameters(tiny_checkpoint, 1, max_sessions="3", max_queue="1", max_batch="1",
                                 books_lease_s=str(LEASE_S), session_idle_timeout_s="20")
    for own in ("rendezvous_port", "snapshot_dir"):  # the fleet gives each group its own port, and all one store
        parameters.pop(own)
    log = out / "fleet.log"
    with running_books(out / "books") as books, log.open("wb") as sink:
        began = time.monotonic()
        process = subprocess.Popen(
            [sys.executable, "-m", "backend.fleet", "--groups", "2", "--sp", "1", "--kind", "cpu",
             "--grpc-port", str(free_port()), "--check-interval", "0.5", "--out", str(out / "build"),
             "--keys-file", str(keys_file), "--books-url", books.address.url,
             "--books-password-file", str(books.password_file),
             *(a for k, v in parameters.items() for a in ("--param", f"{k}={v}"))],
            cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: "fleet ready" in log.read_text() or process.poll() is not None, 150, "the fleet")
            assert process.poll() is None, log.read_text()
            manifest = json.loads((out / "build" / "fleet.json").read_text())
            groups = [f"{g['host']}:{g['grpc_port']}" for g in manifest["groups"]]
            print(f"fleet of 2 SP1 groups on the books ready after {time.monotonic() - began:.1f} s")
            yield Fleet(process, manifest["grpc_url"], groups, keys, keys_file, books, log)
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(60)


def first_block_or_refusal(session: SteeredSession, timeout: float = 60) -> Refusal | None:
    """Start a new world on `session`: None once its first block came, else the server's refusal."""
    request = dataclasses.replace(tiny_request(num_frames=9, decode=False), num_frames=None, poses=None, keys="w")
    session.start(request)
    try:
        assert session.next_block(timeout) is not None
        return None
    except StreamError as exc:
        assert exc.refusal is not None, exc
        return exc.refusal


@contextlib.contextmanager
def playing(url: str, connection: Connection, **options) -> Iterator[SteeredSession]:
    """A world that has its first block and keeps its slot (a paused player) until the block ends."""
    with SteeredSession(url, connection=connection, **options) as session:
        assert first_block_or_refusal(session) is None
        yield session
        with contextlib.suppress(StreamError):
            session.end()
            session.next_block(30)


def refused(url: str, connection: Connection) -> Refusal | None:
    """A new world's refusal, or None: it was served its first block, then ended (its seat freed at once)."""
    with SteeredSession(url, connection=connection) as session:
        refusal = first_block_or_refusal(session)
        if refusal is None:
            session.end()
            session.next_block(30)
        return refusal


def test_a_key_s_sessions_hold_across_both_groups_whichever_its_next_start_reaches(fleet: Fleet) -> None:
    alice = fleet.connection("alice")
    group0, group1 = fleet.groups
    with playing(group0, alice), playing(group1, alice) as second:
        for url in (group0, group1, fleet.url):  # each group has room (3 slots): the books refuse it
            refusal = refused(url, alice)
            assert refusal is not None and refusal.code == c.USER_SESSION_LIMIT, (url, refusal)
        assert refused(group0, fleet.connection("bob")) is None  # another key's quotas are its own
        second.end()
        second.next_block(30)
        assert refused(group0, alice) is None  # the seat it freed, on the other group


FLOOD = 200


def test_a_flood_of_refused_starts_costs_a_refusal_each_and_leaks_no_seat(fleet: Fleet) -> None:
    """alice at her two seats (one world on each group) sends FLOOD starts down one stream to group 0: each is
    refused USER_SESSION_LIMIT by the books before any work, her seats stay two, and the group serves bob at once."""
    alice = fleet.connection("alice")
    group0, group1 = fleet.groups
    books = fleet.books.connect()
    wait_until(lambda: books.held("alice") == (0, 0), 10, "alice's earlier sessions' seats released")
    request = dataclasses.replace(tiny_request(num_frames=9, decode=False), num_frames=None, poses=None, keys="w")
    answers: queue.Queue = queue.Queue()
    with playing(group0, alice), playing(group1, alice):
        with alice.client(group0) as client:
            client.start_stream(callback=lambda result, error: answers.put(error), headers=alice.headers())
            began = time.monotonic()
            for n in range(FLOOD):
                client.async_stream_infer(c.MODEL_NAME, pack_inputs(request_arrays(request)),
                                          parameters=request_parameters(request), sequence_id=10_000 + n,
                                          sequence_start=True, sequence_end=True)
            errors = [answers.get(timeout=60) for _ in range(FLOOD)]
            took = time.monotonic() - began
            client.stop_stream()
        codes = {Refusal.parse(e.message()).code for e in errors if e is not None}
        assert None not in errors and codes == {c.USER_SESSION_LIMIT}, codes
        assert books.held("alice") == (2, 0)
        assert refused(group0, fleet.connection("bob")) is None
    print(f"{FLOOD} refused starts answered in {took:.2f} s")


def test_another_key_s_resume_is_refused_and_a_shared_snapshot_resumes_on_the_other_group(fleet: Fleet) -> None:
    alice, bob = fleet.connection("alice"), fleet.connection("bob")
    group0, group1 = fleet.groups
    saved: list = []
    with playing(group0, alice, on_snapshot=saved.append) as world:
        world.step(Controls(keys="w"), save=True)
        assert world.next_block(60) is not None
        wait_until(lambda: saved, 30, "the save's outcome")
    (notice,) = saved
    assert notice.error is None, notice.error
    snapshot_id = notice.snapshot_id

    def resumed(connection: Connection) -> Refusal | None:
        with SteeredSession(group1, connection=connection) as session:
            session.resume(snapshot_id, Controls(keys="w"))
            try:
                session.next_block(60)
                session.end()
                session.next_block(30)
                return None
            except StreamError as exc:
                return exc.refusal

    assert resumed(bob).code == c.SNAPSHOT_NOT_YOURS
    with pytest.raises(StreamError) as caught:  # nor may bob share it
        key_saves(group1, bob, SavesRequest("share", snapshot_id))
    assert caught.value.refusal.code == c.SNAPSHOT_NOT_YOURS
    listing = key_saves(group1, alice, SavesRequest("share", snapshot_id))  # its owner, through the other group
    (entry,) = [s for s in listing["snapshots"] if s["id"] == snapshot_id]
    assert entry["shared"] and entry["bytes"] > 0 and listing["bytes"] >= entry["bytes"]
    assert resumed(bob) is None
    assert snapshot_id not in [s["id"] for s in key_saves(group0, bob)["snapshots"]]


def test_a_revoked_key_ends_on_every_group(fleet: Fleet) -> None:
    """carol plays on both groups; her line leaves the keys file and the fleet gets SIGHUP: both sessions end with
    AUTH_INVALID within the bound (a launcher's poll of the books, its instances' watch, a block boundary), and her
    key opens neither group again."""
    carol = fleet.connection("carol")
    with playing(fleet.groups[0], carol) as first, playing(fleet.groups[1], carol) as second:
        keys_tool.remove(fleet.keys_file, "carol")
        fleet.process.send_signal(signal.SIGHUP)
        revoked = time.monotonic()
        ended = []
        for session in (first, second):
            session.step(Controls(keys="w"))  # the next boundary after the revocation ends it
            with pytest.raises(StreamError) as caught:
                while True:
                    session.next_block(30)
                    session.step(Controls(keys="w"))
            ended.append(time.monotonic() - revoked)
            assert caught.value.refusal.code == c.AUTH_INVALID, caught.value
    assert max(ended) < 5.0, ended
    for url in fleet.groups:
        assert refused(url, carol).code == c.AUTH_INVALID
    print(f"revoked key's sessions ended on both groups {ended[0]:.1f} s and {ended[1]:.1f} s after SIGHUP")


def test_the_books_stopped_refuse_new_sessions_running_ones_go_on_and_started_serve_again(fleet: Fleet) -> None:
    alice = fleet.connection("alice")
    group0, group1 = fleet.groups
    with playing(group0, alice) as running:
        fleet.books.stop()
        try:
            refusal = refused(group1, alice)
            assert refusal is not None and refusal.code == c.BOOKS_UNAVAILABLE and refusal.retry_after_s > 0
            assert refused(group1, fleet.connection("bob")) is None  # a key without limits needs no books
            for _ in range(3):  # the running world plays on
                running.step(Controls(keys="w"))
                assert running.next_block(30) is not None
        finally:
            fleet.books.start()  # on its port, empty: the fleet pushes the keys again, the leases renew themselves
        for url in fleet.groups:  # each group asks again within RETRY_S of its last unanswered call
            wait_until(lambda u=url: refused(u, alice) is None, 20, f"a new session served on {url} by the books again")
        running.step(Controls(keys="d"))
        assert running.next_block(30) is not None


def test_a_group_whose_instance_dies_frees_its_key_s_seats_within_the_lease(fleet: Fleet) -> None:
    """alice holds her two seats on group 0; its instance (where its leases live) is SIGKILLed: within the lease
    her start on group 1 is served, without an operator. Last: group 0 heals meanwhile."""
    alice = fleet.connection("alice")
    group0, group1 = fleet.groups
    books = fleet.books.connect()
    wait_until(lambda: books.held("alice") == (0, 0), 10, "alice's earlier sessions' seats released")
    first, second = (SteeredSession(group0, connection=alice) for _ in range(2))
    try:
        assert first_block_or_refusal(first) is None and first_block_or_refusal(second) is None
        assert refused(group1, alice).code == c.USER_SESSION_LIMIT
        server = tritonserver_of(fleet.process.pid, int(group0.rsplit(":", 1)[1]))
        (stub,) = stub_pids(server).values()
        os.kill(stub, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: refused(group1, alice) is None, LEASE_S + 10, "alice's seats freed by the dead instance")
        freed_s = time.monotonic() - killed
    finally:
        for session in (first, second):
            session.close()
    assert freed_s < LEASE_S + 3.0, freed_s
    print(f"a dead instance's seats freed {freed_s:.1f} s after its SIGKILL (lease {LEASE_S:g} s)")
