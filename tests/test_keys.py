"""A key per user, at the door: the keys file (its hash lines, never a key), the check of a presented key (constant
time, every line compared), the key stripped from what the server reads on, and the operator's tool. As an attacker
would: no key, a wrong one, a revoked one, a key in a prompt, two keys in one request, 1,000 wrong keys in a row."""
from __future__ import annotations

import json
import queue
import stat
from pathlib import Path

import pytest

from backend.api import contract as c
from backend.api.errors import ConfigError
from backend.api.refusal import Refusal
from backend.launch import keys as tool
from backend.serving import key_watch
from backend.serving.host_signals import HostSignals
from backend.serving.key_watch import KeyWatch, gate_of
from backend.serving.keys import (AUTH_INVALID, AUTH_REQUIRED, KEY_PREFIX, Gate, KeyRing, Principal, Quota,
                                  digest_of, key_line, new_sequence, take_key)


def ring_of(**keys: str) -> KeyRing:
    return KeyRing.parse("\n".join(key_line(name, key, Quota(sessions=2)) for name, key in keys.items()))


def test_a_key_is_256_random_bits_and_its_line_holds_only_its_hash() -> None:
    key = new_sequence()
    assert key.startswith(KEY_PREFIX) and len(key) >= len(KEY_PREFIX) + 43 and key != new_sequence()
    line = key_line("alice", key, Quota(sessions=2, session_s=1200.0))
    assert key not in line and line == f"alice sha256:{digest_of(key).hex()} sessions=2 session_s=1200"


def test_the_check_names_the_keys_owner_and_refuses_no_key_and_a_wrong_one() -> None:
    alice, bob = new_sequence(), new_sequence()
    ring = ring_of(alice=alice, bob=bob)
    who = ring.check(bob)
    assert isinstance(who, Principal) and who.name == "bob" and who.quota == Quota(sessions=2)
    assert who.tag == digest_of(bob).hex()[:12] and bob not in repr(who)
    assert ring.check(None) is AUTH_REQUIRED and ring.check("") is AUTH_REQUIRED
    for wrong in (alice[:-1], alice + "x", alice.upper(), "x" * 100_000, 12345, digest_of(alice).hex()):
        assert ring.check(wrong) is AUTH_INVALID, wrong


def test_the_check_compares_every_line_whatever_matched(monkeypatch: pytest.MonkeyPatch) -> None:
    keys = {f"u{i}": new_sequence() for i in range(5)}
    ring = ring_of(**keys)
    compared = []
    import backend.serving.keys as module

    real = module.hmac.compare_digest
    monkeypatch.setattr(module.hmac, "compare_digest", lambda a, b: compared.append(a) or real(a, b))
    for presented in (keys["u0"], keys["u4"], "lbk_wrong"):
        compared.clear()
        ring.check(presented)
        assert len(compared) == 5  # no early exit: the time does not tell which line matched


def test_a_thousand_wrong_keys_in_a_row_are_each_refused_and_the_right_one_still_opens() -> None:
    alice = new_sequence()
    gate = Gate(ring_of(alice=alice))
    for _ in range(1000):
        who, _ = gate.admit(json.dumps({c.KEY_HEADER: new_sequence()}))
        assert who is AUTH_INVALID
    assert gate.admit(json.dumps({c.KEY_HEADER: alice}))[0].name == "alice"


def test_the_door_strips_the_key_from_what_the_server_reads_on() -> None:
    alice = new_sequence()
    gate = Gate(ring_of(alice=alice))
    who, rest = gate.admit(json.dumps({"decode": True, c.KEY_HEADER: alice}))
    assert who.name == "alice" and json.loads(rest) == {"decode": True} and alice not in rest
    # A key without a keys file is stripped too: the server lets everyone in and keeps no key.
    who, rest = Gate(None).admit(json.dumps({c.KEY_HEADER: alice}))
    assert who.name == "" and alice not in rest


def test_a_key_in_a_prompt_or_any_other_parameter_opens_nothing() -> None:
    alice = new_sequence()
    gate = Gate(ring_of(alice=alice))
    assert gate.admit(json.dumps({"prompt": alice, "expect_settings": alice}))[0] is AUTH_REQUIRED


def test_two_different_keys_in_one_request_are_refused() -> None:
    """Triton forwards the header after any request parameter of its name: both reach the model."""
    alice, bob = new_sequence(), new_sequence()
    gate = Gate(ring_of(alice=alice, bob=bob))
    both = f'{{"{c.KEY_HEADER}":"{bob}","{c.KEY_HEADER}":"{alice}"}}'
    who, rest = gate.admit(both)
    assert isinstance(who, Refusal) and who.code == c.AUTH_INVALID and alice not in rest and bob not in rest
    same = f'{{"{c.KEY_HEADER}":"{alice}","{c.KEY_HEADER}":"{alice}"}}'
    assert gate.admit(same)[0].name == "alice"
    assert take_key("not json") == (None, "not json") and take_key("[1, 2]") == (None, "[1, 2]")


