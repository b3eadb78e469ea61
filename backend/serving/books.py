"""The fleet's shared books: every key's counts across the groups of a fleet, in Redis (or Valkey), and the fleet's
keys (docs/security.md, "One fleet, one set of books").

A lone group keeps its books in process (the scheduler's table and its hourly usage). Groups that share a store keep
these besides, each name under `lingbot:books:`:

    keys            hash: a key's name -> its keys-file line (name, the key's SHA-256, its limits), never a key
    keys:version    the SHA-256 of those lines as the fleet pushed them: a reader reloads when it changes
    seats:NAME      sorted set: the leases of the key's sessions that may hold a slot (at most its `sessions`)
    queue:NAME      sorted set: the leases of the key's sessions waiting for a seat (at most its `queue`)
    blocks:NAME     hash: a minute (unix time // 60) -> blocks its sessions received in it; the last 60 are its hour

A lease is scored by its expiry in milliseconds of the store's own clock (Lua's TIME, so the hosts' clocks need not
agree): its owner renews it, and a lease whose group died expires and frees its seat. Every change is one Lua script,
atomic in the store, so two groups never both take a key's last seat. Every call is bounded by a short timeout and
never retried here: `BooksUnavailable` says the store did not answer (the caller decides what that means).
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from ..api.errors import ConfigError
from .keys import KeyRing, Quota

PREFIX = "lingbot:books:"
KEYS, KEYS_VERSION = f"{PREFIX}keys", f"{PREFIX}keys:version"
CALL_TIMEOUT_S = 0.25  # one call's bound (connect, then each reply): the owner's intake waits no longer
HOUR_MINUTES = 60
URL_VARIABLE, PASSWORD_VARIABLE, CA_VARIABLE = "LINGBOT_BOOKS_URL", "LINGBOT_BOOKS_PASSWORD_FILE", "LINGBOT_BOOKS_CA"

_NOW = """local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""
# The key's blocks of the last hour, pruned: {now_ms, minute, count, minute, count, ...}.
_HOUR = """local function hour(key, now)
  local out = {now}
  local all = redis.call('HGETALL', key)
  local minute = math.floor(now / 60000)
  for i = 1, #all, 2 do
    if tonumber(all[i]) <= minute - 60 then redis.call('HDEL', key, all[i])
    else table.insert(out, tonumber(all[i])); table.insert(out, tonumber(all[i + 1])) end
  end
  return out
end
"""
# KEYS: seats, queue, blocks; ARGV: lease id, lease ms, sessions, queue, blocks_per_hour (-1: no limit).
_TAKE = _NOW + _HOUR + """redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local limit = tonumber(ARGV[5])
if limit >= 0 then
  local used, pairs = 0, hour(KEYS[3], now)
  for i = 3, #pairs, 2 do used = used + pairs[i] end
  if used >= limit then table.insert(pairs, 1, 'blocks'); return pairs end
end
local sessions, queue = tonumber(ARGV[3]), tonumber(ARGV[4])
local seats = redis.call('ZCARD', KEYS[1])
if sessions < 0 or seats < sessions then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1]); return {'seat'}
end
local waiting = redis.call('ZCARD', KEYS[2])
if queue < 0 or waiting < queue then
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[1]); return {'queue'}
end
return {'full', seats, waiting}
"""
# KEYS: seats, queue; ARGV: lease id, lease ms, sessions. 1: seated now; 0: it waits on (its lease renewed).
_PROMOTE = _NOW + """redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if tonumber(ARGV[3]) < 0 or redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[3]) then
  redis.call('ZREM', KEYS[2], ARGV[1]); redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1]); return 1
end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[1])
return 0
"""
# KEYS: each lease's set; ARGV: lease ms, then each lease's id. A lease the store lost (a restart) is there again.
_RENEW = _NOW + """for i = 1, #KEYS do redis.call('ZADD', KEYS[i], now + tonumber(ARGV[1]), ARGV[i + 1]) end
return #KEYS
"""
# KEYS: blocks; ARGV: blocks to add. The key's hour after them.
_ADD_BLOCKS = _NOW + _HOUR + """redis.call('HINCRBY', KEYS[1], tostring(math.floor(now / 60000)), tonumber(ARGV[1]))
redis.call('PEXPIRE', KEYS[1], 3660000)
return hour(KEYS[1], now)
"""


