"""Named arrays <-> a SessionRequest and a block's outputs, derived from the contract table (numpy only)."""
from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np

from . import contract as c
from .errors import InputError
from .request import SessionRequest


def request_arrays(request: SessionRequest) -> dict[str, np.ndarray]:
    """The input arrays of a request, each in its contract dtype (the client packs these)."""
    values = {
        c.IMAGE: request.image,
        c.PROMPT: np.array([request.prompt.encode("utf-8")], dtype=np.object_),
        c.CAMERA_POSES: request.poses,
        c.CAMERA_INTRINSICS: request.intrinsics,
        c.NUM_FRAMES: [request.num_frames],
        c.SEED: [request.seed],
        c.HEIGHT: [request.height],
        c.WIDTH: [request.width],
    }
    return {
        spec.name: np.ascontiguousarray(np.asarray(values[spec.name], dtype=spec.dtype))
        for spec in c.INPUTS
        if values[spec.name] is not None
    }


def request_parameters(request: SessionRequest) -> dict[str, bool]:
    return {c.PARAM_DECODE: request.decode, c.PARAM_RETURN_LATENTS: request.return_latents}


def _scalar(value: np.ndarray, name: str) -> int:
    if value.size != 1:
        raise InputError(f"input '{name}' must hold exactly one value; got shape {list(value.shape)}")
    return int(value.reshape(-1)[0])


def _prompt(value: np.ndarray) -> str:
    if value.size != 1:
        raise InputError(f"input '{c.PROMPT}' must hold exactly one string; got shape {list(value.shape)}")
    raw = value.reshape(-1)[0]
    if isinstance(raw, str):
        return raw
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"input '{c.PROMPT}' is not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc


def _flag(params: dict, name: str, default: bool) -> bool:
    value = params.get(name, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise InputError(f"request parameter '{name}' must be a bool; got {value!r}")


def parse_request(get_input: Callable[[str], np.ndarray | None], parameters_json: str) -> SessionRequest:
    """Build a SessionRequest from named input arrays (None when absent) and the request's parameters."""
    values: dict[str, np.ndarray] = {}
    for spec in c.INPUTS:
        value = get_input(spec.name)
        if value is None:
            if not spec.optional:
                raise InputError(f"missing input '{spec.name}'; required: {list(c.REQUIRED_INPUTS)}")
            continue
        # BYTES arrive as object arrays (or bytes arrays); every other input must match its dtype exactly.
        if spec.dtype != np.object_ and value.dtype != spec.dtype:
            raise InputError(f"input '{spec.name}' must be {spec.dtype.name}; got {value.dtype}")
        values[spec.name] = value
    try:
        params = json.loads(parameters_json or "{}")
    except json.JSONDecodeError as exc:
        raise InputError(f"request parameters are not valid JSON: {exc}") from exc
    flags = {p.name: _flag(params, p.name, p.default) for p in c.REQUEST_PARAMETERS}
    return SessionRequest(
        image=values[c.IMAGE],
        prompt=_prompt(values[c.PROMPT]),
        poses=values[c.CAMERA_POSES],
        intrinsics=values.get(c.CAMERA_INTRINSICS),
        num_frames=_scalar(values[c.NUM_FRAMES], c.NUM_FRAMES),
        seed=_scalar(values[c.SEED], c.SEED),
        height=_scalar(values[c.HEIGHT], c.HEIGHT),
        width=_scalar(values[c.WIDTH], c.WIDTH),
        decode=flags[c.PARAM_DECODE],
        return_latents=flags[c.PARAM_RETURN_LATENTS],
    )


def block_outputs(
    block_index: int,
    num_blocks: int,
    latents: np.ndarray | None,
    frames: np.ndarray,
    timing_ms: tuple[float, float, float],
) -> dict[str, np.ndarray]:
    """The output tensors of one block's response, each in its contract dtype."""
    values = {
        c.BLOCK_INDEX: [block_index],
        c.NUM_BLOCKS: [num_blocks],
        c.LATENTS: latents,
        c.FRAMES: frames,
        c.TIMING_MS: timing_ms,
    }
    return {
        spec.name: np.ascontiguousarray(np.asarray(values[spec.name], dtype=spec.dtype))
        for spec in c.OUTPUTS
        if values[spec.name] is not None
    }
