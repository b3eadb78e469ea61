"""Rank functions for the multi-process tests (importable by spawned processes)."""
from __future__ import annotations

import numpy as np

from backend.config import EngineConfig
from backend.engine import WorldModelEngine
from backend.parallel import SequenceParallel
from backend.request import SessionRequest


def rollout(sp: SequenceParallel, config: EngineConfig, request: SessionRequest) -> dict:
    """Full rollout on every rank; returns latents, per-block all-to-all bytes and the final cache shards."""
    engine = WorldModelEngine(config, sp)
    session = engine.open_session(request)
    latents, a2a = [], []
    while not session.done:
        (out,) = engine.run_block([session])
        latents.append(out.latents.numpy())
        a2a.append(out.all_to_all_bytes)
    n = session.cache.length
    result = {
        "latents": np.concatenate(latents, axis=2),
        "a2a_bytes": a2a,
        "evicted_tokens": session.cache.evicted_tokens,
        "self_k": [k[:, :n].float().numpy() for k in session.cache.keys],
        "self_v": [v[:, :n].float().numpy() for v in session.cache.values],
        "text_k": [k.float().numpy() for k in session.text.keys],
        "text_v": [v.float().numpy() for v in session.text.values],
    }
    engine.close_session(session)
    return result
