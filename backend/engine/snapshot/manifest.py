"""A snapshot's table of contents (`manifest.json`): its id, the settings and model it was made on, the rank grid
that saved it, and each file's role, size, SHA-256 and share (a kv file's global heads, a decode file's latent
rows); and the checks a manifest passes before any of its files is read (torch-free).

A manifest names only files of the fixed `FILE_NAME` pattern, so no entry can point outside its folder.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ...api.contract import SNAPSHOT_INVALID
from ...api.refusal import Refusal

FORMAT = "lingbot-world-snapshot"
VERSION = 2  # version 1 named the grid "layout"; it is read as well
GRID_FIELD = {1: "layout", 2: "grid"}
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 20  # a manifest lists a few files per rank: kilobytes
SUFFIX = ".safetensors"
SHARED, CONDITION, KV, DECODE = "shared", "condition", "kv", "decode"
ROLES = (SHARED, CONDITION, KV, DECODE)
# shared and condition are written once (by the owner, by ENCODER_RANK); kv-R and decode-R by rank R.
FILE_NAME = re.compile(r"(shared|condition|kv-\d{1,4}|decode-\d{1,4})\.safetensors")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")


class SnapshotError(Exception):
    """A snapshot refused (saved, opened or resumed): its code, sentence and any retry time (`refusal`)."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


def invalid(sentence: str) -> SnapshotError:
    return SnapshotError(Refusal(SNAPSHOT_INVALID, sentence))


def file_name(role: str, rank: int) -> str:
    """shared.safetensors, condition.safetensors, kv-R.safetensors, decode-R.safetensors."""
    return f"{role}{SUFFIX}" if role in (SHARED, CONDITION) else f"{role}-{rank}{SUFFIX}"


@dataclass(frozen=True)
class FileEntry:
    """One written file as its writer reports it (the serving loop brings every rank's entries to the owner)."""

    name: str
    role: str
    rank: int  # the rank that wrote it
    bytes: int
    sha256: str
    heads: tuple[int, int] | None  # kv: the global heads [first, end) it holds
    rows: tuple[int, int] | None  # decode: the latent rows [first, end) of its band (the whole height unsplit)
    meta: dict[str, Any]  # what its tensors need beside them (restore reads it)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Any, where: str) -> FileEntry:
        fields = _object(raw, where, {"name", "role", "rank", "bytes", "sha256", "heads", "rows", "meta"})
        name, role = _string(fields["name"], f"{where}.name"), _string(fields["role"], f"{where}.role")
        rank, size = _integer(fields["rank"], f"{where}.rank"), _integer(fields["bytes"], f"{where}.bytes")
        if not FILE_NAME.fullmatch(name) or name != file_name(role, rank):
            raise invalid(f"manifest: {where}.name {name[:60]!r} is not the {role!r} file of rank {rank}")
        if role not in ROLES or size <= 0 or not SHA256_HEX.fullmatch(_string(fields["sha256"], f"{where}.sha256")):
            raise invalid(f"manifest: {where} has an unknown role, no bytes or a malformed sha256")
        heads, rows = _span(fields["heads"], f"{where}.heads"), _span(fields["rows"], f"{where}.rows")
        if (heads is not None) != (role == KV) or (rows is not None) != (role == DECODE):
            raise invalid(f"manifest: {where}: a kv file (only) has heads, a decode file (only) rows")
        meta = fields["meta"]
        if not isinstance(meta, dict):
            raise invalid(f"manifest: {where}.meta is not an object")
        return cls(name, role, rank, size, fields["sha256"], heads, rows, meta)


