"""Named arrays <-> requests and a block's outputs, derived from the contract table (numpy only)."""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import contract as c
from .controls import NO_KEYS, parse_keys
from .errors import InputError, ResponseError
from .request import (Controls, ResumeRequest, SavesRequest, SessionRequest, StepRequest, check_request,
                      check_snapshot_id)


def _keys_array(keys: str) -> np.ndarray:
    return np.array([(keys or NO_KEYS).encode("utf-8")], dtype=np.object_)


def controls_arrays(controls: Controls) -> dict[str, np.ndarray]:
    """The input arrays of one block's camera (and its prompt event's prompt)."""
    if controls.keys is not None:
        arrays = {c.ACTION: _keys_array(controls.keys)}
    else:
        arrays = {c.CAMERA_POSES: np.ascontiguousarray(controls.poses, dtype=np.float32)}
    if controls.prompt is not None:
        arrays[c.PROMPT] = np.array([controls.prompt.encode("utf-8")], dtype=np.object_)
    return arrays


def controls_parameters(controls: Controls) -> dict[str, bool | str]:
    """The request parameters a step's camera adds (a prompt event's recache, a save after its block)."""
    return ({c.PARAM_RECACHE: True} if controls.recache else {}) | ({c.PARAM_SAVE: True} if controls.save else {}) \
        | ({c.PARAM_RELEASE: controls.release} if controls.release else {}) \
        | ({c.PARAM_SHARE: True} if controls.share else {})


def resume_parameters(resume: ResumeRequest) -> dict[str, bool | int | str]:
    """The request parameters of a start that resumes a snapshot (with controls_arrays of its controls)."""
    params: dict[str, bool | int | str] = {c.PARAM_RESUME: resume.snapshot_id,
                                           c.PARAM_RETURN_LATENTS: resume.return_latents}
    if resume.fork_seed != c.NO_FORK:
        params[c.PARAM_FORK_SEED] = resume.fork_seed
    if resume.return_used:
        params[c.PARAM_RETURN_USED] = True
    return params | controls_parameters(resume.controls)


def request_arrays(request: SessionRequest) -> dict[str, np.ndarray]:
    """The input arrays of a whole trajectory or a steered session's first request (the client packs these)."""
    values = {
        c.IMAGE: request.image,
        c.PROMPT: np.array([request.prompt.encode("utf-8")], dtype=np.object_),
        c.CAMERA_POSES: request.poses,
        c.CAMERA_INTRINSICS: request.intrinsics,
        c.ACTION: None if request.keys is None else _keys_array(request.keys),
        c.NUM_FRAMES: None if request.num_frames is None else [request.num_frames],
        c.SEED: [request.seed],
        c.HEIGHT: [request.height],
        c.WIDTH: [request.width],
    }
    return {
        spec.name: np.ascontiguousarray(np.asarray(values[spec.name], dtype=spec.dtype))
        for spec in c.INPUTS
        if values[spec.name] is not None
    }


def request_parameters(request: SessionRequest) -> dict[str, bool | int | str]:
    params: dict[str, bool | int | str] = {c.PARAM_DECODE: request.decode, c.PARAM_RETURN_LATENTS: request.return_latents}
    if request.steered:
        params |= {c.PARAM_ON_STARVE: request.on_starve, c.PARAM_MAX_BLOCKS: request.max_blocks}
    elif request.pose_scale != c.POSE_SCALES[0]:
        params[c.PARAM_POSE_SCALE] = request.pose_scale
    if request.return_used:
        params[c.PARAM_RETURN_USED] = True
    if request.expect_settings:
        params[c.PARAM_EXPECT_SETTINGS] = request.expect_settings
    if request.save:
        params[c.PARAM_SAVE] = True
    if request.share:
        params[c.PARAM_SHARE] = True
    return params


def saves_parameters(saves: SavesRequest) -> dict[str, str]:
    """The request parameters of a request about its key's saves (sent without inputs)."""
    return {c.PARAM_SAVES: saves.action} | ({c.PARAM_SNAPSHOT: saves.snapshot_id} if saves.snapshot_id else {})


def _scalar(value: np.ndarray, name: str) -> int:
    if value.size != 1:
        raise InputError(f"input '{name}' must hold exactly one value; got shape {list(value.shape)}")
    number = int(value.reshape(-1)[0])
    if (least := c.INPUT_SPECS[name].minimum) is not None and number < least:
        raise InputError(f"input '{name}' must be >= {least}; got {number}")
    return number


