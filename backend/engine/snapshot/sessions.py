"""One rank of an engine saving a session into parts and opening one from a snapshot (docs/worlds.md): what the
serving loop (and its decode thread) calls at a save, and at a resume's opening.

Resuming is a collective, every rank alike: each rank first reads and checks what it needs (local: files, no
exchange), then the group agrees that every rank could (one all-reduce), and only then computes the prompt's text
K/V (a broadcast from ENCODER_RANK, as `open_session`). So a rank that finds a file bad refuses the resume on every
rank (SNAPSHOT_INVALID) and no rank is left waiting in an exchange.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from ...api.contract import SETTINGS_MISMATCH
from ...api.provenance import parse_settings, setting_differences, settings_of
from ...api.refusal import Refusal
from ...api.request import SessionRequest
from ...model.config import CheckpointConfigs
from ...model.condition import ConditionState, StreamingConditionEncoder
from ...model.feature_caches import condition_encoder_state, tiny_decoder_state, vae_decoder_state
from ...model.tiny_vae import StreamingTinyDecoder, TinyDecodeState
from ...model.vae import DecodeState, StreamingVae
from ...parallel.mesh import Mesh
from ...parallel.sequence import SequenceParallel
from ..camera_track import CameraTrack
from ..geometry import VideoGeometry
from ..session import CommitRecord, Decoding, Session
from ..settings import EngineSettings
from ..validation import EngineSpec, session_window_frames
from . import capture, size
from .files import Part
from .manifest import DECODE, FileEntry, Manifest, Snapshot, SnapshotError, invalid
from .restore import KvShard, SharedState, faults_as_invalid, read_condition, read_decode, read_kv, read_shared

log = logging.getLogger(__name__)


class Engine(Protocol):
    """What the snapshot code takes of an engine (rollout.WorldModelEngine): its rank's place, its model's parts, and
    a session's opening."""

    spec: EngineSpec
    settings: EngineSettings
    ckpt: CheckpointConfigs
    sp: SequenceParallel
    mesh: Mesh
    vae: StreamingVae | StreamingTinyDecoder
    conditions: StreamingConditionEncoder | None
    device: torch.device
    dtype: torch.dtype
    snapshot_facts: SnapshotFacts

    def open_session(self, request: SessionRequest, geometry: VideoGeometry, session_id: str | None = None,
                     owner: int = 0, keep_commits: bool = False, prompt: str | None = None) -> Session: ...


