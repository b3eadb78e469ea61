"""A recorded world: what the server used for every block, enough to replay it bit for bit on any group size.

One `.npz` file (numpy's zip of arrays, read without pickle): `meta`, a JSON text that names the format and version
and holds the start inputs (prompt, seed, size), the server's `settings_used` and one entry per block (its frame
count, whether it was held, its prompt event, the SHA-256 of its latents) and the session's durable snapshots not
released since (`snapshots`: each id and the block it follows; absent in recordings written before snapshots, read
as none); `image`, the first frame as sent (once); `camera`, every video frame's camera-to-world pose as the server
ran it (float32 [n, 4, 4]); `intrinsics` when the session sent them. `Recording.load` checks all of it and names
what is wrong.
"""
from __future__ import annotations

import json
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from backend.api.codec import BlockResponse
from backend.api.contract import MAX_INPUT_PIXELS, SNAPSHOT_ID_PATTERN, block_video_frames
from backend.api.provenance import parse_settings
from backend.api.request import SessionRequest, check_pose_count, check_poses, check_prompt

FORMAT = "lingbot-world-recording"
VERSION = 1
ABOUT = ("A LingBot-World session as the server ran it: replay it with `python -m client replay FILE`. Arrays: "
         "image (first frame, uint8 [H, W, 3]), camera (camera-to-world pose of every video frame, float32 "
         "[n, 4, 4], OpenCV axes), intrinsics (optional, float32 [k, 4]); meta.blocks[i].frames of camera's rows "
         "belong to block i.")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SNAPSHOT_ID = re.compile(SNAPSHOT_ID_PATTERN)


class RecordingError(ValueError):
    """A recording that cannot be read or replayed; the message names what is wrong."""


@dataclass(frozen=True)
class RecordedBlock:
    camera: np.ndarray  # float32 [n, 4, 4]: the block's new video frames' poses, as the server ran them
    latents_sha256: str
    held: bool = False  # ran on held controls (its step came late)
    event: str | None = None  # the prompt event that took effect at this block: the prompt from here on
    recache: bool = False  # with the event, the cached frames were recomputed under it (request parameter recache)


@dataclass
class Recording:
    image: np.ndarray  # uint8 [H, W, 3], as sent
    prompt: str  # the session's first prompt
    seed: int
    height: int
    width: int
    settings: str  # the server's settings_used (api/provenance)
    intrinsics: np.ndarray | None = None  # float32 [k, 4], as sent
    blocks: list[RecordedBlock] = field(default_factory=list)
    snapshots: dict[str, int] = field(default_factory=dict)  # snapshot id -> the block it follows (kept ones)

    @property
    def block_frames(self) -> int:
        return int(parse_settings(self.settings, "settings")["block_frames"])

    @property
    def events(self) -> dict[int, str]:
        return {i: b.event for i, b in enumerate(self.blocks) if b.event is not None}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "format": FORMAT, "version": VERSION, "about": ABOUT,
            "prompt": self.prompt, "seed": self.seed, "height": self.height, "width": self.width,
            "settings": self.settings,
            "blocks": [{"frames": len(b.camera), "held": b.held, "event": b.event, "recache": b.recache,
                        "latents_sha256": b.latents_sha256} for b in self.blocks],
            "snapshots": [{"id": i, "block": k} for i, k in self.snapshots.items()],
        }
        arrays = {"meta": np.array(json.dumps(meta)), "image": self.image,
                  "camera": np.concatenate([b.camera for b in self.blocks]).astype(np.float32)}
        if self.intrinsics is not None:
            arrays["intrinsics"] = np.asarray(self.intrinsics, dtype=np.float32)
        partial = path.with_name(f".{path.name}.partial")
        with partial.open("wb") as f:  # a path without the .npz suffix keeps its name
            np.savez_compressed(f, **arrays)
        partial.replace(path)  # whole or not at all: a reader never sees half a file
        return path

    @classmethod
    def load(cls, path: str | Path) -> Recording:
        try:
            arrays = _read_arrays(Path(path))
        except FileNotFoundError:
            raise RecordingError(f"{path}: no such file") from None
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            raise RecordingError(f"{path}: not a readable recording (truncated, or not an .npz file): {exc}") from None
        try:
            return _parse(arrays)
        except RecordingError as exc:
            raise RecordingError(f"{path}: {exc}") from None
        except (ValueError, TypeError, OverflowError, RecursionError) as exc:  # InputError among them
            raise RecordingError(f"{path}: {exc}") from None


