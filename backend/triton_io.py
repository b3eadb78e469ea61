"""Triton tensors <-> engine types, independent of `triton_python_backend_utils` so it tests without Triton."""
from __future__ import annotations

import json
import os
import re
from collections.abc import Callable

import numpy as np

from . import protocol as p
from .errors import ConfigError, InputError
from .request import SessionRequest

INPUT_DTYPES = {
    p.IMAGE: np.uint8,
    p.CAMERA_POSES: np.float32,
    p.CAMERA_INTRINSICS: np.float32,
    p.NUM_FRAMES: np.int32,
    p.SEED: np.int64,
    p.HEIGHT: np.int32,
    p.WIDTH: np.int32,
}


def _scalar(value: np.ndarray, name: str) -> int:
    if value.size != 1:
        raise InputError(f"input '{name}' must hold exactly one value; got shape {list(value.shape)}")
    return int(value.reshape(-1)[0])


def _prompt(value: np.ndarray) -> str:
    if value.size != 1:
        raise InputError(f"input '{p.PROMPT}' must hold exactly one string; got shape {list(value.shape)}")
    raw = value.reshape(-1)[0]
    if isinstance(raw, str):
        return raw
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"input '{p.PROMPT}' is not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc


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
    for name in (*p.REQUIRED_INPUTS, *p.OPTIONAL_INPUTS):
        value = get_input(name)
        if value is None:
            if name in p.REQUIRED_INPUTS:
                raise InputError(f"missing input '{name}'; required: {list(p.REQUIRED_INPUTS)}")
            continue
        expected = INPUT_DTYPES.get(name)
        if expected is not None and value.dtype != expected:
            raise InputError(f"input '{name}' must be {np.dtype(expected).name}; got {value.dtype}")
        values[name] = value
    try:
        params = json.loads(parameters_json or "{}")
    except json.JSONDecodeError as exc:
        raise InputError(f"request parameters are not valid JSON: {exc}") from exc
    return SessionRequest(
        image=values[p.IMAGE],
        prompt=_prompt(values[p.PROMPT]),
        poses=values[p.CAMERA_POSES],
        intrinsics=values.get(p.CAMERA_INTRINSICS),
        num_frames=_scalar(values[p.NUM_FRAMES], p.NUM_FRAMES),
        seed=_scalar(values[p.SEED], p.SEED),
        height=_scalar(values[p.HEIGHT], p.HEIGHT),
        width=_scalar(values[p.WIDTH], p.WIDTH),
        decode=_flag(params, p.PARAM_DECODE, True),
        return_latents=_flag(params, p.PARAM_RETURN_LATENTS, True),
    )


def block_outputs(
    block_index: int,
    num_blocks: int,
    latents: np.ndarray | None,
    frames: np.ndarray,
    timing_ms: tuple[float, float, float],
) -> dict[str, np.ndarray]:
    """The output tensors of one block's response."""
    out = {
        p.BLOCK_INDEX: np.array([block_index], dtype=np.int32),
        p.NUM_BLOCKS: np.array([num_blocks], dtype=np.int32),
        p.FRAMES: np.ascontiguousarray(frames, dtype=np.uint8),
        p.TIMING_MS: np.array(timing_ms, dtype=np.float32),
    }
    if latents is not None:
        out[p.LATENTS] = np.ascontiguousarray(latents, dtype=np.float32)
    return out


def instance_rank(args: dict, model_config: dict) -> tuple[int, int]:
    """(rank, world size) of this instance in the SP group.

    Under mpirun (one tritonserver per rank, one instance each) MPI's rank and size; otherwise the
    position among this model's instances: by GPU id for KIND_GPU, by instance index for KIND_CPU.
    """
    if "OMPI_COMM_WORLD_SIZE" in os.environ:
        return int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    groups = model_config.get("instance_group", [])
    if args["model_instance_kind"] == "GPU":
        devices = sorted(int(d) for g in groups for d in g.get("gpus", []) for _ in range(int(g.get("count", 1))))
        device = int(args["model_instance_device_id"])
        if len(set(devices)) != len(devices):
            raise ConfigError(f"instance_group must place one instance per GPU; got GPUs {devices}")
        return devices.index(device), len(devices)
    # Triton names CPU instances "<group name>_<index>"; a group's name defaults to "<model>_<group index>".
    name = args["model_instance_name"]
    offset = 0
    for i, group in enumerate(groups):
        group_name = group.get("name") or f"{args['model_name']}_{i}"
        match = re.fullmatch(re.escape(group_name) + r"_(\d+)", name)
        if match:
            return offset + int(match.group(1)), sum(int(g.get("count", 1)) for g in groups)
        offset += int(group.get("count", 1))
    raise ConfigError(f"cannot place instance {name!r} in instance_group {groups}")