def _text(value: np.ndarray, name: str) -> str:
    if value.size != 1:
        raise InputError(f"input '{name}' must hold exactly one string; got shape {list(value.shape)}")
    raw = value.reshape(-1)[0]
    if isinstance(raw, str):
        return raw
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"input '{name}' is not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc


def _parameter(params: dict, spec: c.ParameterSpec) -> bool | int | str:
    value = params.get(spec.name, spec.default)
    kind = type(spec.default)
    if kind is bool:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        if not isinstance(value, bool):
            raise InputError(f"request parameter '{spec.name}' must be a bool; got {value!r}")
    elif kind is int:
        if isinstance(value, str) and value.lstrip("-").isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputError(f"request parameter '{spec.name}' must be an integer; got {value!r}")
    elif not isinstance(value, str):
        raise InputError(f"request parameter '{spec.name}' must be a string; got {value!r}")
    if spec.choices and value not in spec.choices:
        raise InputError(f"request parameter '{spec.name}' must be one of {list(spec.choices)}; got {value!r}")
    if spec.minimum is not None and value < spec.minimum:
        raise InputError(f"request parameter '{spec.name}' must be >= {spec.minimum}; got {value}")
    return value


def _controls(values: dict[str, np.ndarray]) -> Controls | None:
    if c.ACTION in values:
        if c.CAMERA_POSES in values:
            raise InputError(f"send either '{c.CAMERA_POSES}' or '{c.ACTION}' for a block, not both")
        return Controls(keys=parse_keys(_text(values[c.ACTION], c.ACTION)))
    if c.CAMERA_POSES in values:
        return Controls(poses=values[c.CAMERA_POSES])
    return None


_PAUSE, _SAVE, _RESUME, _RELEASE, _SHARE, _SAVES, _SNAPSHOT = (
    next(p for p in c.REQUEST_PARAMETERS if p.name == name)
    for name in (c.PARAM_PAUSE, c.PARAM_SAVE, c.PARAM_RESUME, c.PARAM_RELEASE, c.PARAM_SHARE, c.PARAM_SAVES,
                 c.PARAM_SNAPSHOT))


def _saves(values: dict[str, np.ndarray], params: dict, action: str) -> SavesRequest:
    """A request about its key's saves: no inputs, and no parameter of a session."""
    name = f"request parameter '{c.PARAM_SAVES}'"
    if values:
        raise InputError(f"{name} asks about the key's snapshots: send it without inputs (got {sorted(values)})")
    if extra := sorted(set(params) - {c.PARAM_SAVES, c.PARAM_SNAPSHOT}):
        raise InputError(f"{name} takes no session parameters; got {extra}")
    snapshot_id = _parameter(params, _SNAPSHOT)
    if action == "list" and snapshot_id:
        raise InputError(f"{name}=list lists every snapshot of the key: send it without '{c.PARAM_SNAPSHOT}'")
    if action != "list" and not snapshot_id:
        raise InputError(f"{name}={action} needs request parameter '{c.PARAM_SNAPSHOT}' (the snapshot's id)")
    return SavesRequest(action, check_snapshot_id(snapshot_id, c.PARAM_SNAPSHOT) if snapshot_id else "")


def _pause(values: dict[str, np.ndarray], sequence_id: str, start: bool, end: bool, whole: bool) -> StepRequest:
    """A pause: a request of a running steered session without a block, held open until the sequence's next."""
    name = f"request parameter '{c.PARAM_PAUSE}'"
    if whole or not sequence_id:
        raise InputError(f"{name} pauses a steered session; a whole trajectory ('{c.NUM_FRAMES}' set) cannot pause")
    if start:
        raise InputError(f"{name} pauses a running steered session; a request with the start flag cannot pause "
                         f"(start with the first block's camera)")
    if end:
        raise InputError(f"{name} and the end flag exclude each other; end the session with the end flag alone")
    if extra := [n for n in (c.CAMERA_POSES, c.ACTION, c.PROMPT) if n in values]:
        raise InputError(f"a pause ({name}) carries no block: send it without {extra}")
    return StepRequest(sequence_id, None, pause=True)


