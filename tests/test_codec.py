"""Triton tensors to engine requests and back, and instance placement, without a server."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from backend.api import contract as p
from backend.api.errors import ConfigError, InputError, ResponseError
from backend.adapter.placement import instance_rank
from backend.api.codec import BlockUsed, Place, block_outputs, parse_block, parse_place, parse_request, place_outputs
from backend.api.provenance import latents_sha256
from backend.api.request import StepRequest
from factories import forward_poses, sample_image


def valid_inputs() -> dict[str, np.ndarray]:
    return {
        p.IMAGE: sample_image(),
        p.PROMPT: np.array([b"a castle"], dtype=object),
        p.CAMERA_POSES: forward_poses(9),
        p.NUM_FRAMES: np.array([9], np.int32),
        p.SEED: np.array([-3], np.int64),
        p.HEIGHT: np.array([64], np.int32),
        p.WIDTH: np.array([64], np.int32),
    }


def test_parse_valid_request() -> None:
    request = parse_request(valid_inputs().get, json.dumps({p.PARAM_DECODE: False}))
    assert (request.prompt, request.num_frames, request.seed, request.height) == ("a castle", 9, -3, 64)
    assert request.intrinsics is None and request.decode is False and request.return_latents is True


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({p.CAMERA_POSES: None}, r"missing input\(s\) \['camera_poses'\]"),
        ({p.SEED: np.array([1], np.int32)}, r"input 'seed' must be int64; got int32"),
        ({p.NUM_FRAMES: np.array([9, 9], np.int32)}, r"'num_frames' must hold exactly one value"),
        ({p.PROMPT: np.array([b"\xc3\x28"], dtype=object)}, r"not valid UTF-8"),
        ({p.PROMPT: np.array([b"a", b"b"], dtype=object)}, r"exactly one string"),
    ],
)
def test_parse_errors(change: dict, message: str) -> None:
    inputs = valid_inputs()
    inputs.update(change)
    with pytest.raises(InputError, match=message):
        parse_request(lambda name: inputs.get(name), "{}")


def test_parameter_errors() -> None:
    with pytest.raises(InputError, match="not valid JSON"):
        parse_request(valid_inputs().get, "{")
    with pytest.raises(InputError, match="'return_latents' must be a bool; got 3"):
        parse_request(valid_inputs().get, json.dumps({p.PARAM_RETURN_LATENTS: 3}))


def test_block_outputs() -> None:
    out = block_outputs(2, 7, None, np.zeros((12, 8, 8, 3), np.uint8), (1.0, 2.0, 3.0))
    assert set(out) == {p.BLOCK_INDEX, p.NUM_BLOCKS, p.FRAMES, p.TIMING_MS, p.HELD}
    assert out[p.BLOCK_INDEX].dtype == np.int32 and out[p.TIMING_MS].tolist() == [1.0, 2.0, 3.0]
    assert out[p.HELD].dtype == np.bool_ and not out[p.HELD][0]


def test_a_block_s_outputs_read_back_as_the_block_a_client_sees() -> None:
    """block_outputs and parse_block are each other's inverse, with what the block was made from (return_used);
    a place in the queue reads back as a place, a block's response as none."""
    camera = np.tile(np.eye(4, dtype=np.float32), (12, 1, 1))
    latents = np.arange(4 * 3 * 8 * 8, dtype=np.float32).reshape(4, 3, 8, 8)
    used = BlockUsed(camera, "it snows ❄", latents_sha256(latents), "block_frames=3;dtype=float32", recached=True)
    frames = np.full((12, 8, 8, 3), 7, np.uint8)
    out = block_outputs(2, 7, latents, frames, (1.0, 2.0, 3.0), held=True, used=used)
    block = parse_block(out.get, 12.5)
    assert (block.block_index, block.num_blocks, block.held, block.timing_ms, block.arrival_s) == (2, 7, True,
                                                                                                  (1.0, 2.0, 3.0), 12.5)
    assert np.array_equal(block.latents, latents) and np.array_equal(block.frames, frames)
    assert block.used.prompt == used.prompt and block.used.recached and block.used.settings == used.settings
    assert np.array_equal(block.used.camera, camera) and block.used.latents_sha256 == used.latents_sha256
    plain = parse_block(block_outputs(0, 1, None, np.empty((0, 8, 8, 3), np.uint8), (1.0, 2.0, 3.0)).get, 0.0)
    assert plain.used is None and plain.latents is None and not plain.held and plain.frames.shape == (0, 8, 8, 3)
    undecoded = {name: array for name, array in out.items() if name != p.FRAMES}  # decode off: no frames output
    assert parse_block(undecoded.get, 0.0).frames.shape == (0, 0, 0, 3)  # no frame, of no known size
    later = block_outputs(3, 7, None, frames, (1.0, 2.0, 3.0), used=dataclasses.replace(used, settings=None,
                                                                                        recached=False))
    assert parse_block(later.get, 0.0).used.settings is None and not parse_block(later.get, 0.0).used.recached
    assert parse_place(out.get) is None
    assert parse_place(place_outputs(3, 12.5).get) == Place(3, 12.5)


