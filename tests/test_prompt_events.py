"""Prompt events: a steered step's new prompt, in the direct engine and through real servers (tiny checkpoint)."""
from __future__ import annotations

import dataclasses
import re
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from backend.api.controls import parse_play_script
from backend.api.errors import InputError
from backend.api.request import Controls, SessionRequest
from backend.engine.blocks import BlockControls
from backend.engine.rollout import WorldModelEngine
from backend.serving.threads import CoreSplit, instance_cores
from client.steer import SteeredSession
from client.stream import StreamError
from factories import tiny_request
from polling import wait_until
from triton_harness import metrics

SNOW, RAIN = "it starts to snow", "heavy rain falls"


def steered(controls: Controls, seed: int = 42) -> SessionRequest:
    base = tiny_request(num_frames=9, seed=seed, decode=False)
    return dataclasses.replace(base, num_frames=None, poses=controls.poses, keys=controls.keys)


def keys(script: str) -> list[Controls]:
    """One block's Controls per entry of a `client play` key script with prompt events."""
    return parse_play_script(script)


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


TWO_EVENTS = f"w,w,@{SNOW},w,d,@{RAIN},w"


@pytest.mark.server
def test_a_served_event_matches_the_direct_engine(sp1_server, engine: WorldModelEngine) -> None:
    served = play(sp1_server.grpc_url, keys(TWO_EVENTS))
    plain = play(sp1_server.grpc_url, keys("w,w,w,d,w"))
    assert np.array_equal(served[:, : 2 * BLOCK], plain[:, : 2 * BLOCK])  # before the event: bit for bit
    assert not np.allclose(served[:, 2 * BLOCK :], plain[:, 2 * BLOCK :])
    assert np.array_equal(served, direct(engine, keys(TWO_EVENTS)))


@pytest.mark.server
def test_a_repeated_event_prompt_hits_the_cache(sp1_server) -> None:
    first, second = (f"{text} {uuid.uuid4().hex}" for text in (SNOW, RAIN))  # new to the server's cache
    before = metrics(sp1_server, rank=0)
    play(sp1_server.grpc_url, keys(f"w,@{first},w,@{second},w,@{first},w"))
    after = metrics(sp1_server, rank=0)
    assert after["lingbot_world_prompt_events_total"] - before.get("lingbot_world_prompt_events_total", 0) == 3
    assert after["lingbot_world_prompt_cache_hits_total"] - before.get("lingbot_world_prompt_cache_hits_total", 0) == 1


@pytest.mark.server
def test_a_bad_event_is_refused_and_the_session_goes_on_under_its_old_prompt(sp1_server) -> None:
    with SteeredSession(sp1_server.grpc_url) as session:
        session.start(steered(Controls(keys="w")))
        blocks = [session.next_block(60)]
        session.step(Controls(keys="w", prompt="   "))
        with pytest.raises(StreamError, match=r"prompt is empty"):
            session.next_block(30)
        session.step(Controls(keys="w", prompt="x" * 5000))
        with pytest.raises(StreamError, match=r"prompt is 5000 bytes of UTF-8; at most 4096"):
            session.next_block(30)
        session._send({"action": np.array([b"w"], dtype=object), "prompt": np.array([b"\xffsnow"], dtype=object)})
        with pytest.raises(StreamError, match=r"input 'prompt' is not valid UTF-8"):
            session.next_block(30)
        session.step(Controls(keys="w"), end=True)
        blocks.append(session.next_block(60))
    assert np.array_equal(np.concatenate([b.latents for b in blocks], axis=1), play(sp1_server.grpc_url, keys("w,w")))



@pytest.mark.server
def test_a_served_session_holds_the_same_cache_bytes_after_five_events(sp1_server) -> None:
    log = Path(sp1_server.log_path)

    def freed_after(script: str) -> int:
        seen = len(log.read_text())
        play(sp1_server.grpc_url, keys(script))
        found = wait_until(lambda: re.findall(r"session r0-\d+ ended by its client after .*; freed (\d+) cache bytes",
                                              log.read_text()[seen:]), 30, "the session to end")
        return int(found[-1])

    events = ",".join(f"@{prompt},w" for prompt in (SNOW, RAIN, SNOW, RAIN, SNOW))
    assert freed_after(f"w,{events}") == freed_after("w,w,w,w,w,w")