# The arrays a recording may hold and the most bytes each may take (checked before anything is read or allocated).
MAX_BYTES = {"meta": 32 << 20, "image": MAX_INPUT_PIXELS * 3, "camera": 64 << 20, "intrinsics": 16 << 20}
MAX_SIDE = 1 << 16  # height and width


def _read_arrays(path: Path) -> dict[str, np.ndarray]:
    """The zip's arrays, each checked against MAX_BYTES from its header before its data is read."""
    arrays = {}
    with zipfile.ZipFile(path) as z:
        members = {info.filename: info for info in z.infolist()}
        if unknown := sorted(set(members) - {f"{name}.npy" for name in MAX_BYTES}):
            raise RecordingError(f"unexpected member(s) {unknown}; a recording holds {sorted(MAX_BYTES)}")
        for name, limit in MAX_BYTES.items():
            if (info := members.get(f"{name}.npy")) is None:
                continue
            with z.open(info) as f:
                version = np.lib.format.read_magic(f)
                shape, fortran, dtype = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                                         else np.lib.format.read_array_header_2_0)(f)
                if dtype.hasobject:
                    raise RecordingError(f"{name} holds Python objects; a recording holds plain arrays")
                nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                if nbytes > limit:
                    raise RecordingError(f"{name} declares {nbytes} bytes; at most {limit}")
                data = f.read(nbytes)
                if len(data) != nbytes:
                    raise RecordingError(f"{name} is truncated ({len(data)} of {nbytes} bytes)")
            array = np.frombuffer(data, dtype)
            arrays[name] = array.reshape(shape[::-1]).T if fortran else array.reshape(shape)
    return arrays