@pytest.mark.parametrize(("name", "value", "message"), [
    (p.CAMERA_USED, np.zeros((12, 4, 4), np.float64), r"'camera_used' as float64 \[12, 4, 4\]"),
    (p.CAMERA_USED, np.zeros((12, 3, 4), np.float32), r"'camera_used' as float32 \[12, 3, 4\]"),
    (p.FRAMES, np.zeros((12, 8, 8, 4), np.uint8), r"'frames' as uint8 \[12, 8, 8, 4\]"),
    (p.FRAMES, np.zeros((12, 8, 8, 3), np.float32), r"'frames' as float32"),
    (p.BLOCK_INDEX, np.array([1, 2], np.int32), r"lacks a one-element 'block_index'"),
    (p.PROMPT_USED, None, r"lacks a one-element 'prompt_used'"),
    (p.PROMPT_USED, np.array([b"a", b"b"], dtype=object), r"lacks a one-element 'prompt_used'"),
    (p.LATENTS_SHA256, np.array([b"\xff"], dtype=object), r"'latents_sha256' that is not UTF-8"),
])
def test_a_response_that_breaks_the_contract_is_refused_naming_the_output(name: str, value, message: str) -> None:
    used = BlockUsed(np.tile(np.eye(4, dtype=np.float32), (12, 1, 1)), "a castle", "0" * 64)
    out = block_outputs(1, 2, None, np.zeros((12, 8, 8, 3), np.uint8), (1.0, 2.0, 3.0), used=used)
    out = {k: v for k, v in (out | {name: value}).items() if v is not None}
    with pytest.raises(ResponseError, match=message):
        parse_block(out.get, 0.0)
    with pytest.raises(ResponseError, match="without one-element"):
        parse_place({p.QUEUE_POSITION: np.array([1], np.int32)}.get)


def test_sequence_requests_parse_as_starts_and_steps() -> None:
    start_flag, end_flag = p.SEQUENCE_START, p.SEQUENCE_END
    first = {k: v for k, v in valid_inputs().items() if k not in (p.NUM_FRAMES, p.CAMERA_POSES)}
    first[p.ACTION] = np.array([b"WA"], dtype=object)
    start = parse_request(first.get, json.dumps({p.PARAM_ON_STARVE: "hold"}), "7", start_flag)
    assert start.steered and start.keys == "aw" and start.on_starve == "hold" and start.sequence_id == "7"
    assert parse_request(first.get, "{}", "7", start_flag | end_flag).max_blocks == 1  # start and end: one block
    step = parse_request({p.CAMERA_POSES: forward_poses(12)}.get, "{}", "7", 0)
    assert isinstance(step, StepRequest) and step.controls.poses.shape == (12, 4, 4) and not step.end
    closing = parse_request({}.get, "{}", "7", end_flag)
    assert isinstance(closing, StepRequest) and closing.controls is None and closing.end
    repeated = parse_request({p.ACTION: np.array([b"w"], dtype=object), p.IMAGE: sample_image()}.get, "{}", "7", 0)
    assert isinstance(repeated, StepRequest) and repeated.controls.keys == "w"  # the session's inputs are ignored
    with pytest.raises(InputError, match=r"a step needs 'camera_poses'"):
        parse_request({}.get, "{}", "7", 0)
    event = parse_request({p.ACTION: np.array([b"w"], dtype=object),
                           p.PROMPT: np.array([b"it starts to snow"], dtype=object)}.get, "{}", "7", 0)
    assert event.controls.keys == "w" and event.controls.prompt == "it starts to snow"
    with pytest.raises(InputError, match=r"input 'prompt' on a step rides on its block"):
        parse_request({p.PROMPT: np.array([b"snow"], dtype=object)}.get, "{}", "7", end_flag)
    with pytest.raises(InputError, match=r"input 'prompt' is not valid UTF-8"):
        parse_request({p.ACTION: np.array([b"w"], dtype=object), p.PROMPT: np.array([b"\xff"], dtype=object)}.get,
                      "{}", "7", 0)
    with pytest.raises(InputError, match=r"'on_starve' must be one of|must be a string"):
        parse_request(first.get, json.dumps({p.PARAM_ON_STARVE: 3}), "8", start_flag)


def test_instance_rank_cpu_groups_and_gpus() -> None:
    cpu = {"instance_group": [{"name": "m_0", "count": 2, "kind": "KIND_CPU"}, {"count": 3, "kind": "KIND_CPU"}]}
    ranks = [
        instance_rank({"model_instance_kind": "CPU", "model_instance_name": n, "model_name": "m"}, cpu)
        for n in ("m_0_0", "m_0_1", "m_1_0", "m_1_2")
    ]
    assert ranks == [(0, 5), (1, 5), (2, 5), (4, 5)]
    gpu = {"instance_group": [{"count": 1, "kind": "KIND_GPU", "gpus": [g]} for g in (2, 3, 0, 1)]}
    args = {"model_instance_kind": "GPU", "model_instance_device_id": "3", "model_name": "m"}
    assert instance_rank(args, gpu) == (3, 4)
    with pytest.raises(ConfigError, match="one instance per GPU"):
        instance_rank(args, {"instance_group": [{"count": 2, "kind": "KIND_GPU", "gpus": [3]}]})
    # Server 1 of 2 with four GPU instances: global ranks 4..7.
    assert instance_rank(args, gpu, host_rank=1, host_count=2) == (7, 8)
    cpu_args = {"model_instance_kind": "CPU", "model_instance_name": "m_1_0", "model_name": "m"}
    assert instance_rank(cpu_args, cpu, host_rank=2, host_count=3) == (12, 15)


