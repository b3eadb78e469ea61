"""A key per user: the keys file, and the check of a request's key.

The keys file (given to the launcher, docs/security.md) has one line per key: its name, the SHA-256 of the key and
the key's limits, never the key itself:

    # name  hash                 limits (each optional: without one, only the server's own limits bind)
    alice   sha256:9f86d08...    sessions=2 queue=4 session_s=1200 blocks_per_hour=20000 snapshot_bytes=200000000000

A key is 32 random bytes (256 bits, `new_sequence`). A plain SHA-256 is enough for such a key: a slow or salted hash
defends guessable secrets (passwords) against a stolen file, and no list of guesses reaches 2^256. The check
hashes what the request presents and compares it with every line's hash in constant time
(`hmac.compare_digest`, no early exit), so its time tells nothing of which hash, or how much of one, matched.
"""
from __future__ import annotations

import hashlib
import json
import hmac
import re
import secrets
from dataclasses import dataclass, fields

from ..api import contract as c
from ..api.errors import ConfigError
from ..api.refusal import Refusal

KEY_PREFIX = "lbk_"  # a key is recognisable as one (a secret scanner's pattern; a log line that carries one)
KEY_BYTES = 32
MAX_PRESENTED_CHARS = 256  # a presented value longer than any key is refused before it is hashed
TAG_CHARS = 12  # of a key's hash: which key of a name a session holds (a rotated key's sessions end alone)
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # a metric label and a log word as it is
HASH = re.compile(r"sha256:([0-9a-f]{64})")