def head_range(engine: Engine) -> tuple[int, int]:
    """The global heads this rank's K/V caches hold: its TP slice's heads, then its SP shard of those."""
    heads, mesh = engine.ckpt.transformer.num_heads, engine.mesh
    tp_first = mesh.tp.part(heads).start
    local = mesh.sp.head_slice(heads // mesh.tp.degree)
    return tp_first + local.start, tp_first + local.stop


def session_parts(engine: Engine, session: Session) -> list[Part]:
    """This rank's parts of a session at the block boundary after its last block (on the group loop's thread, before
    its next block): its head shard of the K/V (copied), and on the owner the session's own state, on ENCODER_RANK
    the condition encoder's (by reference: nothing writes into them again). Write each with files.write_part (any
    thread)."""
    rank = engine.sp.rank
    parts = [capture.kv_part(session, rank, head_range(engine))]
    if rank == session.owner:
        parts.append(capture.shared_part(session, rank))
    if session.condition is not None:
        parts.append(capture.condition_part(session.condition, rank))
    return parts


def decode_part(vae: StreamingVae | StreamingTinyDecoder, rank: int, decoding: Decoding) -> Part | None:
    """This rank's part of a session's decoder state, after the decode of its last block (on the decode thread,
    before its next decode): its band of rows under a split decode, else the owner's whole frame; None where this
    rank holds none or the session decodes nothing."""
    rows = decode_rows(vae, rank, decoding.geometry.latent_height, decoding.state is not None, decoding.split,
                       decoding.owner)
    return None if rows is None else capture.decode_part(decoding, rank, rows)


def decode_rows(vae: StreamingVae | StreamingTinyDecoder, rank: int, latent_rows: int, decodes: bool, split: bool,
                owner: int) -> tuple[int, int] | None:
    """The latent rows of a session's decoder state rank `rank` holds: its band under a split decode, the whole
    height on the owner otherwise, None on the other ranks or without a decode."""
    if not decodes:
        return None
    if split:
        assert isinstance(vae, StreamingVae)
        return vae.band(latent_rows)
    return (0, latent_rows) if rank == owner else None


@dataclass(frozen=True)
class SnapshotFacts:
    """What a snapshot's size and its fit to a server depend on: the engine's spec, its VAE's architecture, the
    group's ranks and the DiT's bytes per value. Holds no engine: the owner's admission checks with it while the
    group loop runs the engine."""

    spec: EngineSpec
    vae_config: dict
    ranks: int
    itemsize: int

    def model(self) -> dict[str, int]:
        tcfg = self.spec.checkpoint.transformer
        return {"num_layers": tcfg.num_layers, "num_heads": tcfg.num_heads, "head_dim": tcfg.head_dim,
                "z_dim": self.spec.checkpoint.vae.z_dim}

    def manifest(self, snapshot_id: str, latent_rows: int, files: list[FileEntry]) -> Manifest:
        """The manifest of a session's snapshot from every rank's written files (on its owner, which publishes it)."""
        settings = self.spec.settings
        grid = {"tp_degree": settings.tp_degree, "sp_degree": settings.sp_degree, "latent_rows": latent_rows}
        return Manifest(snapshot_id, time.time(), settings_of(settings), self.model(), grid, tuple(files))

    def check_fits(self, snapshot: Snapshot) -> None:
        """SnapshotError SETTINGS_MISMATCH naming each setting (and the model's geometry) that differs."""
        saved = snapshot.manifest
        with faults_as_invalid("the manifest's settings_used"):
            theirs = parse_settings(saved.settings_used, "the snapshot's settings_used")
        differ = setting_differences(theirs, parse_settings(settings_of(self.spec.settings), "settings_used"))
        if saved.model != (ours := self.model()):
            differ.append(f"model: the snapshot's {saved.model}, this server's {ours}")
        if differ:
            raise SnapshotError(Refusal(SETTINGS_MISMATCH, f"the snapshot was saved on other settings: "
                                        f"{'; '.join(differ)} (expected: the snapshot's)"))

    def snapshot_size(self, request: SessionRequest, geometry: VideoGeometry, blocks: int,
                      keep_commits: bool) -> size.SnapshotSize:
        """The bytes of a session's snapshot after `blocks` blocks (the same on every rank)."""
        g, spec = geometry, self.spec
        tcfg, z = spec.checkpoint.transformer, spec.checkpoint.vae.z_dim
        capacity = session_window_frames(spec, request, g) * g.tokens_per_frame
        tokens = size.kv_tokens(blocks, g.block_tokens, capacity)
        records = size.kept_records(blocks, g.block_tokens, capacity,
                                    spec.sink_frames * g.tokens_per_frame) if keep_commits else 0
        encoder_bytes, encoder_tensors = condition_encoder_state(self.vae_config, g.height, g.width)
        decode_bytes, decode_tensors = 0, 0
        if spec.settings.decode_frames and request.decode:
            if spec.settings.decoder == "tiny":
                decode_bytes, decode_tensors = tiny_decoder_state(g.latent_height, g.latent_width)
            else:
                decode_bytes, decode_tensors = vae_decoder_state(self.vae_config, g.latent_height, g.latent_width)
        poses = 0 if request.poses is None else len(request.poses)
        tensors = self.ranks * (2 * tcfg.num_layers + decode_tensors) + encoder_tensors + 3 * records + 16
        return size.SnapshotSize(
            kv=size.kv_bytes(tcfg.num_layers, tcfg.num_heads, tcfg.head_dim, tokens, self.itemsize),
            commits=size.commit_bytes(records, z, g.block_frames, g.latent_height, g.latent_width),
            shared=size.shared_bytes(request.image.shape[0], request.image.shape[1], poses),
            condition=size.condition_bytes(encoder_bytes, z, g.height, g.width, g.latent_height, g.latent_width),
            decode=decode_bytes, tensors=tensors)

    def most_blocks(self, request: SessionRequest, geometry: VideoGeometry) -> int:
        """Blocks after which the session's snapshot stops growing (its window is full and its kept records are
        as many as they get): a save's size at this count bounds any save of the session."""
        capacity = session_window_frames(self.spec, request, geometry) * geometry.tokens_per_frame
        return -(-capacity // geometry.block_tokens) + self.spec.sink_frames // geometry.block_frames + 2


@dataclass
class RankState:
    """What this rank read for a resume, on the engine's devices, before any exchange."""

    shared: SharedState
    generator: torch.Generator
    camera: CameraTrack
    commits: list[CommitRecord] | None
    kv: KvShard
    condition: ConditionState | None  # ENCODER_RANK only
    decode: DecodeState | TinyDecodeState | None  # None: the resumed session decodes no frames


@torch.no_grad()
def resume(engine: Engine, snapshot: Snapshot, geometry: VideoGeometry, session_id: str | None = None,
           owner: int = 0, fork_seed: int | None = None, shared: SharedState | None = None) -> Session:
    """The saved session, where it stood, on this engine's grid (any TP x SP): its next block is the block the
    saved session would have made next. geometry: `engine.geometry_of(restore.read_request(...))`, checked once;
    fork_seed: draw the noise from this seed from the next block on (None: the saved generator's). A collective,
    every rank alike (the text K/V of the prompt in force is recomputed). `shared`: the snapshot's shared file as
    this rank read it already (its owner's admission), else read here. Raises SnapshotError on every rank alike
    (SNAPSHOT_INVALID, SETTINGS_MISMATCH)."""
    engine.snapshot_facts.check_fits(snapshot)
    state, error = None, None
    try:
        state = read_rank(engine, snapshot, geometry, owner, fork_seed, shared)
    except SnapshotError as exc:
        error = exc
    except Exception as exc:  # noqa: BLE001 - a fault of this rank's: told to every rank, logged here
        log.exception("rank %d could not read its part of snapshot %s", engine.sp.rank, snapshot.manifest.snapshot_id)
        error = invalid(f"rank {engine.sp.rank} could not read its part ({exc.__class__.__name__})")
    if not engine.sp.all_true(error is None, engine.device):
        raise error or invalid("another rank of the group could not read its part of the snapshot")
    shared = state.shared
    session = engine.open_session(shared.request, geometry, session_id, owner, keep_commits=shared.commits is not None,
                                  prompt=shared.prompt)
    for buffers, saved in ((session.cache.keys, state.kv.keys), (session.cache.values, state.kv.values)):
        for buffer, layer in zip(buffers, saved):
            buffer[0, : state.kv.length] = layer.to(engine.device)
    session.cache.length, session.cache.evicted_tokens = state.kv.length, state.kv.evicted_tokens
    session.generator, session.camera, session.commits = state.generator, state.camera, state.commits
    session.block_index = shared.block_index
    if session.condition is not None:
        session.condition = state.condition
    session.decoding = Decoding(session.id, owner, geometry, state.decode,
                                state.decode is not None and engine.vae.splits(geometry.latent_height))
    return session


def read_rank(engine: Engine, snapshot: Snapshot, geometry: VideoGeometry, owner: int,
              fork_seed: int | None, shared: SharedState | None = None) -> RankState:
    """This rank's part of a resume: every read and check, no exchange (`shared`: the shared file, read already)."""
    shared = shared or read_shared(snapshot)
    request, device = shared.request, engine.device
    tcfg = engine.ckpt.transformer
    kv = read_kv(snapshot, head_range(engine), tcfg.num_layers, tcfg.head_dim, engine.dtype)
    capacity = session_window_frames(engine.spec, request, geometry) * geometry.tokens_per_frame
    if kv.capacity != capacity or kv.length > capacity:
        raise invalid(f"the kv files were saved for a window of {kv.capacity} tokens, this session's is {capacity}")
    with faults_as_invalid("the shared file's generator and camera"):
        generator = torch.Generator("cpu")
        generator.set_state(shared.generator)
        if fork_seed is not None:
            generator.manual_seed(fork_seed)
        camera = camera_track(shared, request, geometry.block_frames)
    commits = None if shared.commits is None else [
        CommitRecord(r.first_frame, r.latents.to(device), r.timestep, r.poses, r.condition.to(device))
        for r in shared.commits]
    condition = None
    if engine.conditions is not None:
        vae_device = next(engine.conditions.vae.parameters()).device
        condition = _to(read_condition(snapshot), vae_device)
    decodes = bool(snapshot.manifest.entries(DECODE)) and engine.settings.decode_frames and request.decode
    split = decodes and engine.vae.splits(geometry.latent_height)
    rows = decode_rows(engine.vae, engine.sp.rank, geometry.latent_height, decodes, split, owner)
    decode = None
    if rows is not None:
        decode = _to(read_decode(snapshot, rows), engine.vae.device)
    elif decodes:
        decode = engine.vae.new_decode_state()  # a rank that helps no decode of this session holds an empty one
    return RankState(shared, generator, camera, commits, kv, condition, decode)


def camera_track(shared: SharedState, request: SessionRequest, block_frames: int) -> CameraTrack:
    """The session's camera track where the saved one stood."""
    saved, tensors = shared.camera, shared.camera_tensors
    track = CameraTrack(request.camera_intrinsics(), block_frames, saved["fixed_scale"])
    track.running_scale = saved["running_scale"]
    if saved["started"]:
        track.first_inverse, track.last_latent = tensors["camera.first_inverse"], tensors["camera.last_latent"]
        track.last_video = tensors["camera.last_video"].numpy()
        track.last_motion = tensors["camera.last_motion"].numpy()
    return track


def _to(state: ConditionState | DecodeState | TinyDecodeState, device: torch.device):
    """A restored encoder or decoder state with its tensors on `device` (strides kept)."""
    if isinstance(state, TinyDecodeState):
        state.memory = {k: t.to(device) for k, t in state.memory.items()}
    elif isinstance(state, DecodeState):
        state.feature_cache = [s.to(device) if isinstance(s, torch.Tensor) else s for s in state.feature_cache]
    else:
        for name in ("image", "previous", "steady"):
            if (t := getattr(state, name)) is not None:
                setattr(state, name, t.to(device))
        if state.feature_cache is not None:
            state.feature_cache = [s.to(device) if isinstance(s, torch.Tensor) else s for s in state.feature_cache]
    return state