def test_a_reload_names_the_revoked_keys_by_tag_and_a_rotated_key_is_revoked_too() -> None:
    alice, bob = new_sequence(), new_sequence()
    old = ring_of(alice=alice, bob=bob)
    new = ring_of(alice=new_sequence(), carol=new_sequence())  # alice rotated, bob removed, carol added
    assert new.revoked_since(old) == {old.check(alice).tag, old.check(bob).tag}
    assert new.check(alice) is AUTH_INVALID


def test_an_instance_takes_a_published_reload_and_ends_the_sessions_of_the_keys_it_dropped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's SIGHUP as an instance sees it: the door serves the new keys at once, and the keys the new file
    no longer holds (removed, or rotated under the same name) are named for their sessions to end, no other."""
    monkeypatch.setattr(key_watch, "KEYS_POLL_S", 0.05)
    alice, bob, carol, dave, bob_again = (new_sequence() for _ in range(5))
    signals = HostSignals(tmp_path)

    def publish(**keys: str) -> None:  # what the launcher does with the keys file it checked
        signals.publish_keys("\n".join(key_line(name, key, Quota()) for name, key in keys.items()))

    publish(alice=alice, bob=bob, carol=carol)
    gate = gate_of(signals)
    old = gate.ring
    revoked: queue.SimpleQueue[set[str]] = queue.SimpleQueue()
    watch = KeyWatch(signals, gate, revoked.put)
    try:
        publish(alice=alice, bob=bob_again, dave=dave)  # bob rotated, carol removed, dave added
        assert revoked.get(timeout=5) == {old.check(bob).tag, old.check(carol).tag}
    finally:
        watch.close()
    for key, name in ((alice, "alice"), (bob_again, "bob"), (dave, "dave"), (bob, None), (carol, None)):
        who, _ = gate.admit(json.dumps({c.KEY_HEADER: key}))
        assert (who is AUTH_INVALID) if name is None else who.name == name
    assert revoked.empty()


@pytest.mark.parametrize("text, words", [
    ("alice", "expected NAME sha256:HEX"),
    ("alice sha256:abc", "expected NAME sha256:HEX"),
    (f"al ice sha256:{'0' * 64}", "expected NAME"),
    (f"alice sha256:{'0' * 64} seats=3", "'seats=3' is not a limit"),
    (f"alice sha256:{'0' * 64} sessions=0", "sessions must be at least 1"),
    (f"alice sha256:{'0' * 64} queue=-1", "queue must be at least 0"),
    (f"alice sha256:{'0' * 64} sessions=two", "sessions must be a number"),
    (f"alice sha256:{'0' * 64} sessions=1 sessions=2", "given twice"),
    (f"alice sha256:{'0' * 64}\nalice sha256:{'1' * 64}", "line 2: the name alice is taken"),
    (f"alice sha256:{'0' * 64}\nbob sha256:{'0' * 64}", "line 2: the same key"),
])
def test_a_bad_keys_file_is_refused_naming_its_line(text: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        KeyRing.parse("# a comment\n\n" + text if "line 2" not in words else text)


def test_a_key_may_be_kept_out_of_the_queue_with_queue_0() -> None:
    (entry,) = KeyRing.parse(f"alice sha256:{'0' * 64} sessions=1 queue=0").entries
    assert entry.quota == Quota(sessions=1, queue=0)


def test_the_tool_prints_the_key_once_and_writes_only_its_hash(tmp_path: Path, capsys) -> None:
    path = tmp_path / "keys.txt"
    assert tool.main(["add", "--file", str(path), "--name", "alice", "--sessions", "2", "--queue", "4",
                      "--blocks-per-hour", "100"]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith(KEY_PREFIX) and key not in path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert KeyRing.parse(path.read_text()).check(key) == Principal(
        "alice", digest_of(key).hex()[:12], Quota(sessions=2, queue=4, blocks_per_hour=100), digest_of(key).hex())
    assert tool.main(["add", "--file", str(path), "--name", "alice"]) == 1  # a name once
    assert "already" in capsys.readouterr().err
    assert tool.main(["add", "--file", str(path), "--name", "bob"]) == 0
    bob = capsys.readouterr().out.strip()
    assert tool.main(["remove", "--file", str(path), "--name", "alice"]) == 0
    ring = KeyRing.parse(path.read_text())
    assert ring.check(key) is AUTH_INVALID and ring.check(bob).name == "bob"
