"""What a rank reads back from a snapshot, on any layout: its global heads of the K/V from whichever kv files hold
them, its band of the decoder's state reassembled from the saved bands, the session's own state, and on
ENCODER_RANK the condition encoder's. Every file is verified (size, SHA-256) before a tensor is read from it;
anything that does not fit its manifest raises SnapshotError (SNAPSHOT_INVALID). All tensors come back on the CPU.
"""
from __future__ import annotations

import contextlib
import dataclasses
import typing
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ...api import contract
from ...api.request import SessionRequest, check_request
from ...model.condition import ConditionState
from ...model.tiny_vae import TinyDecodeState
from ...model.vae import DecodeState
from ..session import CommitRecord
from .capture import MARKERS, REQUEST_ARRAYS, REQUEST_NOT_KEPT, TENSOR
from .files import laid_out, reading
from .manifest import CONDITION, DECODE, KV, SHARED, FileEntry, Snapshot, SnapshotError, invalid

CHOICES = {"on_starve": contract.ON_STARVE, "pose_scale": contract.POSE_SCALES}


@dataclass
class SharedState:
    """The session's own state, as its owner saved it."""

    request: SessionRequest
    block_index: int
    prompt: str  # in force
    generator: torch.Tensor  # torch.Generator state
    camera: dict  # started, fixed_scale, running_scale
    camera_tensors: dict[str, torch.Tensor]
    commits: list[CommitRecord] | None


@dataclass
class KvShard:
    keys: list[torch.Tensor]  # per layer [length, heads, head_dim]
    values: list[torch.Tensor]
    length: int
    evicted_tokens: int
    capacity: int


@contextlib.contextmanager
def faults_as_invalid(what: str) -> Iterator[None]:
    """Any fault reading `what` but a SnapshotError becomes one (SNAPSHOT_INVALID): a manifest's meta of the wrong
    form, a tensor missing or of another shape, a file safetensors cannot parse."""
    try:
        yield
    except SnapshotError:
        raise
    except Exception as exc:
        raise invalid(f"{what} does not fit its manifest ({exc.__class__.__name__}: {str(exc)[:200]})") from exc


def read_request(snapshot: Snapshot) -> SessionRequest:
    """The saved session's request (its start inputs and parameters), checked as a new request's are."""
    return read_shared(snapshot).request


def read_shared(snapshot: Snapshot) -> SharedState:
    entry = snapshot.manifest.entry(SHARED)
    with faults_as_invalid(entry.name), reading(snapshot.folder, entry, snapshot.check_hashes) as f:
        names, meta = set(f.keys()), entry.meta
        arrays = {name: f.get_tensor(name).numpy() if name in names else None for name in REQUEST_ARRAYS}
        request = _request(meta["request"], arrays)
        camera = meta["camera"]
        commits = None
        if meta["commits"] is not None:
            commits = [CommitRecord(_whole(r["first_frame"]), f.get_tensor(f"commit.{i}.latents"),
                                    float(r["timestep"]), f.get_tensor(f"commit.{i}.poses"),
                                    f.get_tensor(f"commit.{i}.condition")) for i, r in enumerate(meta["commits"])]
        return SharedState(request, _whole(meta["block_index"]), _text(meta["prompt"]), f.get_tensor("generator"),
                           {"started": bool(camera["started"]), "running_scale": float(camera["running_scale"]),
                            "fixed_scale": None if camera["fixed_scale"] is None else float(camera["fixed_scale"])},
                           {n: f.get_tensor(n) for n in names if n.startswith("camera.")}, commits)


def read_kv(snapshot: Snapshot, heads: tuple[int, int], num_layers: int, head_dim: int,
            dtype: torch.dtype) -> KvShard:
    """Global heads [first, end) of every layer's K/V, from every kv file that holds some of them."""
    first, end = heads
    entries = snapshot.manifest.entries(KV)
    with faults_as_invalid("the kv files"):
        counts = {(_whole(e.meta["length"]), _whole(e.meta["evicted_tokens"]), _whole(e.meta["capacity"]))
                  for e in entries}
        if len(counts) != 1:
            raise invalid("the kv files disagree on the committed length")
        ((length, evicted, capacity),) = counts
        pieces: list[list[torch.Tensor]] = [[] for _ in range(2 * num_layers)]
        for entry in entries:
            low, high = max(first, entry.heads[0]), min(end, entry.heads[1])
            if low >= high:
                continue
            with reading(snapshot.folder, entry, snapshot.check_hashes) as f:
                for i, name in enumerate(f"{kind}.{layer}" for layer in range(num_layers) for kind in "kv"):
                    piece = f.get_slice(name)[:, low - entry.heads[0] : high - entry.heads[0]]
                    if piece.shape != (length, high - low, head_dim) or piece.dtype != dtype:
                        raise invalid(f"{entry.name}: {name} is {piece.dtype} {list(piece.shape)}, not {dtype} "
                                      f"[{length}, {high - low}, {head_dim}]")
                    pieces[i].append(piece)
        layers = [torch.cat(p, dim=1) for p in pieces]
    return KvShard(layers[0::2], layers[1::2], length, evicted, capacity)


