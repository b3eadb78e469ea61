"""Rank functions for the multi-process tests (importable by spawned processes)."""
from __future__ import annotations

import numpy as np

from backend.engine.config import EngineConfig
from backend.engine.rollout import WorldModelEngine
from backend.model.vae import StreamingVae
from backend.parallel.group import GroupHandles
from backend.parallel.mesh import Mesh
from backend.parallel.sequence import SequenceParallel
from backend.api.request import SessionRequest


def rollout(groups: GroupHandles, config: EngineConfig, request: SessionRequest) -> dict:
    """Full rollout on every rank (split tp_degree x sp_degree); returns latents, per-block forwards and exchange
    bytes, the final cache shards, this rank's weight and cache bytes and each camera modulation it made."""
    sp = SequenceParallel(groups.data)
    engine = WorldModelEngine.load(config, sp, groups.decode, Mesh.build(sp, config.tp_degree, timeout_s=600))
    calls: list[int] = []  # one entry per transformer forward
    engine.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
    camera_made: list[int] = []  # bytes of each camera modulation made (transformer.CameraModulation)
    make_camera = engine.transformer.camera_modulation

    def recording_camera(*args, **kwargs):
        made = make_camera(*args, **kwargs)
        camera_made.append(sum(t.nbytes for t in (*made.scale, *made.shift)))
        return made

    engine.transformer.camera_modulation = recording_camera
    with engine.session(request) as session:
        outputs, forwards = [], []
        for out, _ in engine.blocks(session, decode=False):
            outputs.append(out)
            forwards.append(len(calls) - sum(forwards))
        n = session.cache.length
        return {
            "latents": np.concatenate([out.latents.numpy() for out in outputs], axis=2),
            "forwards": forwards,  # transformer forwards per block
            "a2a_bytes": [out.all_to_all_bytes for out in outputs],
            "all_reduce_bytes": [out.all_reduce_bytes for out in outputs],
            "all_gather_bytes": [out.all_gather_bytes for out in outputs],
            "weight_bytes": engine.transformer.weight_bytes(),
            "camera_modulation_bytes": camera_made,
            "self_cache_bytes": session.cache.nbytes(),
            "text_cache_bytes": session.text.nbytes(),
            "window_tokens": session.cache.capacity,
            "evicted_tokens": session.cache.evicted_tokens,
            "self_k": [k[:, :n].float().numpy() for k in session.cache.keys],
            "self_v": [v[:, :n].float().numpy() for v in session.cache.values],
            "text_k": [k.float().numpy() for k in session.text.keys],
            "text_v": [v.float().numpy() for v in session.text.values],
            # condition chunks this rank's VAE encoder ran (None: it holds no encoder)
            "condition_chunks": session.condition.stats["encoded"] if session.condition is not None else None,
            "vae_encoder": engine.vae.vae.encoder is not None,
        }


def prompt_states(groups: GroupHandles, config: EngineConfig, prompts: list[str]) -> dict:
    """Each prompt's states on this rank, whether it holds the text encoder and how many prompts it encoded."""
    engine = WorldModelEngine.load(config, SequenceParallel(groups.data), groups.decode)
    states = [engine.prompts.states(p).float().numpy() for p in prompts]
    return {"states": states, "has_encoder": engine.prompts.encoder is not None, "encoded": engine.prompts.encoded}


def split_decode(groups: GroupHandles, config: EngineConfig, request: SessionRequest) -> dict:
    """A session's blocks decoded split across the ranks (frames on rank 0), and on rank 0 the same latents
    decoded whole by a VAE without a decode group."""
    engine = WorldModelEngine.load(config, SequenceParallel(groups.data), groups.decode)
    whole = StreamingVae(engine.vae.vae, engine.device)  # the same weights; no group: whole frames
    whole_state = whole.new_decode_state()
    with engine.session(request) as session:
        shared = session.split_decode
        blocks = []
        for out, frames in engine.blocks(session):
            if engine.sp.rank == 0:
                blocks.append((frames, whole.decode_block(out.latents, whole_state)))
            else:
                assert frames is None
    return {"shared": shared, "blocks": blocks}


def steered_events(groups: GroupHandles, config: EngineConfig, request: SessionRequest, steps: list) -> dict:
    """A steered session through `steps` (Controls; a step's prompt set as a world event before its block) on
    every rank; returns the latents, this rank's text K/V bytes after each block and its final text K/V shards."""
    from backend.engine.blocks import BlockControls

    sp = SequenceParallel(groups.data)
    engine = WorldModelEngine.load(config, sp, groups.decode, Mesh.build(sp, config.tp_degree, timeout_s=600))
    with engine.session(request) as session:
        latents, text_bytes = [], []
        for controls in steps:
            if controls.prompt is not None:
                engine.set_prompt(session, controls.prompt)
            (out,) = engine.run_block([session], {session.id: BlockControls(controls)})
            latents.append(out.latents.numpy())
            text_bytes.append(session.text.nbytes())
        return {
            "latents": np.concatenate(latents, axis=2),
            "text_bytes": text_bytes,
            "text_k": [k.float().numpy() for k in session.text.keys],
            "text_v": [v.float().numpy() for v in session.text.values],
        }


def recache_event(groups: GroupHandles, config: EngineConfig, request: SessionRequest, prompt: str, blocks: int,
                  at: int) -> dict:
    """On every rank: a session whose event `prompt` before block `at` is recached, and its teacher-forced ground
    truth (bench.recache): each with its latents and this rank's cache shards as the event left them."""
    from bench.recache import event_rollout, ground_truth

    sp = SequenceParallel(groups.data)
    engine = WorldModelEngine.load(config, sp, groups.decode, Mesh.build(sp, config.tp_degree, timeout_s=600))
    recached = event_rollout(engine, request, blocks, at, prompt, recache=True)
    return {"recached": recached, "truth": ground_truth(engine, request, blocks, at, prompt, recached)}


# -- serving members (serving/local_group): a setup run in each member's process, and calls into a member --

ADMISSIONS = {"request_geometry": 0, "check_request": 0, "open_session": 0}


def count_admissions(rank: int) -> None:
    """Count, in this member's process, the request checks and the session openings it runs."""
    import backend.api.codec as codec
    import backend.engine.rollout as rollout
    import backend.serving.admission as admission

    def counted(owner: object, name: str):
        real = getattr(owner, name)

        def wrapper(*args, **kwargs):
            ADMISSIONS[name] += 1
            return real(*args, **kwargs)

        setattr(owner, name, wrapper)

    counted(admission, "request_geometry")
    counted(rollout.WorldModelEngine, "open_session")
    counted(codec, "check_request")


def admission_counts(member) -> dict[str, int]:
    return dict(ADMISSIONS)


def open_sessions(member) -> int:
    """Sessions whose caches this member holds."""
    return len(dict(member.loop.sessions))


def planned_blocks(member) -> dict[str, int]:
    """Blocks planned per session not ended, as this member's scheduler copy has them."""
    return {sid: s.computed for sid, s in list(member.loop.scheduler.table.items())}


def weight_bytes(member) -> int:
    """The transformer weights this member holds."""
    return member.engine.transformer.weight_bytes()
