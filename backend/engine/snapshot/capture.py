"""What a rank copies out of a session at a block boundary, as parts to write (files.Part).

At the boundary after block k (before block k + 1), on the group loop's thread: every rank its head shard of the
self-attention K/V (a copy of the committed prefix of each layer: the next block's eviction moves it); the owner
the session's own state (start inputs, block index, noise generator, camera track, prompt in force, kept commit
records); ENCODER_RANK the condition encoder's state. After block k's decode, on the decode thread: the decoder's
state (each rank its band under a split decode, else the owner's whole frame). Everything but the K/V is taken
by reference: the encoder's and decoder's caches and the commit records are replaced, never written into, by
what runs next; the writer moves them to the CPU.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ...api.request import SessionRequest
from ...model.condition import ConditionState
from ...model.tiny_vae import TinyDecodeState
from ..session import Decoding, Session
from .files import Part
from .manifest import CONDITION, DECODE, KV, SHARED

REQUEST_ARRAYS = ("image", "poses", "intrinsics")
REQUEST_NOT_KEPT = ("sequence_id", "save", "share")  # the resumed session's own: its sequence, a save of its first block
MARKERS = ("Rep",)  # diffusers' Wan decoder marks an upsampler's cache slot "Rep" before its first frame
TENSOR = "tensor"


def kv_part(session: Session, rank: int, heads: tuple[int, int]) -> Part:
    """This rank's head shard of the committed K/V: [length, heads, head_dim] per layer, copied to the CPU."""
    cache, length = session.cache, session.cache.length
    tensors = {}
    for layer, (k, v) in enumerate(zip(cache.keys, cache.values)):
        tensors[f"k.{layer}"] = k[0, :length].to("cpu", copy=True)
        tensors[f"v.{layer}"] = v[0, :length].to("cpu", copy=True)
    meta = {"length": length, "evicted_tokens": cache.evicted_tokens, "capacity": cache.capacity}
    return Part(KV, rank, tensors, meta, heads=heads)


def shared_part(session: Session, rank: int) -> Part:
    """The session's own state, the same on every rank: written once, by its owner."""
    request, camera = session.request, session.camera
    tensors = {name: torch.from_numpy(np.array(getattr(request, name)))  # a copy: a request's arrays may be read-only
               for name in REQUEST_ARRAYS if getattr(request, name) is not None}
    tensors["generator"] = session.generator.get_state()
    if camera.started:
        tensors |= {"camera.first_inverse": camera.first_inverse, "camera.last_latent": camera.last_latent,
                    "camera.last_video": torch.from_numpy(np.array(camera.last_video)),
                    "camera.last_motion": torch.from_numpy(np.array(camera.last_motion))}
    for i, record in enumerate(session.commits or ()):
        tensors |= {f"commit.{i}.latents": record.latents, f"commit.{i}.poses": record.poses,
                    f"commit.{i}.condition": record.condition}
    meta = {
        "block_index": session.block_index,
        "prompt": session.prompt,
        "request": request_fields(request),
        "camera": {"started": camera.started, "fixed_scale": camera.fixed_scale,
                   "running_scale": float(camera.running_scale)},
        "commits": None if session.commits is None else [
            {"first_frame": r.first_frame, "timestep": r.timestep} for r in session.commits],
    }
    return Part(SHARED, rank, tensors, meta)


def condition_part(state: ConditionState, rank: int) -> Part:
    """The condition encoder's position (ENCODER_RANK only): its image, feature cache, probe and fixed point."""
    tensors, slots = cache_tensors(state.feature_cache or [], "cache.")
    tensors["image"] = state.image
    tensors |= {name: t for name, t in (("previous", state.previous), ("steady", state.steady)) if t is not None}
    meta = {"encoded_frames": state.encoded_frames, "zero_chunks": state.zero_chunks, "stats": dict(state.stats),
            "slots": slots if state.feature_cache is not None else None}
    return Part(CONDITION, rank, tensors, meta)


def decode_part(decoding: Decoding, rank: int, rows: tuple[int, int]) -> Part:
    """The decoder's state after the last decoded block: this rank's band of rows `rows` (latent rows) of the
    Wan VAE's feature cache, or the tiny decoder's memory (whole frames, on the owner)."""
    state = decoding.state
    if isinstance(state, TinyDecodeState):
        tensors = {f"memory.{layer}": t for layer, t in state.memory.items()}
        meta = {"decoder": "tiny", "decoded_latent_frames": state.decoded_latent_frames}
    else:
        tensors, slots = cache_tensors(state.feature_cache, "cache.")
        meta = {"decoder": "vae", "decoded_latent_frames": state.decoded_latent_frames, "slots": slots}
    return Part(DECODE, rank, tensors, meta, rows=rows)


def cache_tensors(cache: list, prefix: str) -> tuple[dict[str, torch.Tensor], list]:
    """A diffusers feature cache as named tensors, and its slots: None (empty), "tensor" or {"marker": ...}."""
    tensors, slots = {}, []
    for i, slot in enumerate(cache):
        if isinstance(slot, torch.Tensor):
            tensors[f"{prefix}{i}"] = slot
            slots.append(TENSOR)
        elif isinstance(slot, str) and slot in MARKERS:
            slots.append({"marker": slot})
        elif slot is None:
            slots.append(None)
        else:
            raise TypeError(f"feature cache slot {i} holds a {type(slot).__name__}, not a tensor, None or a marker")
    return tensors, slots


def request_fields(request: SessionRequest) -> dict:
    """The request's fields besides its arrays (JSON: its strings, numbers and flags)."""
    skip = REQUEST_ARRAYS + REQUEST_NOT_KEPT
    values = {f.name: getattr(request, f.name) for f in dataclasses.fields(request) if f.name not in skip}
    return {name: v.item() if isinstance(v, np.generic) else v for name, v in values.items()}  # numpy scalars too