@dataclass(frozen=True)
class Manifest:
    snapshot_id: str
    created_unix_s: float
    settings_used: str  # the engine's (api/provenance): a resume on other settings is refused
    model: dict[str, int]  # num_layers, num_heads, head_dim (the K/V's geometry), z_dim (the latents')
    grid: dict[str, int]  # tp_degree, sp_degree, latent_rows (the session's; decode bands split them)
    files: tuple[FileEntry, ...]

    def to_text(self) -> str:
        body = {"format": FORMAT, "version": VERSION, "id": self.snapshot_id, "created_unix_s": self.created_unix_s,
                "settings_used": self.settings_used, "model": self.model, "grid": self.grid,
                "files": [f.to_json() for f in self.files]}
        return json.dumps(body, indent=1, sort_keys=True)

    def entries(self, role: str) -> list[FileEntry]:
        """The files of one role, kv by heads and decode by rows (top first)."""
        found = [f for f in self.files if f.role == role]
        return sorted(found, key=lambda f: f.heads or f.rows or (0, 0))

    def entry(self, role: str) -> FileEntry:
        (found,) = self.entries(role)
        return found

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    @classmethod
    def parse(cls, text: bytes, snapshot_id: str) -> Manifest:
        """The manifest of snapshot `snapshot_id`, checked: its form, and that its files make one whole session
        (one shared and one condition file, kv files whose heads tile [0, num_heads), none or whole decode
        bands). SnapshotError (SNAPSHOT_INVALID) names the first fault."""
        if len(text) > MAX_MANIFEST_BYTES:
            raise invalid(f"manifest: larger than {MAX_MANIFEST_BYTES} bytes")
        try:
            raw = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise invalid(f"manifest: not JSON ({exc.__class__.__name__})") from None
        version = raw.get("version") if isinstance(raw, dict) else None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT or type(version) is not int or version not in GRID_FIELD:
            raise invalid(f"manifest: not {FORMAT} version {' or '.join(map(str, GRID_FIELD))}")
        field = GRID_FIELD[version]
        top = _object(raw, "manifest", {"format", "version", "id", "created_unix_s", "settings_used", "model", field,
                                        "files"})
        if top["id"] != snapshot_id:
            raise invalid("manifest: its id is not its folder's")
        model = {k: _integer(v, f"model.{k}") for k, v in _object(top["model"], "model", MODEL_KEYS).items()}
        grid = {k: _integer(v, f"{field}.{k}") for k, v in _object(top[field], field, GRID_KEYS).items()}
        files = top["files"]
        if not isinstance(files, list):
            raise invalid("manifest: files is not a list")
        entries = tuple(FileEntry.from_json(f, f"files[{i}]") for i, f in enumerate(files))
        created = top["created_unix_s"]
        if not isinstance(created, (int, float)) or isinstance(created, bool):
            raise invalid("manifest: created_unix_s is not a number")
        manifest = cls(snapshot_id, float(created), _string(top["settings_used"], "settings_used"), model, grid,
                       entries)
        manifest.check_whole()
        return manifest

    def check_whole(self) -> None:
        """Its files make one session: raises SnapshotError (SNAPSHOT_INVALID) otherwise."""
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise invalid("manifest: a file is listed twice")
        ranks = self.grid["tp_degree"] * self.grid["sp_degree"]
        if ranks < 1 or any(not 0 <= f.rank < ranks for f in self.files):
            raise invalid(f"manifest: a file of a rank outside its {ranks}-rank grid")
        if len(self.entries(SHARED)) != 1 or len(self.entries(CONDITION)) != 1:
            raise invalid("manifest: it needs exactly one shared and one condition file")
        _check_tiling([f.heads for f in self.entries(KV)], self.model["num_heads"], "kv heads")
        if decode := self.entries(DECODE):
            _check_tiling([f.rows for f in decode], self.grid["latent_rows"], "decode rows")


@dataclass(frozen=True)
class Snapshot:
    """A snapshot opened for reading: its folder and its checked manifest (store.SnapshotStore.open)."""

    folder: Path
    manifest: Manifest
    # Each file's SHA-256 is checked before it is read; False: its size alone (a parked world's copy in the server's
    # own host memory, where a pass over every byte would be most of its unpark: docs/serving.md, "Parking").
    check_hashes: bool = True


MODEL_KEYS = {"num_layers", "num_heads", "head_dim", "z_dim"}
GRID_KEYS = {"tp_degree", "sp_degree", "latent_rows"}


def _check_tiling(spans: list[tuple[int, int]], end: int, what: str) -> None:
    """The spans, in order, cover [0, end) without a gap or an overlap."""
    edges = [0]
    for first, last in spans:
        if first != edges[-1] or last <= first:
            raise invalid(f"manifest: its {what} do not tile [0, {end})")
        edges.append(last)
    if edges[-1] != end or len(edges) < 2:
        raise invalid(f"manifest: its {what} do not tile [0, {end})")


def _object(raw: Any, where: str, keys: set[str]) -> dict[str, Any]:
    if not isinstance(raw, dict) or set(raw) != keys:
        raise invalid(f"manifest: {where} is not an object with exactly the keys {sorted(keys)}")
    return raw


def _string(raw: Any, where: str) -> str:
    if not isinstance(raw, str):
        raise invalid(f"manifest: {where} is not a string")
    return raw


def _integer(raw: Any, where: str) -> int:
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < 0:
        raise invalid(f"manifest: {where} is not a whole number >= 0")
    return raw


def _span(raw: Any, where: str) -> tuple[int, int] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) != 2:
        raise invalid(f"manifest: {where} is not [first, end]")
    return _integer(raw[0], where), _integer(raw[1], where)
