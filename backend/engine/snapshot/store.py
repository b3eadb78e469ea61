"""Where snapshots live: one folder per snapshot under the store's root, named by its id, within a size quota and a
time to live (docs/worlds.md).

An id is a capability: 128 random bits as 32 lowercase hex digits, checked against that exact pattern before any
path is built from it. The root holds:

    <id>/              a published snapshot: manifest.json and its files (the folder's mtime: when it was published),
                       and owner.json where a key saved it (its hash, and whether it is shared)
    .staging-<id>/     a save being written: .reservation (the bytes it reserved), owner.json, then every rank's files
    .expired-<id>      a snapshot that outlived the time to live (forgotten after another time to live)
    .lock              serialises reservations, publications and sweeps (flock), across processes and groups

A save reserves its bytes first (refused at once when they would pass the quota), its ranks write into its
staging folder, and its owner publishes it with one rename: a snapshot appears whole or not at all, and a failed
save leaves only a staging folder, which the next sweep past its time to live removes.

A snapshot belongs to the key that saved it (`Ownership`, docs/security.md): only that key may release it or change
its sharing, and resume or fork it unless it is shared; a key's snapshots and saves under way count against its own
`snapshot_bytes` beside the store's quota, both under the store's lock, so every group that shares the folder counts
alike.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from dataclasses import dataclass

from ...api.contract import (INVALID_INPUT, SNAPSHOT_EXPIRED, SNAPSHOT_ID_PATTERN, SNAPSHOT_KEY_FULL, SNAPSHOT_NOT_YOURS,
                             SNAPSHOT_PENDING, SNAPSHOT_STORE_FULL, SNAPSHOT_UNKNOWN)
from ...api.refusal import Refusal
from .files import fsync_folder
from .manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, Snapshot, SnapshotError, invalid

ID_BYTES = 16  # 128 random bits
# A resume of a snapshot whose save is under way is told to come back this soon: a save's write and publication take
# 0.02-0.15 of a block on CPU (bench/README section 18), 7 s a rank for the 14B model's 6.2 GiB at 2 GB/s.
PENDING_RETRY_S = 0.5
ID_PATTERN = re.compile(SNAPSHOT_ID_PATTERN)
STAGING, EXPIRED, TRASH, RESERVATION, LOCK = ".staging-", ".expired-", ".trash-", ".reservation", ".lock"
OWNER = "owner.json"
MAX_OWNER_BYTES = 1024


@dataclass(frozen=True)
class Ownership:
    """Whose a snapshot is: the hex SHA-256 of the key that saved it ("": saved without a key, nobody's), and whether
    any key that holds its id may resume and fork it."""

    key: str = ""
    shared: bool = False

    def opens_for(self, key: str) -> bool:
        """Whether `key` (a hash; "": no key) may resume or fork it."""
        return not self.key or self.shared or self.key == key

    def owned_by(self, key: str) -> bool:
        """Whether `key` may release it or change its sharing."""
        return not self.key or self.key == key


@dataclass(frozen=True)
class KeySnapshot:
    """One of a key's published snapshots, as its key lists them."""

    snapshot_id: str
    bytes: int
    created_unix_s: float
    shared: bool


def not_yours(snapshot_id: str, what: str) -> SnapshotError:
    return SnapshotError(Refusal(SNAPSHOT_NOT_YOURS, f"snapshot {snapshot_id} belongs to another key, which has not "
                                 f"shared it: {what}"))


def check_id(snapshot_id: str) -> str:
    """The id, if it has the exact form of one (else SnapshotError INVALID_INPUT): nothing else reaches a path."""
    if not isinstance(snapshot_id, str) or not ID_PATTERN.fullmatch(snapshot_id):
        raise SnapshotError(Refusal(INVALID_INPUT, f"snapshot id {str(snapshot_id)[:40]!r} is not "
                                    f"{2 * ID_BYTES} lowercase hex digits"))
    return snapshot_id


def staging_folder(root: Path, snapshot_id: str) -> Path:
    """Where every rank writes its files of a reserved snapshot (files.write_part): its store's staging folder (a
    path only; any thread, any rank)."""
    path = Path(root) / f"{STAGING}{check_id(snapshot_id)}"
    if not path.is_dir() or path.is_symlink():
        raise SnapshotError(Refusal(SNAPSHOT_UNKNOWN, f"no save of snapshot {snapshot_id} is under way (it "
                                    "failed, or outlived the time to live)"))
    return path


def snapshot_at(root: Path, snapshot_id: str, manifest_text: str, check_hashes: bool = True) -> Snapshot:
    """The snapshot its owner opened, from its manifest's text (`snapshot.manifest.to_text()`, shared with the
    group), without touching the disk: every rank of a resume builds the same one and raises nothing here; a file
    gone since the owner opened it is each reader's SNAPSHOT_INVALID, which the group agrees on. check_hashes:
    Snapshot's."""
    return Snapshot(Path(root) / check_id(snapshot_id), Manifest.parse(manifest_text.encode(), snapshot_id),
                    check_hashes)


class SnapshotStore:
    """A rank's store: one instance per rank, owned by one thread (the serving intake's); other processes and groups
    that share its folder serialise on its lock file."""

    def __init__(self, root: Path, quota_bytes: int, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        """root: the snapshot folder (made if absent; shared by every group that resumes its snapshots);
        quota_bytes: the most its snapshots (published and being written) take; ttl_s: how long one lives."""
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.quota_bytes, self.ttl_s, self.clock = quota_bytes, ttl_s, clock

    # -- saving -----------------------------------------------------------------------------------

    def reserve(self, nbytes: int, owner: Ownership = Ownership(), owner_quota: int | None = None) -> str:
        """A new snapshot's id, its `nbytes` reserved and its staging folder made (on the session's owner, when a
        save is asked for), owned by `owner`. Refused at once, nothing written: SNAPSHOT_STORE_FULL while the
        snapshots that live leave too little room (with the time until enough of them expire), SNAPSHOT_KEY_FULL
        when the owner's own would pass `owner_quota` (its key's snapshot_bytes; None: none), INVALID_INPUT when
        it is larger than the whole quota."""
        if nbytes > self.quota_bytes:
            raise SnapshotError(Refusal(INVALID_INPUT, f"this session's snapshot takes {nbytes:,} bytes, more than "
                                        f"the store's whole quota of {self.quota_bytes:,}"))
        with self._locked():
            self._sweep()
            used = self._usage()
            if used + nbytes > self.quota_bytes:
                raise SnapshotError(Refusal(
                    SNAPSHOT_STORE_FULL, f"the snapshot store holds {used:,} of its {self.quota_bytes:,} bytes; this "
                    f"snapshot takes {nbytes:,}: nothing was saved", self._wait_for(used + nbytes - self.quota_bytes)))
            if owner_quota is not None and (held := self._usage(owner.key)) + nbytes > owner_quota:
                raise SnapshotError(Refusal(
                    SNAPSHOT_KEY_FULL, f"this key's snapshots hold {held:,} of its snapshot_bytes={owner_quota:,}; "
                    f"this snapshot takes {nbytes:,}: nothing was saved",
                    self._wait_for(held + nbytes - owner_quota, owner.key)))
            if (room := self._room()) < nbytes:
                raise SnapshotError(Refusal(
                    SNAPSHOT_STORE_FULL, f"the filesystem under the snapshot store has room for {max(0, room):,} more "
                    f"bytes; this snapshot takes {nbytes:,}: nothing was saved", self._wait_for(nbytes - room)))
            snapshot_id = secrets.token_hex(ID_BYTES)
            staging = self.root / f"{STAGING}{snapshot_id}"
            staging.mkdir()
            if owner.key:
                _write_owner(staging, owner)
            _write_durably(staging / RESERVATION, json.dumps({"bytes": nbytes}).encode())
            self._stamp(staging / RESERVATION)
        return snapshot_id

    def staging(self, snapshot_id: str) -> Path:
        """The folder where every rank writes its files of a reserved snapshot (`staging_folder`)."""
        return staging_folder(self.root, snapshot_id)

    def publish(self, snapshot_id: str, manifest: Manifest) -> int:
        """Make a written snapshot visible (on its owner, once every rank's files are written): each listed file
        must be there at its size; the manifest is written (temporary name, fsync, rename), then the staging
        folder is renamed to the id. Returns the snapshot's bytes."""
        text = manifest.to_text().encode()
        Manifest.parse(text, snapshot_id)  # what is published is what a reader accepts
        staging = self.staging(snapshot_id)
        for entry in manifest.files:
            if not _is_file(staging / entry.name, entry.bytes):
                raise invalid(f"{entry.name} is not written at its {entry.bytes} bytes: not published")
        _write_durably(staging / MANIFEST_NAME, text)
        (staging / RESERVATION).unlink()
        fsync_folder(staging)
        with self._locked():
            final = self.root / snapshot_id
            os.rename(staging, final)
            self._stamp(final)
            fsync_folder(self.root)
        return manifest.total_bytes + len(text)

    def ownership(self, snapshot_id: str) -> Ownership:
        """Whose a published snapshot (or a save under way) is: SnapshotError SNAPSHOT_UNKNOWN when there is none."""
        folder = self.root / check_id(snapshot_id)
        if not _is_folder(folder):
            folder = self.root / f"{STAGING}{snapshot_id}"
            if not _is_folder(folder):
                raise SnapshotError(Refusal(SNAPSHOT_UNKNOWN, f"no snapshot {snapshot_id} in this store"))
        return _read_owner(folder)

    def share(self, snapshot_id: str, key: str, shared: bool) -> None:
        """Its owner (`key`, a hash) shares a published snapshot with every key that holds its id, or takes it back.
        SnapshotError: SNAPSHOT_UNKNOWN, SNAPSHOT_NOT_YOURS."""
        folder = self.root / check_id(snapshot_id)
        with self._locked():
            if not _is_folder(folder):
                raise SnapshotError(Refusal(SNAPSHOT_UNKNOWN, f"no snapshot {snapshot_id} in this store"))
            if not key or _read_owner(folder).key != key:
                raise not_yours(snapshot_id, "only its owner shares it")
            _write_owner(folder, Ownership(key, shared))

    def saves_of(self, key: str) -> tuple[list[KeySnapshot], int]:
        """A key's published snapshots, oldest first, and the bytes it holds (its saves under way too)."""
        with self._locked():
            self._sweep()
            saved = [KeySnapshot(p.name, _folder_bytes(p), p.stat().st_mtime, owner.shared) for p in self._published()
                     if (owner := _read_owner(p)).key == key]
            return sorted(saved, key=lambda s: s.created_unix_s), self._usage(key)

    def release(self, snapshot_id: str) -> bool:
        """Delete a published snapshot its world no longer needs (its holder said so with a newer save, or a parked
        world's copy once it is back): it frees its bytes at once, and a resume of it is SNAPSHOT_UNKNOWN. Returns
        whether there was one."""
        folder, trash = self.root / check_id(snapshot_id), self.root / f"{TRASH}{secrets.token_hex(8)}"
        with self._locked():
            if not _is_folder(folder):
                return False
            os.rename(folder, trash)
        shutil.rmtree(trash, ignore_errors=True)  # a sweep removes what is left (a fault)
        return True

    def abandon(self, snapshot_id: str) -> None:
        """Drop a save that failed (its staging folder and what was written into it)."""
        shutil.rmtree(self.root / f"{STAGING}{check_id(snapshot_id)}", ignore_errors=True)

    # -- resuming ---------------------------------------------------------------------------------

    def open(self, snapshot_id: str) -> Snapshot:
        """A published snapshot, its manifest checked and each file present at its size (the SHA-256s are checked
        by each reader before it reads: restore). SnapshotError: INVALID_INPUT (not an id), SNAPSHOT_PENDING (its
        save is under way), SNAPSHOT_UNKNOWN, SNAPSHOT_EXPIRED, SNAPSHOT_INVALID."""
        folder = self.root / check_id(snapshot_id)
        published_s = _mtime(folder) if _is_folder(folder) else None
        if published_s is None:
            if _is_folder(self.root / f"{STAGING}{snapshot_id}"):
                raise SnapshotError(Refusal(SNAPSHOT_PENDING, f"snapshot {snapshot_id} is still being saved; resume it "
                                            "again in a moment", PENDING_RETRY_S))
            if (self.root / f"{EXPIRED}{snapshot_id}").exists():
                raise SnapshotError(Refusal(SNAPSHOT_EXPIRED, f"snapshot {snapshot_id} expired after the store's "
                                            f"time to live of {self.ttl_s:g} s"))
            raise SnapshotError(Refusal(SNAPSHOT_UNKNOWN, f"no snapshot {snapshot_id} in this store"))
        if self.clock() - published_s >= self.ttl_s:
            raise SnapshotError(Refusal(SNAPSHOT_EXPIRED, f"snapshot {snapshot_id} is past the store's time to live "
                                        f"of {self.ttl_s:g} s"))
        manifest = Manifest.parse(_read_small(folder / MANIFEST_NAME), snapshot_id)
        for entry in manifest.files:
            if not _is_file(folder / entry.name, entry.bytes):
                raise invalid(f"{entry.name} is missing or not its {entry.bytes} bytes (truncated or replaced)")
        return Snapshot(folder, manifest)

    # -- limits -----------------------------------------------------------------------------------

    def sweep(self) -> None:
        """Remove what outlived the time to live: snapshots (oldest first, each leaving an expired marker),
        abandoned staging folders, and old markers."""
        with self._locked():
            self._sweep()

    def usage(self, key: str | None = None) -> int:
        """Bytes the store holds: its published snapshots and the saves under way (at least their reservations); a
        key's alone with `key` (a hash)."""
        with self._locked():
            return self._usage(key)

    def _sweep(self) -> None:
        now = self.clock()
        for age, path in sorted(((now - p.stat().st_mtime, p) for p in self._published()), reverse=True):
            if age >= self.ttl_s:
                _write_durably(self.root / f"{EXPIRED}{path.name}", b"")
                self._stamp(self.root / f"{EXPIRED}{path.name}")
                trash = self.root / f"{TRASH}{secrets.token_hex(8)}"
                os.rename(path, trash)
                shutil.rmtree(trash, ignore_errors=True)
        for path in self.root.iterdir():
            if path.name.startswith(TRASH):
                shutil.rmtree(path, ignore_errors=True)
            elif path.name.startswith(STAGING) and now - _made_s(path) >= self.ttl_s:
                shutil.rmtree(path, ignore_errors=True)
            elif path.name.startswith(EXPIRED) and now - path.stat().st_mtime >= self.ttl_s:
                path.unlink(missing_ok=True)

    def _usage(self, key: str | None = None) -> int:
        used = sum(_folder_bytes(p) for p in self._published() if key is None or _read_owner(p).key == key)
        for path in self.root.glob(f"{STAGING}*"):
            if key is None or _read_owner(path).key == key:
                used += max(_folder_bytes(path), _reserved(path))
        return used

    def _room(self) -> int:
        """Bytes the store's filesystem can still take: its free bytes less what the saves under way reserved and
        have not written yet."""
        unwritten = sum(max(0, _reserved(p) - _folder_bytes(p)) for p in self.root.glob(f"{STAGING}*"))
        return shutil.disk_usage(self.root).free - unwritten

    def _wait_for(self, needed: int, key: str | None = None) -> float:
        """Seconds until the oldest snapshots' (`key`'s alone, given one) expiry frees `needed` bytes (a time to live
        when only saves under way could free them)."""
        now, freed = self.clock(), 0
        published = [p for p in self._published() if key is None or _read_owner(p).key == key]
        for path in sorted(published, key=lambda p: p.stat().st_mtime):
            freed += _folder_bytes(path)
            if freed >= needed:
                return max(1.0, path.stat().st_mtime + self.ttl_s - now)
        return self.ttl_s

    def _published(self) -> list[Path]:
        return [p for p in self.root.iterdir() if ID_PATTERN.fullmatch(p.name) and _is_folder(p)]

    def _stamp(self, path: Path) -> None:
        """Its mtime is now, by the store's clock: the times to live count from it."""
        now = self.clock()
        os.utime(path, (now, now))

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        descriptor = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX)
            yield
        finally:
            os.close(descriptor)


def _write_durably(path: Path, data: bytes) -> None:
    """`data` under `path`: a temporary name, fsync, rename, fsync of the folder."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        with open(temporary, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def _write_owner(folder: Path, owner: Ownership) -> None:
    _write_durably(folder / OWNER, json.dumps({"key": owner.key, "shared": owner.shared}).encode())


def _read_owner(folder: Path) -> Ownership:
    """A snapshot folder's owner: nobody's without its file (a snapshot saved without a key); one that cannot be
    read is its key's alone, shared with nobody (an unreadable file opens nothing)."""
    try:
        with open(folder / OWNER, "rb") as f:
            data = json.loads(f.read(MAX_OWNER_BYTES + 1))
    except FileNotFoundError:
        return Ownership()
    except (OSError, ValueError):
        return Ownership(key="?")
    if not isinstance(data, dict) or not isinstance(data.get("key"), str) or not isinstance(data.get("shared"), bool):
        return Ownership(key="?")
    return Ownership(data["key"], data["shared"])


def _read_small(path: Path) -> bytes:
    """A manifest's bytes (a plain file, at most MAX_MANIFEST_BYTES); SNAPSHOT_INVALID otherwise."""
    if not _is_file(path):
        raise invalid("its manifest is missing")
    with open(path, "rb") as f:
        data = f.read(MAX_MANIFEST_BYTES + 1)
    if len(data) > MAX_MANIFEST_BYTES:
        raise invalid(f"its manifest is larger than {MAX_MANIFEST_BYTES} bytes")
    return data


def _is_folder(path: Path) -> bool:
    with contextlib.suppress(FileNotFoundError):
        return stat.S_ISDIR(os.lstat(path).st_mode)
    return False


def _is_file(path: Path, size: int | None = None) -> bool:
    with contextlib.suppress(FileNotFoundError):
        info = os.lstat(path)
        return stat.S_ISREG(info.st_mode) and (size is None or info.st_size == size)
    return False


def _mtime(path: Path) -> float | None:
    with contextlib.suppress(FileNotFoundError):
        return path.stat().st_mtime
    return None


def _folder_bytes(folder: Path) -> int:
    with contextlib.suppress(FileNotFoundError):
        return sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(folder))
    return 0


def _reserved(staging: Path) -> int:
    """A staging folder's reservation (0 once its owner is publishing it)."""
    with contextlib.suppress(FileNotFoundError, ValueError, KeyError, TypeError):
        return int(json.loads((staging / RESERVATION).read_text())["bytes"])
    return 0


def _made_s(staging: Path) -> float:
    """When a save was reserved: its reservation's mtime (the folder's once it is being published)."""
    with contextlib.suppress(FileNotFoundError):
        return (staging / RESERVATION).stat().st_mtime
    return staging.stat().st_mtime