def parse_request(
    get_input: Callable[[str], np.ndarray | None], parameters_json: str, sequence_id: str = "", flags: int = 0
) -> SessionRequest | ResumeRequest | StepRequest | SavesRequest:
    """A whole trajectory, a steered session's first request, or a step, from named input arrays (None when
    absent), the request's parameters and its Triton sequence (correlation id and start/end flags), each input
    checked against the contract (dtype, shape, choices, range, value). How the request fits this server (its
    limits, geometry and frame counts) is the owning rank's admission step to check (serving/admission).

    A request with `num_frames` is a whole trajectory. Without it, a request that starts a sequence starts a
    steered session; any other request of a sequence is a step of that session.
    """
    values: dict[str, np.ndarray] = {}
    for spec in c.INPUTS:
        value = get_input(spec.name)
        if value is None:
            continue
        # BYTES arrive as object arrays (or bytes arrays); every other input must match its dtype exactly.
        if spec.dtype != np.object_ and value.dtype != spec.dtype:
            raise InputError(f"input '{spec.name}' must be {spec.dtype.name}; got {value.dtype}")
        values[spec.name] = value
    try:
        params = json.loads(parameters_json or "{}")
    except json.JSONDecodeError as exc:
        raise InputError(f"request parameters are not valid JSON: {exc}") from exc
    if not isinstance(params, dict):
        raise InputError("request parameters must be a JSON object")
    if action := _parameter(params, _SAVES):
        return _saves(values, params, action)
    if _parameter(params, _SNAPSHOT):
        raise InputError(f"request parameter '{c.PARAM_SNAPSHOT}' names the snapshot of '{c.PARAM_SAVES}'=share or "
                         "unshare; send it with that")
    start, end = bool(flags & c.SEQUENCE_START), bool(flags & c.SEQUENCE_END)
    whole = c.NUM_FRAMES in values
    save, release, share = _parameter(params, _SAVE), _parameter(params, _RELEASE), _parameter(params, _SHARE)
    if share and not save:
        raise InputError(f"request parameter '{c.PARAM_SHARE}' rides on a save ('{c.PARAM_SAVE}'); a snapshot saved "
                         f"already is shared with '{c.PARAM_SAVES}'=share")
    if release and not save:
        raise InputError(f"request parameter '{c.PARAM_RELEASE}' rides on a save ('{c.PARAM_SAVE}'): the older "
                         "snapshot goes once the new one is durable")
    release = check_snapshot_id(release, c.PARAM_RELEASE) if release else ""
    if release and start and not _parameter(params, _RESUME):
        raise InputError(f"request parameter '{c.PARAM_RELEASE}' names an older snapshot of a saved world; a new "
                         "world has none")
    if _parameter(params, _PAUSE):
        if save:
            raise InputError(f"request parameter '{c.PARAM_SAVE}' saves the world after a block: a pause carries "
                             "none (send it on a step)")
        return _pause(values, sequence_id, start, end, whole)
    if save and whole:
        raise InputError(f"request parameter '{c.PARAM_SAVE}' saves a steered session's world; a whole trajectory "
                         f"('{c.NUM_FRAMES}' set) is not saved")
    if start and (resume := _parameter(params, _RESUME)):
        return _resume(values, params, sequence_id, resume, save, release, share, end, whole)
    if sequence_id and not start and not whole:
        # The session's own inputs (image, seed, ...) are ignored on a step: tools such as perf_analyzer
        # repeat every input on every request of a sequence. A prompt on a step is a prompt event.
        controls = _controls(values)
        if controls is None and not end:
            raise InputError(f"a step needs '{c.CAMERA_POSES}' (the block's 12 new frames) or '{c.ACTION}'")
        if c.PROMPT in values:
            if controls is None:
                raise InputError(f"input '{c.PROMPT}' on a step rides on its block: send it with "
                                 f"'{c.CAMERA_POSES}' or '{c.ACTION}'")
            controls.prompt = _text(values[c.PROMPT], c.PROMPT)
        step = {p.name: _parameter(params, p) for p in c.REQUEST_PARAMETERS
                if p.name in (c.PARAM_RETURN_LATENTS, c.PARAM_RETURN_USED, c.PARAM_RECACHE)}
        if controls is not None:
            controls.recache, controls.save, controls.release = step[c.PARAM_RECACHE], save, release
            controls.share = share
            controls.check()
        elif save:
            raise InputError(f"request parameter '{c.PARAM_SAVE}' saves the world after a block: send it with the "
                             f"step's '{c.CAMERA_POSES}' or '{c.ACTION}'")
        return StepRequest(sequence_id, controls, end, step[c.PARAM_RETURN_LATENTS], step[c.PARAM_RETURN_USED])
    if whole and c.ACTION in values:
        raise InputError(f"input '{c.ACTION}' steers a session block by block; a whole trajectory "
                         f"('{c.NUM_FRAMES}' set) takes '{c.CAMERA_POSES}' for every frame instead")
    required = c.WHOLE_TRAJECTORY_INPUTS if whole else c.SESSION_START_INPUTS
    missing = [name for name in required if name not in values]
    if missing:
        kind = "a whole trajectory" if whole else "a steered session's first request"
        raise InputError(f"missing input(s) {missing}: {kind} needs {list(required)}")
    settings = {p.name: _parameter(params, p) for p in c.REQUEST_PARAMETERS}
    controls = None if whole else _controls(values)
    if controls is None and not whole:
        raise InputError(f"a steered session's first request needs '{c.CAMERA_POSES}' (9 frames) or '{c.ACTION}'")
    request = SessionRequest(
        image=values[c.IMAGE],
        prompt=_text(values[c.PROMPT], c.PROMPT),
        poses=values[c.CAMERA_POSES] if whole else controls.poses,
        keys=None if whole else controls.keys,
        intrinsics=values.get(c.CAMERA_INTRINSICS),
        num_frames=_scalar(values[c.NUM_FRAMES], c.NUM_FRAMES) if whole else None,
        seed=_scalar(values[c.SEED], c.SEED),
        height=_scalar(values[c.HEIGHT], c.HEIGHT),
        width=_scalar(values[c.WIDTH], c.WIDTH),
        decode=settings[c.PARAM_DECODE],
        return_latents=settings[c.PARAM_RETURN_LATENTS],
        on_starve=settings[c.PARAM_ON_STARVE],
        max_blocks=1 if end and not whole else settings[c.PARAM_MAX_BLOCKS],  # start and end at once: one block
        sequence_id=None if whole else sequence_id,
        return_used=settings[c.PARAM_RETURN_USED],
        expect_settings=settings[c.PARAM_EXPECT_SETTINGS],
        pose_scale=settings[c.PARAM_POSE_SCALE],
        save=save,
        share=share,
    )
    check_request(request)
    return request


