"""World events: a steered step's new prompt, in the direct engine and through real servers (tiny checkpoint)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from backend.api.errors import InputError
from backend.api.request import Controls, SessionRequest
from backend.engine.blocks import BlockControls
from backend.engine.rollout import WorldModelEngine
from backend.serving.threads import CoreSplit, instance_cores
from client.steer import SteeredSession
from client.stream import StreamError
from factories import tiny_request

SNOW, RAIN = "it starts to snow", "heavy rain falls"


def steered(controls: Controls, seed: int = 42) -> SessionRequest:
    base = tiny_request(num_frames=9, seed=seed, decode=False)
    return dataclasses.replace(base, num_frames=None, poses=controls.poses, keys=controls.keys)


def keys(script: str) -> list[Controls]:
    """"w,w,@snow,d": one block per key entry; an @entry is the next block's prompt (as `client play` reads it)."""
    steps: list[Controls] = []
    prompt = None
    for entry in script.split(","):
        if entry.startswith("@"):
            prompt = entry[1:]
            continue
        steps.append(Controls(keys=entry, prompt=prompt))
        prompt = None
    return steps


def direct(engine: WorldModelEngine, steps: list[Controls]) -> np.ndarray:
    """The direct engine's session through `steps` ([z, frames, h, w] latents), each event set before its block,
    on the threads an SP1 server's instance runs its DiT on."""
    before = torch.get_num_threads()
    torch.set_num_threads(CoreSplit.of(instance_cores(1)).dit)
    try:
        with engine.session(steered(steps[0])) as session:
            blocks = []
            for controls in steps:
                if controls.prompt is not None:
                    engine.set_prompt(session, controls.prompt)
                (out,) = engine.run_block([session], {session.id: BlockControls(controls)})
                blocks.append(out.latents[0].numpy())
    finally:
        torch.set_num_threads(before)
    return np.concatenate(blocks, axis=1)


def play(url: str, steps: list[Controls]) -> np.ndarray:
    with SteeredSession(url) as session:
        session.start(steered(steps[0]))
        blocks = [session.next_block(60)]
        for i, controls in enumerate(steps[1:], start=1):
            session.step(controls, end=i == len(steps) - 1)
            blocks.append(session.next_block(60))
    return np.concatenate([b.latents for b in blocks], axis=1)


BLOCK = 3  # latent frames a block


def test_an_event_changes_the_blocks_from_its_own_on(engine: WorldModelEngine) -> None:
    plain = direct(engine, keys("w,w,w,w"))
    event = direct(engine, keys(f"w,w,@{SNOW},w,w"))
    assert np.array_equal(plain[:, : 2 * BLOCK], event[:, : 2 * BLOCK])
    assert not np.allclose(plain[:, 2 * BLOCK :], event[:, 2 * BLOCK :])
    # The same prompt again changes nothing: the session's own prompt as an event equals no event.
    assert np.array_equal(plain, direct(engine, keys("w,w,@a castle in the forest,w,w")))


def test_events_keep_the_text_cache_size_and_reuse_encoded_prompts(engine: WorldModelEngine) -> None:
    with engine.session(steered(Controls(keys="w"))) as session:
        held = session.text.nbytes()
        hits = engine.prompts.hits
        for prompt in (SNOW, RAIN, SNOW, RAIN, SNOW):
            engine.set_prompt(session, prompt)
            engine.run_block([session], {session.id: BlockControls(Controls(keys="w"))})
            assert session.text.nbytes() == held and session.prompt == prompt
        assert engine.prompts.hits - hits >= 3  # the repeats come from the cache


@pytest.mark.parametrize("prompt, error", [("  ", r"prompt is empty"), ("x" * 5000, r"prompt is 5000 bytes")])
def test_a_bad_event_is_refused_and_the_old_prompt_stays(engine: WorldModelEngine, prompt: str, error: str) -> None:
    with engine.session(steered(Controls(keys="w"))) as session:
        text = session.text
        with pytest.raises(InputError, match=error):
            engine.set_prompt(session, prompt)
        assert session.text is text and session.prompt == "a castle in the forest"
