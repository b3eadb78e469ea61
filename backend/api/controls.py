"""Held keys -> camera poses: the one integrator the server and the clients share (numpy only).

While a key is held the camera moves every video frame, in its own axes (OpenCV: x right, y down, z forward):
W/S forward/back and D/A right/left by MOVE_PER_FRAME scene units; J/L turn left/right (yaw) and I/K look
up/down (pitch) by TURN_PER_FRAME_DEG degrees. Keys combine ("wa": forward and left). A key script for a whole
session is comma-separated steps, each `keys*blocks`: "w*6,wa*2,j*3" holds W for 6 blocks, then W+A for 2,
then J for 3; "-" (or an empty step) holds nothing.
"""
from __future__ import annotations

import math

import numpy as np

from .errors import InputError
from .request import Controls

MOVE_PER_FRAME = 0.05  # scene units per video frame
TURN_PER_FRAME_DEG = 1.0  # degrees per video frame
KEYS = "wasdijkl"
NO_KEYS = "-"


def parse_keys(text: str) -> str:
    """The held keys of one step, normalised (lower case, sorted, no repeats); InputError names unknown keys."""
    keys = text.strip().lower()
    if keys == NO_KEYS:
        return ""
    unknown = sorted(set(keys) - set(KEYS))
    if unknown:
        raise InputError(f"action {text!r} holds unknown key(s) {unknown}; keys are {list(KEYS)} or {NO_KEYS!r}")
    return "".join(sorted(set(keys)))


def parse_key_script(script: str) -> list[str]:
    """A session's steps from a key script such as "w*6,wa*2,j*3" (one entry per block)."""
    steps = parse_play_script(script)
    if (event := next((c.prompt for c in steps if c.prompt is not None), None)) is not None:
        raise InputError(f"key script: prompt event '@{event}' where only keys are taken")
    return [c.keys for c in steps]


def parse_play_script(script: str, resumed: bool = False) -> list[Controls]:
    """Each block's keys, and the prompt event riding on its step, from a key script such as
    "w*6,@it starts to snow,w*4": an @entry (no comma in it) is a prompt event riding on the next block's step;
    "@!text" asks for the cached frames to be recomputed under it too (request parameter recache). resumed: the
    script goes on from a saved world, so its first block may carry an event too."""
    steps: list[Controls] = []
    event: Controls | None = None
    for item in script.split(","):
        if item.strip().startswith("@"):
            if event is not None:
                raise InputError(f"key script: two prompt events in a row ('@{event.prompt}', {item.strip()!r})")
            if not steps and not resumed:
                raise InputError(f"key script: {item.strip()!r} before the first block: the first block takes "
                                 f"the session's own prompt")
            text = item.strip()[1:]
            recache = text.startswith("!")
            event = Controls(prompt=text[1:].strip() if recache else text.strip(), recache=recache)
            if not event.prompt:
                raise InputError(f"key script: an empty prompt event '{item.strip()}'")
            continue
        keys, _, count = item.strip().partition("*")
        try:
            blocks = int(count) if count else 1
        except ValueError:
            raise InputError(f"key script item {item!r}: the count after '*' must be a whole number") from None
        if blocks < 1:
            raise InputError(f"key script item {item!r}: the count must be at least 1")
        keys = parse_keys(keys or NO_KEYS)
        first = Controls(keys=keys) if event is None else Controls(keys=keys, prompt=event.prompt,
                                                                   recache=event.recache)
        steps += [first] + [Controls(keys=keys) for _ in range(blocks - 1)]
        event = None
    if event is not None:
        raise InputError(f"key script: prompt event '@{event.prompt}' with no block after it")
    return steps


def frame_motion(keys: str) -> np.ndarray:
    """The camera-frame motion [4, 4] of one video frame while `keys` are held."""
    keys = parse_keys(keys or NO_KEYS)
    move = np.array([("d" in keys) - ("a" in keys), 0.0, ("w" in keys) - ("s" in keys)]) * MOVE_PER_FRAME
    turn = math.radians(TURN_PER_FRAME_DEG)
    yaw = turn * (("l" in keys) - ("j" in keys))  # about the camera's y (down) axis: positive turns right
    pitch = turn * (("i" in keys) - ("k" in keys))  # about the camera's x axis: positive looks up
    cy, sy, cp, sp = math.cos(yaw), math.sin(yaw), math.cos(pitch), math.sin(pitch)
    rot_yaw = np.array([[cy, 0.0, sy], [0.0, 1.0, 0.0], [-sy, 0.0, cy]])
    rot_pitch = np.array([[1.0, 0.0, 0.0], [0.0, cp, -sp], [0.0, sp, cp]])
    motion = np.eye(4)
    motion[:3, :3] = rot_yaw @ rot_pitch
    motion[:3, 3] = move
    return motion


def integrate(start: np.ndarray, keys: str, frames: int) -> np.ndarray:
    """Camera-to-world poses [frames, 4, 4] (float32) after `start`, one per video frame, keys held."""
    motion = frame_motion(keys)
    pose = np.asarray(start, dtype=np.float64)
    out = np.empty((frames, 4, 4), dtype=np.float64)
    for i in range(frames):
        pose = pose @ motion
        out[i] = pose
    return out.astype(np.float32)