class BooksUnavailable(RuntimeError):
    """The store did not answer within its bound (down, unreachable, refusing the password)."""


@dataclass(frozen=True)
class Taken:
    """A session's start in the books: a seat (it may hold a slot), a place in the key's queue, or refused: the key's
    `sessions` and `queue` are all taken across the fleet ("full"), or its blocks_per_hour is used ("blocks", with
    the seconds until enough of its hour's blocks age out)."""

    kind: str  # "seat", "queue", "full" or "blocks"
    retry_after_s: float = 0.0


@dataclass(frozen=True)
class Hour:
    """A key's blocks over the last hour, as the store counts them, and when it may compute one again past `limit`."""

    now_s: float
    minutes: tuple[tuple[int, int], ...]  # (unix minute, blocks), oldest first

    @classmethod
    def of(cls, reply: list) -> Hour:
        pairs = [(int(reply[i]), int(reply[i + 1])) for i in range(1, len(reply), 2)]
        return cls(int(reply[0]) / 1000.0, tuple(sorted(pairs)))

    @property
    def used(self) -> int:
        return sum(n for _, n in self.minutes)

    def retry_after_s(self, limit: int) -> float:
        """Until the oldest minutes age out far enough for the key to be below `limit`."""
        over = self.used - limit + 1
        for minute, blocks in self.minutes:
            over -= blocks
            if over <= 0:
                return max(1.0, (minute + HOUR_MINUTES) * 60.0 - self.now_s)
        return 1.0


def seats_key(name: str) -> str:
    return f"{PREFIX}seats:{name}"


def line_key(name: str) -> str:
    return f"{PREFIX}queue:{name}"


def blocks_key(name: str) -> str:
    return f"{PREFIX}blocks:{name}"


def _limit(value: int | None) -> int:
    return -1 if value is None else value


