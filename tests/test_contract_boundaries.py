"""Every declared range and choice of the wire contract (api/contract) tried at its boundary: min - 1, min, the wire
type's max and one past it, empty, NaN and inf, for every input and request parameter. The cases are derived from
the contract's tables, so an entry added there is tried here; each refusal is INVALID_INPUT naming what it refuses.
Parse-level first (api/codec.parse_request), then the ranges only admission checks (the server's limits, its block
geometry)."""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest

from backend.api import contract as c
from backend.api.codec import controls_arrays, parse_request, request_arrays
from backend.api.errors import InputError
from backend.api.request import Controls, ResumeRequest, SessionRequest, StepRequest, default_intrinsics
from backend.serving.admission import Admission
from backend.serving.settings import ServingSettings
from factories import tiny_request

STEP_SEQUENCE = "7"  # a running steered session's Triton sequence
PARAMETER = {p.name: p for p in c.REQUEST_PARAMETERS}
NAN, INF = float("nan"), float("inf")


@dataclass(frozen=True)
class Case:
    """One value tried for one input or parameter: refused (INVALID_INPUT, naming `name`) or accepted at parse (a
    parameter's as `parsed`)."""

    name: str
    label: str
    value: object
    refused: bool
    parsed: object = None

    @property
    def id(self) -> str:
        return f"{self.name}:{self.label}"


def whole() -> SessionRequest:
    return tiny_request(num_frames=9)


def steered() -> SessionRequest:
    return dataclasses.replace(whole(), num_frames=None, poses=None, keys="w", sequence_id=STEP_SEQUENCE)


def parse_with(name: str, array: np.ndarray | None) -> SessionRequest | StepRequest:
    """A request that carries input `name` replaced by `array`: a steered start for `action`, else a whole trajectory."""
    base = steered() if name == c.ACTION else whole()
    arrays = request_arrays(base) | {name: array}
    flags = c.SEQUENCE_START if base.steered else 0
    return parse_request(arrays.get, "{}", base.sequence_id or "", flags)


def one(spec: c.TensorSpec, value) -> np.ndarray:
    return np.array([value], dtype=spec.dtype)


def wider(dtype: np.dtype) -> np.dtype:
    """The wire type one past an integer input's range travels in (Triton carries what the client sends)."""
    return np.dtype(np.int64) if dtype == np.int32 else np.dtype(np.uint64)


def integer_cases(spec: c.TensorSpec) -> list[Case]:
    info = np.iinfo(spec.dtype)
    low = info.min if spec.minimum is None else spec.minimum
    cases = [Case(spec.name, "min", one(spec, low), False), Case(spec.name, "max", one(spec, info.max), False),
             Case(spec.name, "max+1", np.array([info.max + 1], wider(spec.dtype)), True),
             Case(spec.name, "empty", np.zeros(0, spec.dtype), True),
             Case(spec.name, "two", np.array([low, low], spec.dtype), True)]
    if spec.minimum is not None:
        cases.append(Case(spec.name, "min-1", one(spec, spec.minimum - 1), True))
    else:
        cases.append(Case(spec.name, "min-1", np.array([int(info.min) - 1], np.float64), True))
    cases += [Case(spec.name, label, np.array([value], np.float32), True) for label, value in
              (("nan", NAN), ("inf", INF), ("-inf", -INF))]
    return cases


def valid_array(spec: c.TensorSpec) -> np.ndarray:
    """The input as the base request carries it (intrinsics: the default 60 degree lens)."""
    if spec.name == c.CAMERA_INTRINSICS:
        return np.array([[55.4, 55.4, 32.0, 32.0]], np.float32)
    return request_arrays(whole())[spec.name]