RESUMED_INPUTS = (c.IMAGE, c.SEED, c.HEIGHT, c.WIDTH, c.CAMERA_INTRINSICS)  # the snapshot's own


def _resume(values: dict[str, np.ndarray], params: dict, sequence_id: str, snapshot_id: str, save: bool,
            release: str, share: bool, end: bool, whole: bool) -> ResumeRequest:
    """A steered session's start from a snapshot: its id and the next block's camera (with a prompt event's prompt,
    as a step's: a failover's replay may resume right before one); the rest is the snapshot's."""
    name = f"request parameter '{c.PARAM_RESUME}'"
    if whole or not sequence_id:
        raise InputError(f"{name} opens a steered session from its snapshot; a whole trajectory ('{c.NUM_FRAMES}' "
                         "set) cannot resume")
    if end:
        raise InputError(f"{name} starts a session: send its end flag on a later step")
    if extra := [n for n in RESUMED_INPUTS if n in values]:
        raise InputError(f"{name}: a resumed session's {extra} are the snapshot's; send only the next block's "
                         f"'{c.CAMERA_POSES}' or '{c.ACTION}'")
    controls = _controls(values)
    if controls is None:
        raise InputError(f"{name} needs the next block's '{c.CAMERA_POSES}' (12 new frames at 3 latent frames a block) "
                         f"or '{c.ACTION}'")
    chosen = {p.name: _parameter(params, p) for p in c.REQUEST_PARAMETERS
              if p.name in (c.PARAM_RETURN_LATENTS, c.PARAM_RETURN_USED, c.PARAM_FORK_SEED, c.PARAM_RECACHE)}
    if c.PROMPT in values:
        controls.prompt = _text(values[c.PROMPT], c.PROMPT)
    controls.save, controls.release, controls.recache = save, release, chosen[c.PARAM_RECACHE]
    controls.share = share
    controls.check()
    return ResumeRequest(check_snapshot_id(snapshot_id), controls, sequence_id, chosen[c.PARAM_FORK_SEED],
                         chosen[c.PARAM_RETURN_LATENTS], chosen[c.PARAM_RETURN_USED])