@pytest.mark.parametrize(
    ("values", "flags", "message"),
    [
        ({p.CAMERA_POSES: forward_poses(12)}, 0, r"a pause \(request parameter 'pause'\) carries no block: send it "
                                                 r"without \['camera_poses'\]"),
        ({p.ACTION: np.array([b"w"], dtype=object), p.PROMPT: np.array([b"snow"], dtype=object)}, 0,
         r"send it without \['action', 'prompt'\]"),
        ({p.ACTION: np.array([b"w"], dtype=object)}, p.SEQUENCE_START,
         r"'pause' pauses a running steered session; a request with the start flag cannot pause"),
        ({}, p.SEQUENCE_END, r"'pause' and the end flag exclude each other"),
        (valid_inputs(), p.SEQUENCE_START | p.SEQUENCE_END, r"a whole trajectory \('num_frames' set\) cannot pause"),
    ],
)
def test_a_pause_is_a_step_without_a_block(values: dict, flags: int, message: str) -> None:
    paused = parse_request({p.IMAGE: sample_image()}.get, json.dumps({p.PARAM_PAUSE: True}), "7", 0)
    assert isinstance(paused, StepRequest) and paused.pause and paused.controls is None and not paused.end
    with pytest.raises(InputError, match=message):
        parse_request(values.get, json.dumps({p.PARAM_PAUSE: "true"}), "7", flags)


@pytest.mark.parametrize("spec", [s for s in p.REQUEST_PARAMETERS if s.choices or s.minimum is not None],
                         ids=lambda s: s.name)
def test_every_declared_choice_and_range_is_enforced_at_parse(spec: p.ParameterSpec) -> None:
    """The contract declares them; parse_request refuses a value outside, naming the parameter."""
    bad = "no such choice" if spec.choices else spec.minimum - 1
    with pytest.raises(InputError, match=rf"request parameter '{spec.name}' must be (one of|>=) .*; got"):
        parse_request(valid_inputs().get, json.dumps({spec.name: bad}))
    good = spec.choices[-1] if spec.choices else spec.minimum
    if spec.name == p.PARAM_SAVES:  # a request about the key's saves carries no inputs, and names its snapshot
        parse_request({}.get, json.dumps({spec.name: good, p.PARAM_SNAPSHOT: "0" * 32}))
    else:
        parse_request(valid_inputs().get, json.dumps({spec.name: good}))


@pytest.mark.parametrize("spec", [s for s in p.INPUTS if s.minimum is not None], ids=lambda s: s.name)
def test_every_declared_input_minimum_is_enforced_at_parse(spec: p.TensorSpec) -> None:
    inputs = valid_inputs() | {spec.name: np.array([spec.minimum - 1], spec.dtype)}
    with pytest.raises(InputError, match=rf"input '{spec.name}' must be >= {spec.minimum}; got {spec.minimum - 1}"):
        parse_request(inputs.get, "{}")


def test_each_input_is_checked_at_parse_and_its_fit_to_the_server_at_admission() -> None:
    """A pose that is no rotation is the contract's to refuse; how many poses a request needs is the server's."""
    poses = forward_poses(9)
    poses[4, :3, :3] *= 3.0
    with pytest.raises(InputError, match=r"camera_poses\[4\]: the 3x3 block is not a rotation"):
        parse_request((valid_inputs() | {p.CAMERA_POSES: poses}).get, "{}")
    with pytest.raises(InputError, match=r"camera_poses\[4\]: the 3x3 block is not a rotation"):
        parse_request({p.CAMERA_POSES: poses[:12] if len(poses) >= 12 else np.concatenate([poses, poses[:3]])}.get,
                      "{}", "7", 0)  # a step's camera too
    few = parse_request((valid_inputs() | {p.CAMERA_POSES: forward_poses(5)}).get, "{}")
    assert few.poses.shape == (5, 4, 4)  # parsed: 5 valid poses; admission counts them against num_frames


def test_a_recache_rides_on_a_world_event() -> None:
    step = {p.ACTION: np.array([b"w"], dtype=object), p.PROMPT: np.array([b"it starts to snow"], dtype=object)}
    parsed = parse_request(step.get, json.dumps({p.PARAM_RECACHE: True}), "7", 0)
    assert parsed.controls.recache and parsed.controls.prompt == "it starts to snow"
    with pytest.raises(InputError, match=r"request parameter 'recache' rides on a prompt event: send it with 'prompt'"):
        parse_request({p.ACTION: np.array([b"w"], dtype=object)}.get, json.dumps({p.PARAM_RECACHE: True}), "7", 0)