def float_cases(spec: c.TensorSpec) -> list[Case]:
    good = valid_array(spec)
    cases = [Case(spec.name, "as sent", good, False), Case(spec.name, "one row", good[:1], False),
             Case(spec.name, "empty", good[:0], True)]  # any number of rows (-1), at least one
    for axis, size in enumerate(spec.dims):
        if size > 0:  # a fixed dimension, one short and one long
            for label, n in (("short", size - 1), ("long", size + 1)):
                shape = list(good.shape)
                shape[axis] = n
                cases.append(Case(spec.name, f"dim{axis} {label}", np.resize(good, shape), True))
    for label, value in (("nan", NAN), ("inf", INF), ("-inf", -INF)):
        bad = good.copy()
        bad.reshape(-1)[-1] = value
        cases.append(Case(spec.name, label, bad, True))
    tiny = np.nextafter(np.float32(0), np.float32(1))
    for column in range(spec.positive_columns + 1 if spec.positive_columns else 0):  # and the first one beyond
        for label, value in (("0", 0.0), ("-0", -0.0), ("-tiny", -tiny), ("tiny", tiny)):
            bad = good.copy()
            bad[..., column] = value
            refused = column < spec.positive_columns and label != "tiny"
            cases.append(Case(spec.name, f"column {column} = {label}", bad, refused))
    return cases


def text_cases(spec: c.TensorSpec) -> list[Case]:
    good = request_arrays(steered())[spec.name] if spec.name == c.ACTION else valid_array(spec)
    cases = [Case(spec.name, "empty", good[:0], True), Case(spec.name, "two", np.repeat(good, 2), True),
             Case(spec.name, "not UTF-8", np.array([b"\xc3\x28"], object), True)]
    if spec.name == c.PROMPT:  # the declared size, in UTF-8 bytes
        cases += [Case(spec.name, "max", np.array([b"a" * c.MAX_PROMPT_BYTES], object), False),
                  Case(spec.name, "max+1", np.array([b"a" * (c.MAX_PROMPT_BYTES + 1)], object), True),
                  Case(spec.name, "max+1 in a 2-byte character",
                       np.array([("a" * (c.MAX_PROMPT_BYTES - 1) + "é").encode()], object), True),
                  Case(spec.name, "blank", np.array([b" \t"], object), True)]
    return cases


def image_cases(spec: c.TensorSpec) -> list[Case]:
    return [Case(spec.name, "1x1", np.zeros((1, 1, 3), np.uint8), False),
            Case(spec.name, "no rows", np.zeros((0, 5, 3), np.uint8), True),
            Case(spec.name, "no columns", np.zeros((5, 0, 3), np.uint8), True),
            Case(spec.name, "2 channels", np.zeros((5, 5, 2), np.uint8), True),
            Case(spec.name, "4 channels", np.zeros((5, 5, 4), np.uint8), True),
            Case(spec.name, "2 dims", np.zeros((5, 5), np.uint8), True)]


def dtype_cases(spec: c.TensorSpec) -> list[Case]:
    """Every other wire type the contract knows, refused by name (BYTES inputs take any object array)."""
    if spec.dtype == np.object_:
        return []
    shape = [max(d, 1) for d in spec.dims]
    return [Case(spec.name, f"as {name}", np.zeros(shape, dtype), True)
            for dtype, name in c.TRITON_DTYPES.items() if dtype != spec.dtype]


def input_cases() -> list[Case]:
    cases = []
    for spec in c.INPUTS:
        if spec.dtype.kind == "i":
            cases += integer_cases(spec)
        elif spec.dtype.kind == "f":
            cases += float_cases(spec)
        elif spec.dtype == np.object_:
            cases += text_cases(spec)
        else:
            cases += image_cases(spec)
        cases += dtype_cases(spec)
    return cases


def refused_as_invalid(name: str, parse: Callable[[], object]) -> InputError:
    with pytest.raises(InputError) as caught:
        parse()
    assert caught.value.code == c.INVALID_INPUT and name in str(caught.value), caught.value
    return caught.value


