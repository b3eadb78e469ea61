"""The fleet's shared books (serving/books, serving/leases) against a real redis-server this module starts: a key's
seats and places in the queue across owners, their leases expiring with an owner that stopped renewing, a key's hour of
blocks, the fleet's keys, a store that stops answering (bounded calls, a code) and starts again; then one rank's
intake on those books: a session that waits for its key's seat across the fleet, and one that ends with its key's
hour. Fast: no tritonserver (the fleet's own: tests/test_books_fleet.py)."""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from backend.api import contract as c
from backend.api.errors import ConfigError, Refused
from backend.api.request import StepRequest
from backend.engine.rollout import WorldModelEngine
from backend.fleet.books_server import BooksServer, redis_binary
from backend.fleet.fleet_books import FleetBooks
from backend.launch.books_keys import KeysFromBooks
from backend.launch.launcher import books_of, build_parser
from backend.parallel.ports import free_port
from backend.serving import mail, messages
from backend.serving.books import CALL_TIMEOUT_S, Books, BooksAddress, BooksUnavailable
from backend.serving.keys import KeyRing, Principal, Quota
from backend.serving.leases import Leases
from backend.serving.news import RankEvents
from backend.serving.scheduler import Scheduler
from backend.serving.sessions import EndReason, Status
from backend.serving.settings import ServingSettings
from books_harness import requires_redis, running_books
from factories import tiny_request
from one_rank import OneRank
from polling import wait_until
from test_saved_worlds import Client
from test_scheduler import sub
from tls_harness import make_pki

pytestmark = [requires_redis, pytest.mark.timeout(120)]


def principal(name: str, **quota: int) -> Principal:
    digest = hashlib.sha256(name.encode()).hexdigest()
    return Principal(name, digest[:12], Quota(**quota), digest)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory):
    with running_books(tmp_path_factory.mktemp("books")) as server:
        yield server


@pytest.fixture
def books(store: BooksServer) -> Books:
    books = store.connect()
    books.client.flushall()
    return books


def test_a_key_s_seats_and_queue_hold_across_owners_and_a_silent_owner_s_leases_expire(store: BooksServer,
                                                                                      books: Books) -> None:
    """Two clients of the store (two groups): sessions=2 queue=1 gives two seats, then one place, then none, whoever
    asks; a freed seat goes to the waiting lease that asks; leases not renewed expire after their life."""
    other = store.connect()
    quota = Quota(sessions=2, queue=1)
    assert [b.take("alice", f"l{i}", quota, 1.0).kind for i, b in enumerate((books, other, other, books))] == \
        ["seat", "seat", "queue", "full"]
    assert not other.promote("alice", "l2", 2, 1.0)  # no seat free: it waits on
    books.release("alice", "l0")
    assert other.promote("alice", "l2", 2, 1.0) and books.held("alice") == (2, 0)
    assert books.take("bob", "b0", quota, 1.0).kind == "seat"  # another key's books are its own
    began = time.monotonic()
    other.renew([("alice", "l2", True)], 60.0)  # this one's owner renews; l1's went silent
    wait_until(lambda: books.held("alice") == (1, 0), 5, "the silent lease to expire")
    assert 0.5 < time.monotonic() - began < 3.0
    assert books.take("alice", "l4", quota, 1.0).kind == "seat"


def test_a_key_s_hour_of_blocks_spans_its_owners(store: BooksServer, books: Books) -> None:
    other = store.connect()
    quota = Quota(blocks_per_hour=5)
    assert books.add_blocks("alice", 2).used == 2 and other.add_blocks("alice", 2).used == 4
    assert books.take("alice", "l0", quota, 10.0).kind == "seat"
    assert other.add_blocks("alice", 1).used == 5
    refused = books.take("alice", "l1", quota, 10.0)
    assert refused.kind == "blocks" and 3500 < refused.retry_after_s <= 3600  # when this minute leaves the hour
    assert books.take("bob", "b0", quota, 10.0).kind == "seat"


