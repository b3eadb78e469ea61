"""Generated bad requests (Hypothesis), for the wire codec (api/codec.parse_request) and the browser bridge's schema
(client/web/schema): whatever arrives, the codec returns a request or refuses it with INVALID_INPUT, and a request
broken in one place from the contract's tables is refused naming that place; the bridge refuses what its table does
not allow with a plain error and a policy-violation close, before any session is started."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math

import aiohttp
import numpy as np
import pytest
from aiohttp import WSCloseCode
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from backend.api import contract as c
from backend.api.codec import parse_request, request_arrays
from backend.api.errors import InputError
from backend.api.request import SessionRequest, StepRequest
from client.web import app as web_app
from client.web.bridge import Player
from client.web.schema import INT_RANGE, MAX_TEXT, MESSAGES, parse_message
from factories import tiny_request

# Bounded for the suite's time on a slow, shared CI machine: a fixed number of examples, no per-example deadline, the
# same examples every run (derandomize), no example database written into the tree.
BOUNDED = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow])
STEP_SEQUENCE = "7"
PARAMETER = {p.name: p for p in c.REQUEST_PARAMETERS}


def json_values(floats: st.SearchStrategy) -> st.SearchStrategy:
    return st.recursive(st.none() | st.booleans() | st.integers() | floats | st.text(max_size=12),
                        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                     max_size=3), max_leaves=6)


JSON_VALUES = json_values(st.floats())  # NaN and Infinity too: Python's json reads and writes them
PAGE_VALUES = json_values(st.floats(allow_nan=False, allow_infinity=False))  # what a page's JSON.stringify sends


def whole() -> SessionRequest:
    return tiny_request(num_frames=9)


def steered() -> SessionRequest:
    return dataclasses.replace(whole(), num_frames=None, poses=None, keys="w", sequence_id=STEP_SEQUENCE)


# ---------------------------------------------------------------- the codec: anything in, a request or INVALID_INPUT


@st.composite
def wire_arrays(draw: st.DrawFn, spec: c.TensorSpec) -> np.ndarray:
    """An array as Triton could hand it over for `spec`: BYTES inputs as object arrays of bytes (Triton checks a
    request's types against config.pbtxt; the codec checks the rest), others of any contract dtype and shape."""
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=4, min_side=0, max_side=5))
    if spec.dtype == np.object_:
        items = draw(st.lists(st.binary(max_size=12), min_size=math.prod(shape), max_size=math.prod(shape)))
        return np.array(items + [None], dtype=object)[:-1].reshape(shape)
    dtype = draw(st.sampled_from([d for d in c.TRITON_DTYPES if d != np.object_]))
    return draw(hnp.arrays(dtype, shape))


@st.composite
def wire_requests(draw: st.DrawFn) -> tuple[dict[str, np.ndarray], str, str, int]:
    """A valid request of any kind with any of its inputs dropped or replaced, any parameters, any flags."""
    arrays = request_arrays(draw(st.sampled_from([whole(), steered()])))
    for spec in c.INPUTS:
        choice = draw(st.sampled_from(["keep", "drop", "replace"]))
        if choice == "drop":
            arrays.pop(spec.name, None)
        elif choice == "replace":
            arrays[spec.name] = draw(wire_arrays(spec))
    names = st.sampled_from(list(PARAMETER)) | st.text(max_size=8)
    params = draw(st.dictionaries(names, JSON_VALUES, max_size=4))
    key = draw(st.sampled_from(["", STEP_SEQUENCE]))
    flags = draw(st.sampled_from([0, c.SEQUENCE_START, c.SEQUENCE_END, c.SEQUENCE_START | c.SEQUENCE_END]))
    return arrays, json.dumps(params), key, flags


@BOUNDED
@given(wire_requests())
def test_whatever_arrives_is_a_request_or_an_invalid_input_refusal(request_parts) -> None:
    arrays, params, key, flags = request_parts
    try:
        parsed = parse_request(arrays.get, params, key, flags)
    except InputError as exc:
        assert exc.code == c.INVALID_INPUT and str(exc)
    else:
        assert isinstance(parsed, (SessionRequest, StepRequest))