@pytest.mark.parametrize("case", input_cases(), ids=lambda case: case.id)
def test_every_input_at_its_boundaries(case: Case) -> None:
    if case.refused:
        refused_as_invalid(case.name, lambda: parse_with(case.name, case.value))
    else:
        parse_with(case.name, case.value)


def test_every_input_and_declared_range_has_boundary_cases() -> None:
    """The derivation covers the table: every input, each declared minimum, positive column and choice."""
    cases = input_cases()
    assert {case.name for case in cases} == {spec.name for spec in c.INPUTS}
    labels = {(case.name, case.label) for case in cases}
    assert all((s.name, "min-1") in labels for s in c.INPUTS if s.minimum is not None)
    assert all((s.name, f"column {s.positive_columns - 1} = 0") in labels for s in c.INPUTS if s.positive_columns)
    assert {case.name for case in parameter_cases()} == set(PARAMETER)


SNAPSHOT_ID_PARAMETERS = (c.PARAM_RESUME, c.PARAM_RELEASE, c.PARAM_SNAPSHOT)


def parameter_cases() -> list[Case]:
    """Each parameter's type, range and choices as the contract declares them; NaN and inf (JSON's constants) for all."""
    cases = []
    for p in c.REQUEST_PARAMETERS:
        cases += [Case(p.name, label, value, True) for label, value in
                  (("nan", NAN), ("inf", INF), ("-inf", -INF), ("null", None), ("list", [p.default]))]
        if isinstance(p.default, bool):
            cases += [Case(p.name, repr(v), v, False, parsed) for v, parsed in
                      ((True, True), (False, False), ("true", True), ("FALSE", False))]
            cases += [Case(p.name, repr(v), v, True) for v in (0, 1, "yes", "")]
        elif isinstance(p.default, int):
            low = p.minimum
            cases += [Case(p.name, "min", low, False, low), Case(p.name, "min as text", str(low), False, low),
                      Case(p.name, "huge", 2**63, False, 2**63), Case(p.name, "min-1", low - 1, True),
                      Case(p.name, "min-1 as text", str(low - 1), True), Case(p.name, "fraction", low + 0.5, True),
                      Case(p.name, "bool", True, True), Case(p.name, "empty", "", True)]
        elif p.choices:
            cases += [Case(p.name, choice, choice, False, choice) for choice in p.choices]
            for choice in filter(None, p.choices):  # "" among them: none asked for (saves)
                cases += [Case(p.name, f"{choice} upper", choice.upper(), True),
                          Case(p.name, f"{choice} short", choice[:-1], choice[:-1] not in p.choices),
                          Case(p.name, f"{choice} long", choice + "x", True)]
            cases += [Case(p.name, "number", 1, True)] + ([] if "" in p.choices else [Case(p.name, "empty", "", True)])
        else:
            cases += [Case(p.name, "empty", "", False, ""), Case(p.name, "number", 1, True)]
        if p.name in SNAPSHOT_ID_PARAMETERS:  # a snapshot id: 32 lowercase hex digits, nothing else
            sid = "0123456789abcdef" * 2
            cases += [Case(p.name, "id", sid, False, sid), Case(p.name, "id upper", sid.upper(), True),
                      Case(p.name, "id short", sid[:-1], True), Case(p.name, "id long", sid + "0", True),
                      Case(p.name, "id path", "../" + sid[3:], True), Case(p.name, "id newline", sid + "\n", True)]
    return cases