def test_the_fleet_s_keys_are_read_back_whole_with_their_version(books: Books) -> None:
    assert books.keys() is None and books.keys_version() is None  # none pushed (or the store lost them)
    ring = KeyRing.parse(f"alice sha256:{'0' * 64} sessions=2 queue=0 snapshot_bytes=5000000000\n"
                         f"bob sha256:{'1' * 64}\n")
    version = books.push_keys(ring)
    assert books.keys_version() == version and KeyRing.parse(books.keys()[1]).entries == ring.entries
    assert books.push_keys(KeyRing.parse(f"bob sha256:{'1' * 64}")) != version
    assert [e.name for e in KeyRing.parse(books.keys()[1]).entries] == ["bob"]  # the whole replaced


def test_a_store_that_stops_answering_is_named_within_its_bound_and_serves_again(store: BooksServer,
                                                                                 books: Books) -> None:
    """Stopped outright (a refused connection) or hung (SIGSTOP: a connection nobody answers), every call ends
    within its bound with BooksUnavailable; started again on its port, the same client is served."""
    quota = Quota(sessions=1)
    assert books.take("alice", "l0", quota, 10.0).kind == "seat"
    os.kill(store.process.pid, signal.SIGSTOP)
    try:
        began = time.monotonic()
        with pytest.raises(BooksUnavailable):
            books.take("alice", "l1", quota, 10.0)
        assert time.monotonic() - began < 3 * CALL_TIMEOUT_S
    finally:
        os.kill(store.process.pid, signal.SIGCONT)
    store.stop()
    began = time.monotonic()
    with pytest.raises(BooksUnavailable):
        books.take("alice", "l1", quota, 10.0)
    assert time.monotonic() - began < 3 * CALL_TIMEOUT_S
    store.start()
    assert books.take("alice", "l1", quota, 10.0).kind == "seat"  # a restart keeps nothing: the renewals bring it back
    store.stop()  # restarted while the client's pooled connection was idle: its next call is served, not refused
    store.start()
    assert books.take("alice", "l2", Quota(sessions=2), 10.0).kind == "seat"