def read_condition(snapshot: Snapshot) -> ConditionState:
    entry = snapshot.manifest.entry(CONDITION)
    with faults_as_invalid(entry.name), reading(snapshot.folder, entry, snapshot.check_hashes) as f:
        names, meta = set(f.keys()), entry.meta

        def tensor(name: str) -> torch.Tensor | None:
            return laid_out(f.get_tensor(name), entry, name) if name in names else None

        slots = meta["slots"]
        cache = None if slots is None else [_slot(slot, lambda i=i: tensor(f"cache.{i}")) for i, slot in enumerate(slots)]
        return ConditionState(image=tensor("image"), feature_cache=cache, encoded_frames=_whole(meta["encoded_frames"]),
                              previous=tensor("previous"), steady=tensor("steady"),
                              zero_chunks=_whole(meta["zero_chunks"]),
                              stats={k: _whole(meta["stats"][k]) for k in ("encoded", "reused")})


def read_decode(snapshot: Snapshot, rows: tuple[int, int]) -> DecodeState | TinyDecodeState | None:
    """The decoder's state for latent rows [first, end) (the whole height where one rank decodes), reassembled
    from the saved bands; None when the snapshot holds none."""
    entries = snapshot.manifest.entries(DECODE)
    if not entries:
        return None
    with faults_as_invalid("the decode files"):
        kinds = {(e.meta["decoder"], _whole(e.meta["decoded_latent_frames"])) for e in entries}
        if len(kinds) != 1:
            raise invalid("the decode files disagree on their decoder or its position")
        ((decoder, decoded),) = kinds
        if decoder == "tiny":
            return TinyDecodeState(_tiny_memory(snapshot, entries), decoded)
        if decoder != "vae":
            raise invalid(f"decode files of an unknown decoder {str(decoder)[:20]!r}")
        return DecodeState(_vae_band(snapshot, entries, rows), decoded)


def _vae_band(snapshot: Snapshot, entries: list[FileEntry], rows: tuple[int, int]) -> list:
    first, end = rows
    overlapping = [e for e in entries if e.rows[0] < end and first < e.rows[1]]
    slots = overlapping[0].meta["slots"]
    if any(e.meta["slots"] != slots for e in entries):
        raise invalid("the decode files disagree on their feature cache's slots")
    pieces: dict[int, list[torch.Tensor]] = {i: [] for i, slot in enumerate(slots) if slot == TENSOR}
    for entry in overlapping:
        band = entry.rows[1] - entry.rows[0]
        with reading(snapshot.folder, entry, snapshot.check_hashes) as f:
            for i, found in pieces.items():
                part = f.get_slice(f"cache.{i}")
                shape = part.get_shape()
                factor, rest = divmod(shape[-2], band)
                if rest or len(shape) < 2:
                    raise invalid(f"{entry.name}: cache.{i}'s {shape[-2]} rows are not a multiple of its band's {band}")
                low, high = (max(first, entry.rows[0]) - entry.rows[0]) * factor, (min(end, entry.rows[1])
                                                                                  - entry.rows[0]) * factor
                found.append(part[(slice(None),) * (len(shape) - 2) + (slice(low, high), slice(None))])
    top = overlapping[0]
    return [_slot(slot, lambda i=i: laid_out(torch.cat(pieces[i], dim=-2), top, f"cache.{i}")) for i, slot in
            enumerate(slots)]


def _tiny_memory(snapshot: Snapshot, entries: list[FileEntry]) -> dict[int, torch.Tensor]:
    (entry,) = entries  # the owner decodes whole frames
    with reading(snapshot.folder, entry, snapshot.check_hashes) as f:
        return {int(name.split(".")[1]): laid_out(f.get_tensor(name), entry, name) for name in f.keys()}


def _slot(slot: object, tensor) -> torch.Tensor | str | None:
    """A feature cache slot as saved (capture.cache_tensors): None, a known marker, or its tensor."""
    if slot is None:
        return None
    if slot == TENSOR:
        return tensor()
    if isinstance(slot, dict) and slot.get("marker") in MARKERS:
        return slot["marker"]
    raise invalid(f"a feature cache slot of an unknown kind {str(slot)[:40]}")


def _request(fields: dict, arrays: dict[str, np.ndarray | None]) -> SessionRequest:
    """The saved request: every field present with its declared type, its arrays, and its inputs checked."""
    hints = typing.get_type_hints(SessionRequest)
    kept = [f.name for f in dataclasses.fields(SessionRequest) if f.name not in REQUEST_ARRAYS + REQUEST_NOT_KEPT]
    if set(fields) != set(kept):
        raise invalid("the shared file's request fields are not a session request's")
    for name in kept:
        value = fields[name]
        if not isinstance(value, hints[name]) or (isinstance(value, bool) and hints[name] is not bool):
            raise invalid(f"the saved request's {name} is not a {hints[name]}")
        if name in CHOICES and value not in CHOICES[name]:
            raise invalid(f"the saved request's {name} is not one of {CHOICES[name]}")
    request = SessionRequest(**fields, **arrays)
    check_request(request)
    return request


def _whole(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise invalid(f"{str(value)[:20]!r} where a whole number >= 0 belongs")
    return value


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise invalid("a text field is not a string")
    return value