def parsed_parameter(name: str, value: object) -> object:
    """`name` = `value` on the request that reads it, and the value the parsed request carries."""
    params = json.dumps({name: value})
    if name == c.PARAM_PAUSE:  # a pause is a step of its own, without a camera; not pausing, a step with one
        arrays = {} if value in (True, "true") else controls_arrays(Controls(keys="w"))
        return parse_request(arrays.get, params, STEP_SEQUENCE, 0).pause
    if name == c.PARAM_RECACHE:  # rides on a prompt event
        arrays = controls_arrays(Controls(keys="w", prompt="it starts to snow"))
        return parse_request(arrays.get, params, STEP_SEQUENCE, 0).controls.recache
    if name == c.PARAM_RESUME:  # a start of a snapshot's world ("": a new world's start, which has no snapshot)
        request = parse_request(request_arrays(steered()).get, params, STEP_SEQUENCE, c.SEQUENCE_START) if value == "" \
            else parse_request(controls_arrays(Controls(keys="w")).get, params, STEP_SEQUENCE, c.SEQUENCE_START)
        return getattr(request, "snapshot_id", "")
    if name == c.PARAM_FORK_SEED:  # read by a resume only
        params = json.dumps({c.PARAM_RESUME: "a" * 32, name: value})
        return parse_request(controls_arrays(Controls(keys="w")).get, params, STEP_SEQUENCE, c.SEQUENCE_START).fork_seed
    if name in (c.PARAM_RELEASE, c.PARAM_SHARE):  # rides on a save (a release: of a world with an older snapshot)
        params = json.dumps({c.PARAM_SAVE: True, name: value})
        return getattr(parse_request(controls_arrays(Controls(keys="w")).get, params, STEP_SEQUENCE, 0).controls, name)
    if name == c.PARAM_SAVES:  # a request without inputs of its own ("": none, a start as any)
        if value == "":
            return getattr(parse_request(request_arrays(steered()).get, params, STEP_SEQUENCE, c.SEQUENCE_START), "action", "")
        named = {c.PARAM_SNAPSHOT: "a" * 32} if value in ("share", "unshare") else {}
        return parse_request({}.get, json.dumps({name: value} | named), STEP_SEQUENCE, c.SEQUENCE_START).action
    if name == c.PARAM_SNAPSHOT:  # the snapshot saves=share names ("": none, a start as any)
        if value == "":
            return getattr(parse_request(request_arrays(steered()).get, params, STEP_SEQUENCE, c.SEQUENCE_START),
                           "snapshot_id", "")
        params = json.dumps({c.PARAM_SAVES: "share", name: value})
        return parse_request({}.get, params, STEP_SEQUENCE, c.SEQUENCE_START).snapshot_id
    request = parse_request(request_arrays(steered()).get, params, STEP_SEQUENCE, c.SEQUENCE_START)
    return getattr(request, name)


@pytest.mark.parametrize("case", parameter_cases(), ids=lambda case: case.id)
def test_every_request_parameter_at_its_boundaries(case: Case) -> None:
    if case.refused:
        error = refused_as_invalid(case.name, lambda: parsed_parameter(case.name, case.value))
        assert f"request parameter '{case.name}'" in str(error)
    else:
        assert parsed_parameter(case.name, case.value) == case.parsed


# ---------------------------------------------------------------- ranges checked at admission


LIMITS = ServingSettings()


def still_poses(frames: int) -> np.ndarray:
    return np.tile(np.eye(4, dtype=np.float32), (frames, 1, 1))


@pytest.mark.parametrize(("name", "at_limit", "past_it"), [
    ("max_input_pixels", {"image": (1, LIMITS.max_input_pixels)}, {"image": (1, LIMITS.max_input_pixels + 1)}),
    ("max_frames", {"num_frames": LIMITS.max_frames}, {"num_frames": LIMITS.max_frames + 1}),
    ("max_pixels", {"height": 16, "width": LIMITS.max_pixels // 16}, {"height": 16, "width": LIMITS.max_pixels // 16
                                                                      + 16}),
])
def test_each_server_limit_admits_its_value_and_refuses_one_more(engine, name: str, at_limit: dict,
                                                                 past_it: dict) -> None:
    """The limits' defaults (serving/settings) at admission; an image is judged by its shape alone (a broadcast
    view here), and the size in whole patches (the next size up is 16 pixels more)."""

    def admitted(changes: dict) -> None:
        if "image" in changes:
            changes = changes | {"image": np.broadcast_to(np.zeros(3, np.uint8), (*changes["image"], 3))}
        if "num_frames" in changes:
            changes = changes | {"poses": still_poses(changes["num_frames"])}
        Admission(LIMITS, engine.spec).session(dataclasses.replace(whole(), **changes), "r0-1", 0)

    admitted(at_limit)
    error = refused_as_invalid(name, lambda: admitted(past_it))
    assert error.code == c.INVALID_INPUT