def block_outputs(
    block_index: int,
    num_blocks: int,
    latents: np.ndarray | None,
    frames: np.ndarray,
    timing_ms: tuple[float, float, float],
    held: bool = False,
    used: BlockUsed | None = None,
) -> dict[str, np.ndarray]:
    """The output tensors of one block's response, each in its contract dtype (what it was made from with `used`)."""
    values = {
        c.BLOCK_INDEX: [block_index],
        c.NUM_BLOCKS: [num_blocks],
        c.LATENTS: latents,
        c.FRAMES: frames,
        c.TIMING_MS: timing_ms,
        c.HELD: [held],
        c.CAMERA_USED: None if used is None else used.camera,
        c.PROMPT_USED: None if used is None else [used.prompt.encode("utf-8")],
        c.LATENTS_SHA256: None if used is None else [used.latents_sha256.encode("ascii")],
        c.SETTINGS_USED: None if used is None or used.settings is None else [used.settings.encode("utf-8")],
        c.RECACHED: None if used is None else [used.recached],
    }
    return _typed(values)


def place_outputs(position: int, wait_s: float) -> dict[str, np.ndarray]:
    """The output tensors of a waiting session's place in the queue (a response without a block)."""
    return _typed({c.QUEUE_POSITION: [position], c.WAIT_S: [wait_s]})


def snapshot_outputs(notice: SnapshotNotice) -> dict[str, np.ndarray]:
    """The output tensors of a save's outcome (a response without a block)."""
    return _typed({c.SNAPSHOT_ID: [notice.snapshot_id.encode()],
                   c.SNAPSHOT_ERROR: None if notice.error is None else [notice.error.encode("utf-8")]})


def saves_outputs(listing: str) -> dict[str, np.ndarray]:
    """The output tensor of the answer to request parameter saves: the key's snapshots as JSON text."""
    return _typed({c.SAVES: [listing.encode("utf-8")]})


def parse_saves(output: Callable[[str], np.ndarray | None]) -> dict | None:
    """The key's snapshots of a response to request parameter saves; None for any other response."""
    if output(c.SAVES) is None:
        return None
    try:
        listing = json.loads(_response_text(output, c.SAVES))
    except json.JSONDecodeError as exc:
        raise ResponseError(f"server response's {c.SAVES!r} is not JSON: {exc}") from exc
    if not isinstance(listing, dict) or not isinstance(listing.get("snapshots"), list):
        raise ResponseError(f"server response's {c.SAVES!r} is not a listing of snapshots")
    return listing


def _typed(values: dict[str, object]) -> dict[str, np.ndarray]:
    """Each given output in its contract dtype, in the contract's order (None: not sent)."""
    return {
        spec.name: np.ascontiguousarray(np.asarray(values[spec.name], dtype=spec.dtype))
        for spec in c.OUTPUTS
        if values.get(spec.name) is not None
    }


@dataclass(frozen=True)
class Place:
    """A waiting session's place in the queue as its client reads it (position 0: it has its slot now)."""

    position: int
    wait_s: float  # estimated seconds until its slot; negative: not estimated yet (no block measured)


@dataclass(frozen=True)
class SnapshotNotice:
    """A save's outcome as its client reads it: the snapshot is durable (error None), or why it failed."""

    snapshot_id: str
    error: str | None = None  # a refusal's wire text


def parse_snapshot(output: Callable[[str], np.ndarray | None]) -> SnapshotNotice | None:
    """The save's outcome of a response that carries one and no block; None for any other response."""
    if output(c.SNAPSHOT_ID) is None or output(c.BLOCK_INDEX) is not None:
        return None
    snapshot_id = _response_text(output, c.SNAPSHOT_ID)
    if not re.fullmatch(c.SNAPSHOT_ID_PATTERN, snapshot_id):
        raise ResponseError(f"server response's {c.SNAPSHOT_ID!r} is not a snapshot id: {snapshot_id[:40]!r}")
    error = None if output(c.SNAPSHOT_ERROR) is None else _response_text(output, c.SNAPSHOT_ERROR)
    return SnapshotNotice(snapshot_id, error)


