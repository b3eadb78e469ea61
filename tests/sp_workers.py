"""Rank functions for the multi-process tests (importable by spawned processes)."""
from __future__ import annotations

import numpy as np

from backend.engine.config import EngineConfig
from backend.engine.rollout import WorldModelEngine
from backend.parallel.sequence import SequenceParallel
from backend.api.request import SessionRequest


def rollout(sp: SequenceParallel, config: EngineConfig, request: SessionRequest) -> dict:
    """Full rollout on every rank; returns latents, per-block all-to-all bytes and the final cache shards."""
    engine = WorldModelEngine.load(config, sp)
    with engine.session(request) as session:
        outputs = [out for out, _ in engine.blocks(session, decode=False)]
        n = session.cache.length
        return {
            "latents": np.concatenate([out.latents.numpy() for out in outputs], axis=2),
            "a2a_bytes": [out.all_to_all_bytes for out in outputs],
            "evicted_tokens": session.cache.evicted_tokens,
            "self_k": [k[:, :n].float().numpy() for k in session.cache.keys],
            "self_v": [v[:, :n].float().numpy() for v in session.cache.values],
            "text_k": [k.float().numpy() for k in session.text.keys],
            "text_v": [v.float().numpy() for v in session.text.values],
        }


def prompt_states(sp: SequenceParallel, config: EngineConfig, prompts: list[str]) -> dict:
    """Each prompt's states on this rank, whether it holds the text encoder and how many prompts it encoded."""
    engine = WorldModelEngine.load(config, sp)
    states = [engine.prompts.states(p).float().numpy() for p in prompts]
    return {"states": states, "has_encoder": engine.prompts.encoder is not None, "encoded": engine.prompts.encoded}