def test_num_frames_takes_whole_blocks_and_height_and_width_the_patch_factor(engine) -> None:
    """The engine's geometry (admission's): whole AR blocks of num_frames, each side a multiple of 16 (VAE 8 x
    patch 2), at the server's first valid value, one below and one above."""
    block = engine.settings.block_frames
    for blocks in (1, 2):
        frames = c.whole_block_frames(blocks, block)
        engine.geometry_of(dataclasses.replace(whole(), num_frames=frames, poses=still_poses(frames)))
        for off in (frames - 1, frames + 1, frames - 4, frames + 4):
            refused_as_invalid("num_frames", lambda n=off: engine.geometry_of(dataclasses.replace(whole(), num_frames=n)))
    for side in ("height", "width"):
        engine.geometry_of(dataclasses.replace(whole(), **{side: 16}))
        for off in (15, 17, 8, 0):
            refused_as_invalid("height", lambda size={side: off}: engine.geometry_of(dataclasses.replace(whole(), **size)))


@pytest.mark.parametrize("first", [True, False], ids=["first block", "later block"])
def test_a_steered_block_takes_exactly_its_video_frames_of_poses(engine, first: bool) -> None:
    """9 poses for a session's first block, 12 for each later one (contract.block_video_frames): one fewer or more
    is refused at admission, naming camera_poses."""
    frames = c.block_video_frames(engine.settings.block_frames, first)
    def admitted(n: int) -> None:
        poses = still_poses(n)
        if first:
            engine.geometry_of(dataclasses.replace(steered(), keys=None, poses=poses))
        else:
            Admission(LIMITS, engine.spec).step(StepRequest(STEP_SEQUENCE, Controls(poses=poses)))

    admitted(frames)
    for n in (frames - 1, frames + 1):
        refused_as_invalid("camera_poses", lambda n=n: admitted(n))


def test_a_request_s_defaults_are_the_contract_s() -> None:
    """Every request parameter a request, a step or a camera carries as a field starts at the contract's default
    (what a client sends when it says nothing, and what the server assumes)."""
    fields = {cls: {f.name: f.default for f in dataclasses.fields(cls)}
              for cls in (SessionRequest, StepRequest, Controls, ResumeRequest)}
    carried = [(cls, p) for p in c.REQUEST_PARAMETERS for cls in fields if p.name in fields[cls]]
    # pause makes a StepRequest of its own; resume a ResumeRequest, whose snapshot_id it is (no default); saves a
    # SavesRequest, whose action and snapshot_id they are
    assert {p.name for _, p in carried} >= set(PARAMETER) - {c.PARAM_PAUSE, c.PARAM_RESUME, c.PARAM_SAVES,
                                                             c.PARAM_SNAPSHOT}
    assert [(cls.__name__, p.name, fields[cls][p.name]) for cls, p in carried] == \
        [(cls.__name__, p.name, p.default) for cls, p in carried]


@pytest.mark.parametrize(("hfov", "valid"), [(0.0, False), (1e-3, True), (60.0, True), (179.9, True), (180.0, False),
                                             (-60.0, False)])
def test_the_default_lens_takes_a_field_of_view_between_0_and_180_degrees(hfov: float, valid: bool) -> None:
    if valid:
        fx, fy, cx, cy = default_intrinsics(1, 48, 64, hfov)[0]
        assert fx == fy > 0 and (cx, cy) == (32, 24)
    else:
        with pytest.raises(ValueError, match=r"horizontal FOV must be in \(0, 180\) degrees"):
            default_intrinsics(1, 48, 64, hfov)