def version_of(text: str) -> str:
    """The version of the keys' lines: their SHA-256."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class Books:
    """One connection to the shared books (a pool of connections; any thread)."""

    def __init__(self, client: object) -> None:
        """client: a redis.Redis made by `BooksAddress.connect`."""
        self.client = client
        self._take, self._promote, self._renew, self._add = (client.register_script(s)
                                                             for s in (_TAKE, _PROMOTE, _RENEW, _ADD_BLOCKS))

    def take(self, name: str, lease_id: str, quota: Quota, lease_s: float) -> Taken:
        reply = self._call(self._take, [seats_key(name), line_key(name), blocks_key(name)],
                           [lease_id, int(lease_s * 1000), _limit(quota.sessions), _limit(quota.queue),
                            _limit(quota.blocks_per_hour)])
        kind = reply[0].decode() if isinstance(reply[0], bytes) else reply[0]
        if kind == "blocks":
            return Taken(kind, Hour.of(reply[1:]).retry_after_s(quota.blocks_per_hour))
        return Taken(kind)

    def promote(self, name: str, lease_id: str, sessions: int | None, lease_s: float) -> bool:
        """Whether the waiting lease has a seat now (else its place in the key's queue is renewed)."""
        return bool(self._call(self._promote, [seats_key(name), line_key(name)],
                               [lease_id, int(lease_s * 1000), _limit(sessions)]))

    def renew(self, leases: list[tuple[str, str, bool]], lease_s: float) -> bool:
        """(name, lease id, seated) each: its expiry pushed on by `lease_s` (True once done)."""
        if leases:
            self._call(self._renew, [seats_key(n) if seated else line_key(n) for n, _, seated in leases],
                       [int(lease_s * 1000), *(lease_id for _, lease_id, _ in leases)])
        return True

    def release(self, name: str, lease_id: str) -> None:
        def both(pipe: object) -> None:
            pipe.zrem(seats_key(name), lease_id)
            pipe.zrem(line_key(name), lease_id)
        self._pipeline(both)

    def add_blocks(self, name: str, blocks: int) -> Hour:
        return Hour.of(self._call(self._add, [blocks_key(name)], [blocks]))

    def held(self, name: str) -> tuple[int, int]:
        """The key's live leases: (seats, places in the queue), for operators and tests."""
        replies = self._pipeline(lambda pipe: [pipe.zcount(k, f"({self._now_ms()}", "+inf")
                                               for k in (seats_key(name), line_key(name))])
        return int(replies[0]), int(replies[1])

    # -- the fleet's keys ------------------------------------------------------------------------------------

    def push_keys(self, ring: KeyRing) -> str:
        """The keys of a checked keys file, for every group: their lines replace the books' whole; their version."""
        lines = {e.name: " ".join([e.name, f"sha256:{e.digest.hex()}", *e.quota.words()]) for e in ring.entries}
        version = version_of("\n".join(lines[n] for n in sorted(lines)))

        def replace(pipe: object) -> None:
            pipe.delete(KEYS)
            if lines:
                pipe.hset(KEYS, mapping=lines)
            pipe.set(KEYS_VERSION, version)
        self._pipeline(replace, transaction=True)
        return version

    def keys_version(self) -> str | None:
        """The version of the keys in the books (None: none pushed, or the store lost them)."""
        version = self._call(self.client.get, KEYS_VERSION)
        return None if version is None else version.decode()

    def keys(self) -> tuple[str, str] | None:
        """(version, the keys file's text) as pushed, read together; None while none are there."""
        version, lines = self._pipeline(lambda pipe: (pipe.get(KEYS_VERSION), pipe.hgetall(KEYS)), transaction=True)
        if version is None:
            return None
        text = "\n".join(v.decode() for _, v in sorted(lines.items()))
        return version.decode(), text + "\n"

    # -- calls ------------------------------------------------------------------------------------------------

    def _now_ms(self) -> int:
        seconds, micros = self._call(self.client.time)
        return seconds * 1000 + micros // 1000

    def _call(self, function: object, *args: object) -> object:
        import redis

        try:
            return function(*args)
        except (redis.RedisError, OSError) as exc:
            raise BooksUnavailable(f"the books did not answer: {exc}") from exc

    def _pipeline(self, fill: object, transaction: bool = False) -> list:
        def run() -> list:
            with self.client.pipeline(transaction=transaction) as pipe:
                fill(pipe)
                return pipe.execute()
        return self._call(run)


@dataclass(frozen=True)
class BooksAddress:
    """Where a fleet's books are: a `redis://` or `rediss://` (TLS) URL without a password, the file that holds the
    password, and for TLS the CA that signed the store's certificate (None: the system's). It travels to a server's
    instances in their environment (file paths, never the password)."""

    url: str
    password_file: Path | None = None
    ca: Path | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("redis", "rediss") or not parts.hostname:
            raise ConfigError(f"--books-url {self.url!r}: expected redis://HOST:PORT[/DB] or rediss://HOST:PORT[/DB] "
                              "(TLS)")
        if parts.password or parts.username:
            raise ConfigError("--books-url carries no password (command lines are visible to the host's users): put "
                              "it in a file, readable by its owner only, and pass --books-password-file")
        if self.ca is not None and parts.scheme != "rediss":
            raise ConfigError("--books-ca verifies a TLS store: use a rediss:// URL")

    def environment(self) -> dict[str, str]:
        env = {URL_VARIABLE: self.url}
        if self.password_file is not None:
            env[PASSWORD_VARIABLE] = str(Path(self.password_file).resolve())
        if self.ca is not None:
            env[CA_VARIABLE] = str(Path(self.ca).resolve())
        return env

    @classmethod
    def from_environment(cls) -> BooksAddress | None:
        """A server's instances' books, where its launcher was given them (else None: books in process)."""
        if not (url := os.environ.get(URL_VARIABLE)):
            return None
        password, ca = os.environ.get(PASSWORD_VARIABLE), os.environ.get(CA_VARIABLE)
        return cls(url, Path(password) if password else None, Path(ca) if ca else None)

    def connect(self, timeout_s: float = CALL_TIMEOUT_S) -> Books:
        """A client of the store (it connects on its first call); ConfigError for a password file it cannot read."""
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        password = None
        if self.password_file is not None:
            try:
                password = Path(self.password_file).read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise ConfigError(f"the books' password file {self.password_file}: {exc}") from exc
        tls = {"ssl_ca_certs": str(self.ca)} if self.ca is not None else {}
        client = redis.Redis.from_url(self.url, password=password, socket_timeout=timeout_s,
                                      socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0),
                                      health_check_interval=0, **tls)
        return Books(client)