def parse_place(output: Callable[[str], np.ndarray | None]) -> Place | None:
    """The place in the queue of a response that carries one and no block; None for a block's response."""
    position, wait = output(c.QUEUE_POSITION), output(c.WAIT_S)
    if position is None or output(c.BLOCK_INDEX) is not None:
        return None
    if position.size != 1 or wait is None or wait.size != 1:
        raise ResponseError(f"server response carries {c.QUEUE_POSITION!r} without one-element "
                            f"{c.QUEUE_POSITION!r} and {c.WAIT_S!r} outputs")
    return Place(int(position.reshape(-1)[0]), float(wait.reshape(-1)[0]))


@dataclass(frozen=True)
class BlockUsed:
    """What a block was made from (request parameter return_used; see api/provenance)."""

    camera: np.ndarray  # float32 [n, 4, 4]: the camera-to-world poses of its new video frames, as run
    prompt: str  # the prompt in force
    latents_sha256: str
    settings: str | None = None  # the server's settings_used (a session's first block)
    recached: bool = False  # its cached history was recomputed under its prompt first (a prompt event's recache)


@dataclass(frozen=True)
class BlockResponse:
    """One block's response as a client reads it."""

    block_index: int
    num_blocks: int
    latents: np.ndarray | None  # float32 [C, block_frames, h, w], None when not requested
    frames: np.ndarray  # uint8 [n, H, W, 3]; n = 0 without VAE decode
    timing_ms: tuple[float, ...]  # server: DiT compute, VAE decode, since request arrival
    arrival_s: float  # time.perf_counter() when the response reached the client
    held: bool = False  # a steered block run on held controls (its step came late)
    used: BlockUsed | None = None  # with return_used


def parse_block(output: Callable[[str], np.ndarray | None], arrival_s: float) -> BlockResponse:
    """The block of one response (`output(name)` gives an output array or None); the inverse of
    `block_outputs`. Raises ResponseError naming an output that breaks the contract."""

    def first(name: str) -> int:
        array = output(name)
        if array is None or array.size != 1:
            raise ResponseError(f"server response lacks a one-element {name!r} output")
        return int(array.reshape(-1)[0])

    frames = output(c.FRAMES)
    if frames is None:
        frames = np.empty((0, 0, 0, 3), dtype=np.uint8)
    elif frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3:
        raise ResponseError(f"server sent {c.FRAMES!r} as {frames.dtype} {list(frames.shape)}; expected uint8 [n, H, W, 3]")
    timing = output(c.TIMING_MS)
    held = output(c.HELD)
    camera = output(c.CAMERA_USED)
    used = None
    if camera is not None:
        if camera.dtype != np.float32 or camera.ndim != 3 or camera.shape[1:] != (4, 4):
            raise ResponseError(f"server sent {c.CAMERA_USED!r} as {camera.dtype} {list(camera.shape)}; "
                                f"expected float32 [n, 4, 4]")
        settings, recached = output(c.SETTINGS_USED), output(c.RECACHED)
        used = BlockUsed(camera=camera, prompt=_response_text(output, c.PROMPT_USED),
                         latents_sha256=_response_text(output, c.LATENTS_SHA256),
                         settings=None if settings is None else _response_text(output, c.SETTINGS_USED),
                         recached=recached is not None and bool(recached.reshape(-1)[0]))
    return BlockResponse(
        block_index=first(c.BLOCK_INDEX),
        num_blocks=first(c.NUM_BLOCKS),
        latents=output(c.LATENTS),
        frames=frames,
        timing_ms=() if timing is None else tuple(float(t) for t in timing.reshape(-1)),
        arrival_s=arrival_s,
        held=bool(held.reshape(-1)[0]) if held is not None else False,
        used=used,
    )


def _response_text(output: Callable[[str], np.ndarray | None], name: str) -> str:
    array = output(name)
    if array is None or array.size != 1:
        raise ResponseError(f"server response lacks a one-element {name!r} output")
    raw = array.reshape(-1)[0]
    try:
        return raw if isinstance(raw, str) else bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ResponseError(f"server sent {name!r} that is not UTF-8") from exc