@st.composite
def broken_input(draw: st.DrawFn) -> tuple[str, np.ndarray]:
    """One input of a whole trajectory broken against what the contract declares for it."""
    spec = draw(st.sampled_from([s for s in c.INPUTS if s.name != c.ACTION]))
    if spec.dtype.kind == "i":
        info = np.iinfo(spec.dtype)
        low = spec.minimum if spec.minimum is not None else info.min
        value = draw(st.one_of(
            st.integers(int(info.min), low - 1).map(lambda v: np.array([v], spec.dtype)) if low > info.min
            else st.nothing(),
            hnp.arrays(spec.dtype, st.sampled_from([(0,), (2,), (1, 2), (3,)])),
            hnp.arrays(st.sampled_from([d for d in c.TRITON_DTYPES if d not in (spec.dtype, np.object_)]), (1,))))
    elif spec.dtype.kind == "f":
        width = spec.dims[1:]
        rows = draw(st.integers(1, 9))
        value = draw(hnp.arrays(np.float32, (rows, *width), elements=st.floats(-1e3, 1e3, width=32)))
        flat = value.reshape(-1)
        if spec.positive_columns and draw(st.booleans()):
            value[draw(st.integers(0, rows - 1)), draw(st.integers(0, spec.positive_columns - 1))] = draw(
                st.floats(max_value=0.0, width=32, allow_nan=False))
        else:
            flat[draw(st.integers(0, flat.size - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    elif spec.dtype == np.object_:
        text = draw(st.one_of(st.text(st.sampled_from(" \t\n\r"), max_size=5),
                              st.text(min_size=c.MAX_PROMPT_BYTES // 4 + 1, max_size=c.MAX_PROMPT_BYTES + 64)
                              .filter(lambda t: len(t.encode()) > c.MAX_PROMPT_BYTES)))
        value = np.array([text.encode()], dtype=object)
    else:
        shape = draw(st.one_of(st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(0, 6))
                               .filter(lambda s: 0 in s[:2] or s[2] != 3),
                               hnp.array_shapes(min_dims=1, max_dims=2, min_side=1, max_side=4)))
        value = np.zeros(shape, np.uint8)
    return spec.name, value


@BOUNDED
@given(broken_input())
def test_an_input_broken_against_the_contract_is_refused_naming_it(broken) -> None:
    name, value = broken
    arrays = request_arrays(whole()) | {name: value}
    with pytest.raises(InputError) as caught:
        parse_request(arrays.get, "{}")
    assert caught.value.code == c.INVALID_INPUT and name in str(caught.value), caught.value


def outside(p: c.ParameterSpec) -> st.SearchStrategy:
    """JSON values a parameter's declared type, choices and range exclude."""
    if isinstance(p.default, bool):
        return JSON_VALUES.filter(lambda v: not isinstance(v, bool) and not (isinstance(v, str)
                                                                           and v.lower() in ("true", "false")))
    if isinstance(p.default, int):
        below = st.integers(max_value=p.minimum - 1)
        return below | below.map(str) | JSON_VALUES.filter(
            lambda v: isinstance(v, bool) or not isinstance(v, (int, str)) or (isinstance(v, str)
                                                                             and not v.lstrip("-").isdigit()))
    return JSON_VALUES.filter(lambda v: not isinstance(v, str) or (bool(p.choices) and v not in p.choices))


@BOUNDED
@given(st.sampled_from(c.REQUEST_PARAMETERS).flatmap(lambda p: st.tuples(st.just(p.name), outside(p))))
def test_a_parameter_outside_its_declared_type_choices_or_range_is_refused_naming_it(broken) -> None:
    name, value = broken
    arrays = request_arrays(steered())
    with pytest.raises(InputError) as caught:
        parse_request(arrays.get, json.dumps({name: value}), STEP_SEQUENCE, c.SEQUENCE_START)
    assert caught.value.code == c.INVALID_INPUT and f"request parameter '{name}'" in str(caught.value), caught.value


# ---------------------------------------------------------------- the bridge's schema


def fits_the_table(message: dict) -> bool:
    fields = MESSAGES[message["type"]]
    return set(message) - {"type"} <= set(fields)


@BOUNDED
@given(st.one_of(st.text(max_size=40), PAGE_VALUES.map(json.dumps),
                 st.dictionaries(st.sampled_from(["type", *{f for m in MESSAGES.values() for f in m}]),
                                 PAGE_VALUES | st.sampled_from(list(MESSAGES)), max_size=4).map(json.dumps)))
def test_whatever_a_page_sends_fits_the_bridge_s_table_or_is_refused_in_words(text: str) -> None:
    try:
        message = parse_message(text)
    except ValueError as exc:
        assert str(exc)
    else:
        assert fits_the_table(message)


@st.composite
def bad_messages(draw: st.DrawFn) -> tuple[dict, str]:
    """A message of a known type with one field outside the table (its JSON type, its range, its length), or of
    an unknown type or with an unknown field; and the words the refusal must hold."""
    kind = draw(st.sampled_from(list(MESSAGES)))
    fields = MESSAGES[kind]
    how = draw(st.sampled_from(["field", "unknown field", "unknown type"] if fields else ["unknown field",
                                                                                         "unknown type"]))
    if how == "unknown type":
        name = draw(st.text(max_size=8).filter(lambda t: t not in MESSAGES))
        return {"type": name}, "unknown message type"
    if how == "unknown field":
        name = draw(st.text(min_size=1, max_size=8).filter(lambda t: t not in fields and t != "type"))
        return {"type": kind, name: draw(PAGE_VALUES)}, name
    name = draw(st.sampled_from(sorted(fields)))
    expected = fields[name]
    if expected is int:
        low, high = INT_RANGE[name]
        value = draw(st.integers(max_value=low - 1) | st.integers(min_value=high + 1) | PAGE_VALUES.filter(
            lambda v: v is not None and (isinstance(v, bool) or not isinstance(v, int))))
    elif expected is str and name != "image" and draw(st.booleans()):  # the image's 24 MB is tried once below
        value = "x" * (MAX_TEXT[name] + draw(st.integers(1, 8)))
    else:
        value = draw(PAGE_VALUES.filter(lambda v: v is not None and not (
            isinstance(v, expected) and not (expected is int and isinstance(v, bool)))))
    return {"type": kind, name: value}, name


@BOUNDED
@given(bad_messages())
def test_a_message_outside_the_bridge_s_table_is_refused_naming_what_is_wrong(bad) -> None:
    message, name = bad
    with pytest.raises(ValueError) as caught:
        parse_message(json.dumps(message))
    assert name in str(caught.value) or repr(name) in str(caught.value), caught.value


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_json_s_non_numbers_are_refused(constant: str) -> None:
    with pytest.raises(ValueError, match="not JSON"):
        parse_message(f'{{"type": "start", "seed": {constant}}}')


@pytest.mark.parametrize("name", sorted(INT_RANGE))
def test_each_number_a_page_sends_is_taken_at_its_bounds_and_refused_one_past(name: str) -> None:
    low, high = INT_RANGE[name]
    for value in (low, high):
        assert parse_message(json.dumps({"type": "start", name: value}))[name] == value
    for value in (low - 1, high + 1):
        with pytest.raises(ValueError, match=name):
            parse_message(json.dumps({"type": "start", name: value}))


@pytest.mark.parametrize("name", sorted(MAX_TEXT))
def test_each_text_a_page_sends_is_taken_at_its_length_and_refused_one_longer(name: str) -> None:
    kind = next(kind for kind, fields in MESSAGES.items() if name in fields)
    assert parse_message(json.dumps({"type": kind, name: "x" * MAX_TEXT[name]}))[name]
    with pytest.raises(ValueError, match=f"{name} is longer than {MAX_TEXT[name]} characters"):
        parse_message(json.dumps({"type": kind, name: "x" * (MAX_TEXT[name] + 1)}))


def table_refusals() -> list[dict]:
    """One bad message per field of the table, and the unknown type and field."""
    bad = [{"type": "no such type"}, {"type": "stop", "extra": 1}, ["not", "an", "object"]]
    for kind, fields in MESSAGES.items():
        for name, expected in fields.items():
            bad.append({"type": kind, name: INT_RANGE[name][1] + 1 if expected is int else [name]})
    return bad


def test_the_bridge_answers_a_bad_message_with_an_error_and_a_policy_close_starting_nothing(monkeypatch) -> None:
    """The real app in this process (no Triton behind it): each bad message gets {"type": "error"} and the policy
    violation close, and no session starts (a good start, last, does)."""
    started = []

    async def play(self, request) -> None:
        started.append(request)

    async def wait_for_a_start() -> None:
        while not started:
            await asyncio.sleep(0.01)

    monkeypatch.setattr(Player, "play", play)

    async def exchange(client: TestClient, message) -> tuple[list[dict], int | None]:
        async with client.ws_connect("/ws") as ws:
            await ws.send_str(json.dumps(message))
            received = [json.loads(msg.data) async for msg in ws if msg.type == aiohttp.WSMsgType.TEXT]
            return received, ws.close_code

    async def run() -> None:
        app = web_app.make_app("127.0.0.1:1", c.MODEL_NAME, 5.0, web_app.Access(frozenset({"*"})))
        async with TestClient(TestServer(app)) as client:
            for message in table_refusals():
                received, code = await asyncio.wait_for(exchange(client, message), 30)
                assert [m["type"] for m in received] == ["session", "error"], (message, received)
                assert code == WSCloseCode.POLICY_VIOLATION, message
            async with client.ws_connect("/ws") as ws:  # the control: a good start does start a session
                await ws.send_str(json.dumps({"type": "start", "prompt": "a castle", "height": 64, "width": 64}))
                await asyncio.wait_for(wait_for_a_start(), 30)

    asyncio.run(run())
    assert [r.prompt for r in started] == ["a castle"]
