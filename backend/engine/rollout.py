"""The AR-diffusion rollout: sessions advance one block of latent frames at a time on every SP rank.

Every rank calls `open_session`, `run_block` and `close_session` in the same order with the same
arguments (the serving group loop guarantees it). Work that every rank would repeat is done once: the
prompt and the first-frame condition are encoded on ENCODER_RANK and broadcast. A block's decode is split
by image rows across the ranks (every rank calls `decode` for the same blocks in the same order) and its
frames come back on the session's owner, the rank that answers its request. With tensor parallelism the
transformer runs on a Mesh (parallel/mesh: this rank's TP group and SP group); everything else on the group.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist

from ..api.errors import InputError
from ..api.provenance import settings_of
from ..api.request import SessionRequest, check_prompt, check_request
from ..model.attention import select_attention
from ..model.camera import camera_features
from ..model.condition import StreamingConditionEncoder, condition_mask, prepare_image
from ..model.dtypes import torch_dtype
from ..model.kv_cache import SelfAttentionCache, TextCache
from ..model.rope import rope_tables
from ..model.tensor_slices import TensorPart
from ..model.schedule import dmd_schedule, flow_to_x0, renoise
from ..model.tiny_vae import StreamingTinyDecoder
from ..model.transformer import ForwardContext, LingBotTransformer
from ..model.vae import StreamingVae
from ..parallel.mesh import Mesh
from ..parallel.sequence import SequenceParallel
from .blocks import BlockControls, BlockOutput
from .camera_track import CameraTrack, split_blocks
from .settings import EngineSettings
from .geometry import VideoGeometry
from .parts import EngineParts, load_parts
from .prompts import ENCODER_RANK, SharedPrompts
from .session import CommitRecord, Decoding, Session
from .snapshot import sessions as snapshots
from .validation import GLOBAL_WINDOW, EngineSpec, checked_spec, request_geometry, session_window_frames

log = logging.getLogger(__name__)

GLOBAL_RECACHE = ("recache (keep_commits) needs a sliding window: under window_frames=-1 (global attention) it "
                  "would replay every block of the session, its cost and kept commits growing without bound")


class WorldModelEngine:
    def __init__(self, spec: EngineSpec, sp: SequenceParallel | None = None, parts: EngineParts | None = None,
                 decode_group: dist.ProcessGroup | None = None, mesh: Mesh | None = None) -> None:
        """An engine for a checked spec (see `checked_spec`; `load` does both) on `parts`, by default the
        spec's checkpoint files. sp: the whole group; mesh: its TP x SP split (Mesh.build), needed when
        tp_degree > 1 (else the group is the SP group). decode_group: the group's ranks again, for each block's
        decode split by image rows (its band exchanges run on the decode thread); None: the owner decodes whole
        frames."""
        settings = spec.settings
        self.spec = spec
        self.settings = settings
        self.sp = sp or SequenceParallel()
        self.mesh = mesh or Mesh.whole(self.sp)
        if self.mesh.tp.degree != settings.tp_degree:
            raise ValueError(f"tp_degree={settings.tp_degree} needs a Mesh of that degree, got {self.mesh.tp.degree}")
        self.ckpt = spec.checkpoint
        self.device = torch.device(settings.device)
        self.dtype = torch_dtype(settings.dtype)
        self.window_frames, self.sink_frames = spec.window_frames, spec.sink_frames
        self.attention_name, self.attention = select_attention(settings.attention_backend, self.device, self.dtype)
        parts = parts or load_parts(spec, self.sp.rank, TensorPart(self.mesh.tp.rank, self.mesh.tp.degree))
        self.transformer: LingBotTransformer = parts.transformer
        log.info("rank %d: transformer weights %d bytes on this rank (tp_degree=%d, tp rank %d)", self.sp.rank,
                 self.transformer.weight_bytes(), self.mesh.tp.degree, self.mesh.tp.rank)
        if settings.compile:
            self.transformer.compile_blocks()
        tcfg = self.ckpt.transformer
        # One rank encodes prompts (the others receive the states and never load the text encoder).
        self.prompts = SharedPrompts(parts.prompts if self.sp.rank == ENCODER_RANK else None, self.sp,
                                     (1, tcfg.text_len, tcfg.text_dim), self.dtype, self.device)
        # The block decoder: the Wan VAE's, or the tiny decoder's (decoder=tiny), which decodes on the owner alone.
        fast_cpu = settings.cpu_vae_kernels == "onednn"  # the VAE's float32 CPU kernels (model/cpu_vae)
        self.vae: StreamingVae | StreamingTinyDecoder
        if parts.tiny_decoder is not None:
            self.vae = StreamingTinyDecoder(parts.tiny_decoder, self.device)
            parts.vae.decoder = parts.vae.post_quant_conv = None  # never runs
        else:
            self.vae = StreamingVae(parts.vae, self.device, decode_group, fast_cpu)
        # The first-frame condition is encoded on ENCODER_RANK and broadcast, like the prompt.
        self.conditions = (StreamingConditionEncoder(parts.vae, fast_cpu=fast_cpu) if self.sp.rank == ENCODER_RANK
                           else None)
        if self.conditions is None:
            parts.vae.encoder = None  # never runs here
        self.vae_config = dict(parts.vae.config)  # the VAE's architecture (a snapshot's size: snapshot/size)
        # What a snapshot's size and fit depend on, for callers that hold no engine (the owner's admission).
        self.snapshot_facts = snapshots.SnapshotFacts(spec, self.vae_config, self.sp.degree, self.dtype.itemsize)
        steps = settings.denoise_steps
        self.schedule = dmd_schedule(spec.shift, tuple(range(0, 1000, 1000 // steps))[:steps])
        self._ids = itertools.count()
        self.prompt_events = 0  # prompt events applied (set_prompt calls)

    @classmethod
    def load(cls, settings: EngineSettings, sp: SequenceParallel | None = None,
             decode_group: dist.ProcessGroup | None = None, mesh: Mesh | None = None) -> WorldModelEngine:
        """Validate the settings against the checkpoint's configs, then load its weights."""
        sp = sp or SequenceParallel()
        return cls(checked_spec(settings, sp.degree), sp, decode_group=decode_group, mesh=mesh)

    # -- sessions ---------------------------------------------------------------------------------

    def geometry_of(self, request: SessionRequest) -> VideoGeometry:
        """How a request fits this engine (see validation.request_geometry): no model work."""
        return request_geometry(self.spec, request)

    @property
    def settings_used(self) -> str:
        """The settings a block's latents depend on (api/provenance), as this engine runs them."""
        return settings_of(self.settings)

    @torch.no_grad()
    def open_session(self, request: SessionRequest, geometry: VideoGeometry, session_id: str | None = None,
                     owner: int = 0, keep_commits: bool = False, prompt: str | None = None) -> Session:
        """A session of an admitted request (`geometry`: its `geometry_of`, checked once); owner: the rank that
        answers the request (its decoded frames come back there); keep_commits: keep what each cached block was
        made of, so that `recache` can recompute its K/V (refused under global attention); prompt: the prompt in
        force when it is not the request's (a resumed session's). A collective (the prompt's text K/V)."""
        if keep_commits and self.window_frames == GLOBAL_WINDOW:
            raise InputError(GLOBAL_RECACHE)
        prompt = request.prompt if prompt is None else prompt
        tcfg = self.ckpt.transformer
        image = torch.tensor(request.image)  # a copy: the caller's array may be read-only
        mesh = self.mesh
        tp_heads = tcfg.num_heads // mesh.tp.degree
        text = self._text_caches(prompt)
        cache = SelfAttentionCache(
            num_layers=tcfg.num_layers,
            window_tokens=session_window_frames(self.spec, request, geometry) * geometry.tokens_per_frame,
            block_tokens=geometry.block_tokens,
            sink_tokens=self.sink_frames * geometry.tokens_per_frame,
            local_heads=tp_heads // mesh.sp.degree,
            head_dim=tcfg.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        decode_state = self.vae.new_decode_state() if self.settings.decode_frames and request.decode else None
        session_id = session_id or f"session-{next(self._ids)}"
        return Session(
            id=session_id,
            request=request,
            geometry=geometry,
            generator=torch.Generator("cpu").manual_seed(request.seed),
            camera=(CameraTrack(request.camera_intrinsics(), geometry.block_frames)
                    if request.steered or request.pose_scale == "running"  # the largest translation so far
                    else CameraTrack.whole(request.poses, request.camera_intrinsics(), geometry.block_frames)),
            planned=[] if request.steered else split_blocks(request.poses, geometry.block_frames),
            condition=(self.conditions.start(prepare_image(image, request.height, request.width))
                       if self.conditions is not None else None),
            prompt=prompt,
            text=text,
            cache=cache,
            decoding=Decoding(session_id, owner, geometry, decode_state,
                              decode_state is not None and self.vae.splits(geometry.latent_height)),
            owner=owner,
            commits=[] if keep_commits else None,
        )

    @torch.no_grad()
    def set_prompt(self, session: Session, prompt: str) -> None:
        """A prompt event: the session's text conditioning is `prompt` from its next block on; its self-attention
        history, camera and noise go on. A collective on a prompt the cache lacks (every rank calls it alike).
        Raises InputError on a bad prompt, leaving the session under its old one."""
        check_prompt(prompt)
        self.prompt_events += 1
        if prompt == session.prompt:
            return
        text = self._text_caches(prompt)
        session.text.keys.clear()  # the old head shard goes now
        session.text.values.clear()
        session.text, session.prompt = text, prompt

    @torch.no_grad()
    def recache(self, session: Session) -> None:
        """Recompute the self-attention K/V of every cached frame under the session's prompt in force (call it
        right after `set_prompt`, before the next block; a collective, every rank alike).

        From the session's kept records (open_session's keep_commits), oldest first: the cache's committed
        length goes back to 0 (its buffers stay), then each block runs the forward that wrote its K/V again (the
        commit forward at t = 0, or under kv_reuse its last DMD step; its latents, timestep, RoPE positions, mask,
        condition and camera) between `make_room` and `commit`. Only the frames still cached are replayed, so
        after evictions each block's K/V attends to the replayed history, not to the evicted frames it once saw.
        Refused (InputError) under global attention, where the replay would grow with the session, and for a
        session opened without keep_commits.
        """
        if self.window_frames == GLOBAL_WINDOW:
            raise InputError(GLOBAL_RECACHE)
        if session.commits is None:
            raise InputError(f"recache: session {session.id!r} was opened without keep_commits: nothing to "
                             "recompute its cache from")
        cache = session.cache
        length, evicted = cache.length, cache.evicted_tokens
        evicted_of_kept = sum(session.evicted_of(r) for r in session.commits)
        cache.length = cache.evicted_tokens = 0
        for record in session.commits:
            cache.make_room()
            self._recommit(session, record)
            cache.commit()
        if (cache.length, cache.evicted_tokens) != (length, evicted_of_kept):
            raise RuntimeError(f"recache of {session.id!r}: the replay left {cache.length} tokens and evicted "
                               f"{cache.evicted_tokens}, the session had {length} and {evicted_of_kept}")
        cache.evicted_tokens = evicted

    def _text_caches(self, prompt: str) -> TextCache:
        """This rank's head shard (of its TP and SP group) of the cross-attention K/V of `prompt`, every layer."""
        mesh = self.mesh
        tp_heads = self.ckpt.transformer.num_heads // mesh.tp.degree
        return self.transformer.text_caches(self.prompts.states(prompt), mesh.sp.head_slice(tp_heads), mesh.tp)

    # -- rollout ----------------------------------------------------------------------------------

    @torch.no_grad()
    def run_block(
        self, sessions: list[Session], controls: dict[str, BlockControls] | None = None,
        teacher: dict[str, torch.Tensor] | None = None,
    ) -> list[BlockOutput]:
        """Denoise the next block of each session (batched: same block shape), then commit its clean K/V (under
        kv_reuse: keep the K/V its last DMD step wrote, no commit forward).

        controls: the camera of every steered session in the batch (a whole trajectory knows its own).
        teacher: per session id, the clean latents [1, z, block_frames, h, w] its commit takes in place of its
        own, which its output then carries (a teacher-forced run, for tests and benchmarks; not under kv_reuse).
        """
        geometry = sessions[0].geometry
        if any(s.geometry.block_shape != geometry.block_shape or s.done for s in sessions):
            raise ValueError("run_block: sessions must share one block shape and have blocks left")
        if teacher and self.settings.kv_reuse:
            raise ValueError("run_block: a teacher replaces the commit forward's latents; kv_reuse runs none")
        start = time.perf_counter()
        self.mesh.sp.stats.reset()
        self.mesh.tp.stats.reset()
        bf = self.settings.block_frames
        z = self.ckpt.vae.z_dim
        starts = [s.block_index * bf for s in sessions]
        for s in sessions:
            s.cache.make_room()
        ctx = self._context(sessions, starts, geometry)
        condition_latents = self._condition_latents(sessions, geometry)
        condition = with_masks(condition_latents, starts, geometry)
        steps = [controls[s.id] if s.steered else BlockControls(None) for s in sessions]
        video_poses = [s.camera.resolve(c.controls) if s.steered else s.planned[s.block_index]
                       for s, c in zip(sessions, steps)]
        poses = [s.camera.next_block(p) for s, p in zip(sessions, video_poses)]
        camera = self._camera(sessions, poses, geometry)
        noise_shape = (1, z, bf, geometry.latent_height, geometry.latent_width)

        def noise() -> torch.Tensor:  # same draws on every rank: one CPU generator per session
            return torch.cat([torch.randn(noise_shape, generator=s.generator) for s in sessions]).to(self.device)

        schedule = self.schedule
        x = noise()
        clean, t = x, 0.0
        for k, (t, sigma) in enumerate(zip(schedule.timesteps, schedule.sigmas)):
            timesteps = torch.full((len(sessions), bf), t, device=self.device)
            clean = flow_to_x0(x, self._predict(x, condition, camera, timesteps, geometry, ctx), sigma)
            if k < len(schedule.renoise_sigmas):
                x = renoise(clean, noise(), schedule.renoise_sigmas[k])
        if self.settings.kv_reuse:  # the last step's forward has written the block's K/V: they are its history
            committed, commit_t = x, float(t)
        else:
            if teacher:
                clean = torch.cat([teacher.get(s.id, clean[i : i + 1]).to(self.device)
                                   for i, s in enumerate(sessions)])
            committed, commit_t = clean, 0.0
            self._commit_forward(committed, condition, camera, geometry, ctx, commit_t)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed_ms = (time.perf_counter() - start) * 1000.0
        outputs = []
        for i, (s, step) in enumerate(zip(sessions, steps)):
            s.cache.commit()
            if s.commits is not None:
                s.keep_commit(CommitRecord(starts[i], committed[i : i + 1].clone(), commit_t, poses[i],
                                           condition_latents[i : i + 1].clone()))
            s.block_index += 1
            outputs.append(
                BlockOutput(
                    session_id=s.id,
                    block_index=s.block_index - 1,
                    num_blocks=s.num_blocks,
                    latents=clean[i : i + 1].cpu(),
                    dit_ms=elapsed_ms,
                    all_to_all_bytes=self.mesh.sp.stats.all_to_all_bytes,
                    all_reduce_bytes=self.mesh.tp.stats.all_reduce_bytes,
                    all_gather_bytes=self.mesh.tp.stats.all_gather_bytes,
                    held=s.steered and step.controls is None,
                    camera=np.ascontiguousarray(video_poses[i], dtype=np.float32),
                    prompt=s.prompt,
                    recached=step.recached,
                )
            )
        return outputs

    def decode(self, decoding: Decoding, output: BlockOutput) -> np.ndarray | None:
        """A block's frames (Decoding.frames) on this engine's decoder."""
        return decoding.frames(self.vae, output)

    def close_session(self, session: Session) -> None:
        """Drop the session's KV caches now (they are large). Its decode state stays until the session
        object goes, so blocks already queued for decoding still decode."""
        session.cache.keys.clear()
        session.cache.values.clear()
        session.text.keys.clear()
        session.text.values.clear()
        if session.commits is not None:
            session.commits.clear()
        if session.condition is not None:
            session.condition.feature_cache = session.condition.previous = None

    @contextlib.contextmanager
    def session(self, request: SessionRequest, session_id: str | None = None,
                keep_commits: bool = False) -> Iterator[Session]:
        """A session for one caller (its request checked here), closed (caches freed) on exit."""
        check_request(request)
        session = self.open_session(request, self.geometry_of(request), session_id, keep_commits=keep_commits)
        try:
            yield session
        finally:
            self.close_session(session)

    def blocks(self, session: Session, decode: bool = True) -> Iterator[tuple[BlockOutput, np.ndarray | None]]:
        """The session's remaining blocks, one at a time, each with its decoded frames (empty without decode;
        None on a rank that helped decode another's frames). Every rank of a group calls it alike.

        The one rollout loop of tests and benchmarks; the serving loop batches sessions instead.
        """
        while not session.done:
            (out,) = self.run_block([session])
            yield out, self.decode(session.decoding, out) if decode else _no_frames(session)

    def generate(self, request: SessionRequest, decode: bool = True) -> list[tuple[BlockOutput, np.ndarray]]:
        """The whole rollout of one request."""
        with self.session(request) as session:
            return list(self.blocks(session, decode))

    # -- internals --------------------------------------------------------------------------------

    def _condition_latents(self, sessions: list[Session], g: VideoGeometry) -> torch.Tensor:
        """[B, z, block_frames, h, w] float32: the condition latents of the sessions' next block, encoded on
        ENCODER_RANK and broadcast (one broadcast per block for the whole batch)."""
        bf = g.block_frames
        if self.conditions is not None:
            latents = torch.cat([self.conditions.encode_next(s.condition, bf) for s in sessions]).float()
        else:
            shape = (len(sessions), self.ckpt.vae.z_dim, bf, g.latent_height, g.latent_width)
            latents = torch.empty(shape, device=self.device)
        return self.sp.broadcast(latents.contiguous(), src=ENCODER_RANK)

    def _camera(self, sessions: list[Session], poses: list[torch.Tensor], g: VideoGeometry) -> torch.Tensor:
        """[B, 384, block_frames, h, w]: the camera features of each session's block from its model poses."""
        fold = self.ckpt.vae.spatial_factor
        return torch.stack([camera_features(p, s.camera.intrinsics, g.height, g.width, fold)
                            for s, p in zip(sessions, poses)]).to(self.device)

    def _commit_forward(self, latents: torch.Tensor, condition: torch.Tensor, camera: torch.Tensor, g: VideoGeometry,
                        ctx: ForwardContext, t: float) -> None:
        """One forward at timestep t on the blocks' latents writes their keys/values into the caches' slot after
        the history (`commit` then keeps them): the clean-KV commit (t = 0 on the clean latents), or a kept
        record's forward again."""
        timesteps = torch.full((latents.shape[0], g.block_frames), t, device=self.device)
        self._predict(latents, condition, camera, timesteps, g, ctx)

    def _recommit(self, session: Session, record: CommitRecord) -> None:
        """The forward that wrote one kept block's K/V again, under the session's text K/V in force."""
        g, starts = session.geometry, [record.first_frame]
        condition = with_masks(record.condition, starts, g)
        camera = self._camera([session], [record.poses], g)
        self._commit_forward(record.latents, condition, camera, g, self._context([session], starts, g),
                             record.timestep)

    def _context(self, sessions: list[Session], starts: list[int], g: VideoGeometry) -> ForwardContext:
        head_dim = self.ckpt.transformer.head_dim
        tables = [rope_tables(head_dim, f, g.block_frames, g.grid_height, g.grid_width) for f in starts]
        sp = self.mesh.sp
        cos = sp.shard(torch.stack([c for c, _ in tables]), 1).to(self.device)
        sin = sp.shard(torch.stack([s for _, s in tables]), 1).to(self.device)
        return ForwardContext(
            sp=sp,
            tp=self.mesh.tp,
            attention=self.attention,
            rope_cos=cos,
            rope_sin=sin,
            self_caches=[s.cache for s in sessions],
            text_caches=[s.text for s in sessions],
        )

    def _predict(
        self,
        x: torch.Tensor,
        condition: torch.Tensor,
        camera: torch.Tensor,
        timesteps: torch.Tensor,
        g: VideoGeometry,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """The model's velocity [B, z, F, h, w] (float32) for noisy latents x [B, z, F, h, w] (float32)."""
        model_in = torch.cat([x, condition], dim=1).to(self.dtype)
        return self.transformer(model_in, camera, timesteps, g.tokens_per_frame, ctx).float()


def with_masks(latents: torch.Tensor, starts: list[int], g: VideoGeometry) -> torch.Tensor:
    """[B, 4 + z, block_frames, h, w]: the masks of the blocks starting at latent frames `starts`, then their
    condition latents (on the latents' device)."""
    bf = g.block_frames
    masks = torch.cat([condition_mask(f, bf, g.latent_height, g.latent_width, latents.device) for f in starts])
    return torch.cat([masks, latents], dim=1)


def _no_frames(session: Session) -> np.ndarray:
    return np.zeros((0, session.geometry.height, session.geometry.width, 3), dtype=np.uint8)