def test_a_store_over_tls_with_a_password_and_its_refusals(tmp_path: Path) -> None:
    """--books-url rediss:// with --books-ca and a password file: served; a wrong password or an unknown CA is the
    store not answering, and a password in the URL or a CA without TLS is refused as configuration."""
    pki = make_pki(tmp_path / "pki")
    port, password = free_port(), "s3cret-books"
    config = tmp_path / "redis.conf"
    config.write_text("\n".join(["bind 127.0.0.1", "port 0", f"tls-port {port}", f"tls-cert-file {pki.server_cert}",
                                 f"tls-key-file {pki.server_key}", f"tls-ca-cert-file {pki.ca}", "tls-auth-clients no",
                                 f"requirepass {password}", 'save ""', f"dir {tmp_path}", ""]))
    server = subprocess.Popen([redis_binary(), str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        (tmp_path / "password").write_text(password)
        (tmp_path / "wrong").write_text("not it")
        good = BooksAddress(f"rediss://127.0.0.1:{port}/0", tmp_path / "password", pki.ca).connect()
        wait_until(lambda: _answers(good), 10, "the TLS store")
        assert good.take("alice", "l0", Quota(sessions=1), 10.0).kind == "seat"
        for address in (BooksAddress(f"rediss://127.0.0.1:{port}/0", tmp_path / "wrong", pki.ca),
                        BooksAddress(f"rediss://127.0.0.1:{port}/0", tmp_path / "password", pki.stranger_ca)):
            with pytest.raises(BooksUnavailable):
                address.connect().keys_version()
    finally:
        server.terminate()
        server.wait(10)
    with pytest.raises(ConfigError, match="carries no password"):
        BooksAddress(f"redis://:{password}@127.0.0.1:{port}/0")
    with pytest.raises(ConfigError, match="rediss://"):
        BooksAddress(f"redis://127.0.0.1:{port}/0", ca=pki.ca)


def _answers(books: Books) -> bool:
    try:
        books.keys_version()
        return True
    except BooksUnavailable:
        return False


# ---------------------------------------------------------------- what the owner's intake makes of them


def test_leases_refuse_with_a_code_while_the_store_is_down_and_carry_their_sessions_back(store: BooksServer,
                                                                                         books: Books) -> None:
    posted: list = []
    leases = Leases(store.connect(), 3.0, posted.append)
    alice = principal("alice", sessions=1, queue=1, blocks_per_hour=100)
    assert leases.take("s1", alice) is True and leases.take("s2", alice) is False  # a seat, then a place in the queue
    with pytest.raises(Refused) as caught:
        leases.take("s3", alice)
    assert caught.value.refusal.code == c.USER_SESSION_LIMIT
    assert leases.take("free", principal("carol")) is True and books.held("carol") == (0, 0)  # no limit: no lease
    leases.delivered("s1")
    store.stop()
    with pytest.raises(Refused) as caught:
        leases.take("s4", principal("bob", sessions=3))
    assert caught.value.refusal.code == c.BOOKS_UNAVAILABLE and caught.value.refusal.retry_after_s > 0
    leases.tick()  # the running ones are kept; their block waits to be counted
    store.start()  # empty: the store lost every lease
    leases.ended("s1")  # asked again only after RETRY_S: it expires there meanwhile, or goes with the next release
    wait_until(lambda: (leases.tick(), books.held("alice"))[1] == (1, 0), 10, "the waiting lease seated again")
    assert posted == [mail.Seated(("s2",))]
    assert books.add_blocks("alice", 0).used == 1  # the block delivered while the store was down, counted once back


def test_a_session_waits_for_its_key_s_seat_across_the_fleet_and_ends_with_its_key_s_hour(
        engine: WorldModelEngine, store: BooksServer, books: Books, tmp_path: Path) -> None:
    """One rank on the books, another group's lease held in the store: alice's session waits in the queue (told its
    place) until that seat frees, then runs; a key whose hour the fleet used ends its running session with
    QUOTA_EXHAUSTED."""
    settings = ServingSettings(max_sessions=2, books_lease_s=3.0, max_blocks_ahead=100)
    group = OneRank(engine, settings, books=store.address)
    try:
        alice = principal("alice", sessions=1, queue=1)
        assert books.take("alice", "elsewhere", alice.quota, 60.0).kind == "seat"  # another group's session
        first = Placed()
        start = dataclasses.replace(tiny_request(decode=False, num_frames=9), num_frames=None, poses=None, keys="w",
                                    sequence_id="11")
        group.submit(start, first, alice)
        wait_until(lambda: first.places, 10, "a place in the queue")
        assert not first.latents and group.scheduler.table \
            and next(iter(group.scheduler.table.values())).status is Status.WAITING_SEAT
        books.release("alice", "elsewhere")
        first.answered(30)
        assert first.error is None and len(first.latents) == 1
        group.submit(StepRequest("11", None, end=True), Client(), alice)

        bob = principal("bob", blocks_per_hour=3)
        books.add_blocks("bob", 2)  # another group's blocks of bob's this hour
        played = Client()
        group.submit(dataclasses.replace(start, sequence_id="12"), played, bob)
        played.answered(30)
        pause = Client()  # held open until the session ends: its ending is told on it
        group.submit(StepRequest("12", None, pause=True), pause, bob)
        pause.answered(30)
        assert pause.error is not None and pause.error.code == c.QUOTA_EXHAUSTED, pause.error
        assert 3300 < pause.error.retry_after_s <= 3600
    finally:
        group.stop()


class Placed(Client):
    def __init__(self) -> None:
        super().__init__()
        self.places: list[int] = []

    def send_place(self, position: int, wait_s: float) -> None:
        self.places.append(position)


def test_an_unseated_session_waits_for_its_seat_whatever_the_free_slots() -> None:
    """The scheduler gives a slot only to a session its owner's books seated; its seat arrives as news."""
    s = Scheduler(ServingSettings(max_sessions=2))
    waiting = sub("a")
    waiting.status = Status.WAITING_SEAT
    plan = s.plan([RankEvents(submissions=[waiting, sub("b")])])
    assert [o.id for o in plan.opens] == ["b"] and [w.id for w in s.waiting()] == ["a"]
    assert [o.id for o in s.plan([RankEvents(seated=["a"])]).opens] == ["a"]
    over = s.plan([RankEvents(over_quota=[("b", messages.quota_exhausted("alice", 3, 60.0))])])
    assert over.ended_by(EndReason.QUOTA) == ["b"]


# ---------------------------------------------------------------- the fleet's own store


def test_the_fleet_s_own_store_is_loopback_behind_a_password_it_made_and_comes_back_with_the_keys(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text(f"alice sha256:{'0' * 64} sessions=2 queue=0\n")
    args = argparse.Namespace(books_url=None, books_password_file=None, books_ca=None, keys_file=keys_file, groups=2,
                              out=tmp_path / "out")
    fleet = FleetBooks.of(args).start()
    try:
        server = fleet.server
        assert stat.S_IMODE(server.folder.stat().st_mode) == 0o700
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in (server.password_file, server.config))
        password = server.password_file.read_text()
        assert password not in Path(f"/proc/{server.process.pid}/cmdline").read_text()
        assert password not in " ".join(fleet.launcher_args())
        books = fleet.books
        assert books.client.config_get("bind")["bind"] == "127.0.0.1"
        assert books.client.config_get("protected-mode")["protected-mode"] == "yes"
        assert books.client.config_get("save")["save"] == ""  # nothing on disk
        with pytest.raises(BooksUnavailable):  # no password, no books
            BooksAddress(server.address.url).connect().keys_version()
        assert KeyRing.parse(books.keys()[1]).entries == KeyRing.parse(keys_file.read_text()).entries
        version = books.keys_version()
        keys_file.write_text("alice not-a-hash\n")
        assert not fleet.push_keys("SIGHUP") and books.keys_version() == version  # named; the keys in force stay
        assert "line 1" in capsys.readouterr().err
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait(10)
        keys_file.write_text(f"bob sha256:{'1' * 64}\n")
        fleet.supervise()  # started again on its port, and the keys it lost pushed again
        assert [e.name for e in KeyRing.parse(books.keys()[1]).entries] == ["bob"]
    finally:
        fleet.stop()
    no_keys = argparse.Namespace(**{**vars(args), "keys_file": None})
    assert FleetBooks.of(no_keys) is None  # without keys its groups keep their books in process


def test_a_launcher_takes_the_books_keys_and_keeps_them_while_the_books_are_silent(store: BooksServer,
                                                                                   books: Books) -> None:
    keys = KeysFromBooks(store.connect())
    try:
        with pytest.raises(TimeoutError, match="held no keys"):  # a group never serves without the fleet's keys
            keys.wait(0.1)
        books.push_keys(KeyRing.parse(f"alice sha256:{'0' * 64} sessions=2\n"))
        path = keys.wait(5)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(keys.folder.stat().st_mode) == 0o700
        assert [e.name for e in KeyRing.parse(path.read_text()).entries] == ["alice"]
        changes: list[str] = []
        keys.start(lambda: changes.append(path.read_text()))
        books.push_keys(KeyRing.parse(f"bob sha256:{'1' * 64}\n"))  # alice revoked, bob added
        wait_until(lambda: changes, 5, "the launcher to take the new keys")
        assert [e.name for e in KeyRing.parse(changes[-1]).entries] == ["bob"]
        books.client.flushall()  # a store that lost them: the keys in force stay
        assert keys.refresh() and [e.name for e in KeyRing.parse(path.read_text()).entries] == ["bob"]
        store.stop()  # and one that does not answer
        assert keys.refresh() and [e.name for e in KeyRing.parse(path.read_text()).entries] == ["bob"]
    finally:
        keys.close()
        if store.exited() is not None:
            store.start()
    assert not keys.folder.exists()


@pytest.mark.parametrize(("argv", "words"), [
    (["--keys-file", "k.txt", "--books-url", "redis://127.0.0.1:1/0"], "leave out --keys-file"),
    (["--books-password-file", "p"], "go with --books-url"),
    (["--books-url", "redis://:pw@127.0.0.1:1/0"], "carries no password"),
])
def test_a_launcher_refuses_books_flags_that_do_not_go_together(argv: list[str], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        books_of(build_parser().parse_args(argv))