@dataclass(frozen=True)
class Quota:
    """A key's limits (None: only the server's own limit binds)."""

    sessions: int | None = None  # its sessions holding a slot at once
    queue: int | None = None  # its sessions waiting for a slot at once
    session_s: float | None = None  # a steered session's length (the server's max_session_s binds too)
    blocks_per_hour: int | None = None  # blocks computed for its sessions in any hour
    snapshot_bytes: int | None = None  # what its snapshots and saves under way may hold in the store

    @classmethod
    def parse(cls, words: list[str], where: str) -> Quota:
        kinds = {f.name: (float if f.name.endswith("_s") else int) for f in fields(cls)}
        values: dict[str, float | int] = {}
        for word in words:
            name, sep, text = word.partition("=")
            if not sep or name not in kinds:
                raise ConfigError(f"{where}: {word!r} is not a limit; limits are {', '.join(kinds)} (NAME=VALUE)")
            if name in values:
                raise ConfigError(f"{where}: limit {name} is given twice")
            try:
                value = kinds[name](text)
            except ValueError:
                raise ConfigError(f"{where}: limit {name} must be a number; got {text!r}") from None
            if not value >= (0 if name == "queue" else 1):
                raise ConfigError(f"{where}: limit {name} must be at least {0 if name == 'queue' else 1}; got {text}")
            values[name] = value
        return cls(**values)

    def words(self) -> list[str]:
        values = [(f.name, getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None]
        return [f"{name}={value:g}" if isinstance(value, float) else f"{name}={value}" for name, value in values]


@dataclass(frozen=True)
class Principal:
    """Who a session belongs to, as every rank's scheduler sees it: the key's name, which key of that name (its
    tag, a prefix of its hash), its limits at admission, and its whole hash (hex), which owns its snapshots."""

    name: str
    tag: str
    quota: Quota = Quota()
    digest: str = ""  # "": no key (a server without a keys file), whose snapshots nobody owns


ANONYMOUS = Principal("", "")  # a server without a keys file: one tenant, the server's limits only


@dataclass(frozen=True)
class KeyEntry:
    name: str
    digest: bytes
    quota: Quota

    @property
    def principal(self) -> Principal:
        return Principal(self.name, self.digest.hex()[:TAG_CHARS], self.quota, self.digest.hex())


def digest_of(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def new_sequence() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(KEY_BYTES)


def key_line(name: str, key: str, quota: Quota) -> str:
    """The keys file's line of `key` (its hash, never the key)."""
    if not NAME.fullmatch(name):
        raise ConfigError(f"key name {name!r}: use 1-64 letters, digits, '_', '.' or '-'")
    return " ".join([name, f"sha256:{digest_of(key).hex()}", *quota.words()])


AUTH_REQUIRED = Refusal(c.AUTH_REQUIRED, f"this server needs a key: send it in the gRPC header '{c.KEY_HEADER}'")
AUTH_INVALID = Refusal(c.AUTH_INVALID, "the key is not valid here; ask the operator for one")
KEY_REVOKED = Refusal(c.AUTH_INVALID, "the session's key was revoked by the operator, so the session ended")
KEY_NOT_THE_SESSIONS = Refusal(c.AUTH_INVALID, "this request's key is not the key its session was started with")
KEY_TWICE = Refusal(c.AUTH_INVALID, f"the request carries two different keys (the header '{c.KEY_HEADER}' and a "
                    "request parameter of that name): send the header alone")


class KeyRing:
    """The keys of one version of the keys file."""

    def __init__(self, entries: list[KeyEntry]) -> None:
        self.entries = tuple(entries)

    @classmethod
    def parse(cls, text: str, source: str = "keys file") -> KeyRing:
        """ConfigError names the line and what is wrong with it."""
        entries: list[KeyEntry] = []
        for number, line in enumerate(text.splitlines(), start=1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            where = f"{source} line {number}"
            if len(words) < 2 or not NAME.fullmatch(words[0]) or not (match := HASH.fullmatch(words[1])):
                raise ConfigError(f"{where}: expected NAME sha256:HEX [LIMIT=VALUE ...] (make lines with "
                                  f"python -m backend.launch.keys add)")
            entry = KeyEntry(words[0], bytes.fromhex(match.group(1)), Quota.parse(words[2:], where))
            if any(e.name == entry.name for e in entries):
                raise ConfigError(f"{where}: the name {entry.name} is taken by an earlier line (a name is a key's "
                                  f"quotas and metrics: one key per name)")
            if any(e.digest == entry.digest for e in entries):
                raise ConfigError(f"{where}: the same key as an earlier line")
            entries.append(entry)
        return cls(entries)

    def check(self, presented: object) -> Principal | Refusal:
        """Whose key this is, or the refusal: every line's hash is compared, whatever matched."""
        if presented is None or presented == "":
            return AUTH_REQUIRED
        if not isinstance(presented, str) or len(presented) > MAX_PRESENTED_CHARS:
            return AUTH_INVALID
        digest = digest_of(presented)
        found = None
        for entry in self.entries:
            if hmac.compare_digest(entry.digest, digest):
                found = entry
        return AUTH_INVALID if found is None else found.principal

    def tags(self) -> set[str]:
        return {e.principal.tag for e in self.entries}

    def revoked_since(self, older: KeyRing) -> set[str]:
        """The tags of keys the older version held and this one does not: their sessions end."""
        return older.tags() - self.tags()


class _Pairs(list):
    """A JSON object's (name, value) pairs in order, duplicates kept."""


def take_key(parameters_json: str) -> tuple[object, str]:
    """(the key a request presents, its parameters without it): Triton forwards the key's header as a request
    parameter, which nothing past the door may see (a log, an error's echo). KEY_TWICE when a client also sent a
    parameter of that name with another value; None when it sent none."""
    try:
        pairs = json.loads(parameters_json or "{}", object_pairs_hook=_Pairs)
    except json.JSONDecodeError:
        return None, parameters_json  # the parser names it; no key can be read from it
    if not isinstance(pairs, _Pairs):
        return None, parameters_json
    values = [v for k, v in pairs if k == c.KEY_HEADER]
    rest = json.dumps(dict((k, v) for k, v in pairs if k != c.KEY_HEADER))
    if len(set(map(repr, values))) > 1:
        return KEY_TWICE, rest
    return (values[0] if values else None), rest


class Gate:
    """The owner's door, before any work: a request's key checked against the keys (None: a server without a
    keys file lets everyone in as ANONYMOUS) and stripped from its parameters. `ring` is replaced whole when the
    keys file is reloaded (the key watch is its one writer)."""

    def __init__(self, ring: KeyRing | None) -> None:
        self.ring = ring

    def admit(self, parameters_json: str) -> tuple[Principal | Refusal, str]:
        """(who sent it, or the refusal to answer it with; its parameters without the key)."""
        presented, rest = take_key(parameters_json)
        ring = self.ring
        if isinstance(presented, Refusal):
            return presented, rest
        if ring is None:
            return ANONYMOUS, rest
        return ring.check(presented), rest