def _parse(arrays: dict[str, np.ndarray]) -> Recording:
    missing = [name for name in ("meta", "image", "camera") if name not in arrays]
    if missing:
        raise RecordingError(f"missing array(s) {missing}")
    try:
        meta = json.loads(str(arrays["meta"]))
    except json.JSONDecodeError as exc:
        raise RecordingError(f"meta is not JSON: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise RecordingError(f"not a LingBot-World recording (meta.format is not {FORMAT!r})")
    if meta.get("version") != VERSION:
        raise RecordingError(f"recording version {meta.get('version')!r}; this client reads version {VERSION}")
    prompt = _field(meta, "prompt", str)
    check_prompt(prompt)
    seed, height, width = (_field(meta, name, int) for name in ("seed", "height", "width"))
    if not (0 < height <= MAX_SIDE and 0 < width <= MAX_SIDE):
        raise RecordingError(f"meta.height and meta.width must be 1 to {MAX_SIDE}; got {height}x{width}")
    if not -(2**63) <= seed < 2**63:
        raise RecordingError(f"meta.seed {seed} does not fit in 64 bits")
    settings = _field(meta, "settings", str)
    block_frames = int(parse_settings(settings, "meta.settings")["block_frames"])
    if block_frames < 1:
        raise RecordingError(f"meta.settings: block_frames must be at least 1; got {block_frames}")
    image = arrays["image"]
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise RecordingError(f"image must be uint8 [H, W, 3]; got {image.dtype} {list(image.shape)}")
    intrinsics = arrays.get("intrinsics")
    if intrinsics is not None and (intrinsics.dtype != np.float32 or intrinsics.ndim != 2 or intrinsics.shape[1] != 4
                                   or not np.isfinite(intrinsics).all()):
        raise RecordingError(f"intrinsics must be finite float32 [k, 4]; got {intrinsics.dtype} {list(intrinsics.shape)}")
    entries = _field(meta, "blocks", list)
    if not entries:
        raise RecordingError("meta.blocks is empty: a recording holds at least one block")
    camera = arrays["camera"]
    if camera.dtype != np.float32 or camera.ndim != 3 or camera.shape[1:] != (4, 4):
        raise RecordingError(f"camera must be float32 [n, 4, 4]; got {camera.dtype} {list(camera.shape)}")
    counts = [_field(e, "frames", int, f"meta.blocks[{i}]") if isinstance(e, dict) else None
              for i, e in enumerate(entries)]
    if None in counts:
        raise RecordingError(f"meta.blocks[{counts.index(None)}] is not an object")
    if sum(counts) != len(camera):
        raise RecordingError(f"meta.blocks count {sum(counts)} frames but camera holds {len(camera)} poses")
    blocks, start = [], 0
    for i, (entry, frames) in enumerate(zip(entries, counts)):
        where = f"meta.blocks[{i}]"
        if frames != (want := block_video_frames(block_frames, first=i == 0)):
            raise RecordingError(f"{where}.frames is {frames}; block {i} has {want} at block_frames={block_frames}")
        poses = camera[start : start + frames]
        start += frames
        check_pose_count(poses, frames, f"camera poses of block {i}")
        check_poses(poses, f"camera poses of block {i}")
        sha = _field(entry, "latents_sha256", str, where)
        if not _SHA256.fullmatch(sha):
            raise RecordingError(f"{where}.latents_sha256 is not 64 lowercase hex digits")
        event = entry.get("event")
        if event is not None:
            if not isinstance(event, str) or i == 0:
                raise RecordingError(f"{where}.event must be text, and block 0 takes the session's own prompt")
            check_prompt(event)
        recache = entry.get("recache", False)  # absent before recaches were recorded
        if not isinstance(recache, bool) or (recache and event is None):
            raise RecordingError(f"{where}.recache must be true or false, and true only with an event")
        blocks.append(RecordedBlock(poses, sha, bool(_field(entry, "held", bool, where)), event, recache))
    return Recording(image, prompt, seed, height, width, settings, intrinsics, blocks,
                     _snapshots(meta.get("snapshots", []), len(blocks)))


def _snapshots(entries: Any, blocks: int) -> dict[str, int]:
    """meta.snapshots: each a snapshot id and a recorded block it follows."""
    if not isinstance(entries, list):
        raise RecordingError("meta.snapshots must be a list")
    snapshots = {}
    for i, entry in enumerate(entries):
        where = f"meta.snapshots[{i}]"
        if not isinstance(entry, dict):
            raise RecordingError(f"{where} is not an object")
        snapshot_id, block = _field(entry, "id", str, where), _field(entry, "block", int, where)
        if not _SNAPSHOT_ID.fullmatch(snapshot_id) or snapshot_id in snapshots:
            raise RecordingError(f"{where}.id must be a snapshot id ({SNAPSHOT_ID_PATTERN}), each once")
        if not 0 <= block < blocks:
            raise RecordingError(f"{where}.block is {block}; the recording holds blocks 0 to {blocks - 1}")
        snapshots[snapshot_id] = block
    return snapshots


def _field(meta: dict[str, Any], name: str, kind: type, where: str = "meta") -> Any:
    if name not in meta:
        raise RecordingError(f"{where} lacks {name!r}")
    value = meta[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RecordingError(f"{where}.{name} must be {kind.__name__}; got {type(value).__name__}")
    return value


class Recorder:
    """Builds a recording from a session's request and its blocks, as they arrive (the request must ask for
    return_used, so every block says what it was made from)."""

    def __init__(self, request: SessionRequest) -> None:
        if not request.return_used:
            raise ValueError("a recorded session's request needs return_used=True")
        self.request = request
        self.recording: Recording | None = None
        self._prompt = request.prompt  # in force before the next block

    def add(self, block: BlockResponse) -> None:
        used = block.used
        if used is None:
            raise RecordingError(f"block {block.block_index} came without what it was made from (return_used)")
        if self.recording is None:
            if used.settings is None:
                raise RecordingError("the session's first block came without the server's settings_used")
            r = self.request
            self.recording = Recording(r.image, r.prompt, r.seed, r.height, r.width, used.settings, r.intrinsics)
        event = used.prompt if used.prompt != self._prompt or used.recached else None
        self._prompt = used.prompt
        self.recording.blocks.append(RecordedBlock(used.camera, used.latents_sha256, block.held, event,
                                                   used.recached))

    def note_snapshot(self, snapshot_id: str, block_index: int, released: str = "") -> None:
        """A durable snapshot of the session, after its block `block_index` (recorded already); `released`: an
        older one it released, gone from the store, so no longer one the recording can replay from."""
        if self.recording is None or not 0 <= block_index < len(self.recording.blocks):
            raise RecordingError(f"snapshot {snapshot_id} follows block {block_index}, which was not recorded")
        self.recording.snapshots[snapshot_id] = block_index
        self.recording.snapshots.pop(released, None)

    def save(self, path: str | Path) -> Path | None:
        """Write what was recorded (None: no block arrived, nothing written)."""
        return None if self.recording is None else self.recording.save(path)
