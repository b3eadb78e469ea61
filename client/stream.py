"""Streaming requests to the decoupled `lingbot_world` model over Triton's gRPC stream.

One request per stream: the server answers with one response per AR block, and the
last one (a data response, or an empty one) carries `triton_final_response`.
"""
from __future__ import annotations

import argparse
import functools
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from backend.api import contract
from backend.api.codec import BlockResponse, Place, parse_block, parse_place, request_arrays
from backend.api.description import ServerDescription
from backend.api.errors import ResponseError
from backend.api.refusal import Refusal
from backend.api.request import SessionRequest, check_frame_counts, check_request
from client.connection import Connection, add_connection_args, connection_of

_FINAL_FLAG = "triton_final_response"  # set by Triton on each response when empty final responses are enabled
_CANCELLED = object()  # queue sentinel pushed by StreamingSession.cancel()
# How often the command-line clients send a start refused with CAPACITY_EXHAUSTED (every slot and the queue full) again,
# each after the server's retry_after_s, on a new stream: behind a balancer it may reach another group
# (docs/scale-out.md). A StreamingSession does not retry unless asked: run_sessions reports what the server said.
CAPACITY_RETRIES = 3


class StreamError(RuntimeError):
    """The server, the connection or the response contents failed the request. `sentence` is what to show a
    user: the server's own words when the model answered with an error, else the whole description."""

    def __init__(self, message: str, server_sentence: str | None = None) -> None:
        super().__init__(message)
        # The server's refusal code (api/contract ERROR_CODES) and retry time, when it sent one.
        self.refusal = None if server_sentence is None else Refusal.parse(server_sentence)
        self.sentence = self.refusal.sentence if self.refusal else server_sentence or message

    @property
    def code(self) -> str | None:
        return None if self.refusal is None else self.refusal.code


class StreamTimeoutError(StreamError, TimeoutError):
    """No response arrived within the timeout (a whole trajectory's request is cancelled then)."""


class StreamCancelledError(StreamError):
    """StreamingSession.cancel() ended the request before its final response."""


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """--url and --model, the server every client command talks to, and how (TLS, the key: client/connection)."""
    parser.add_argument("--url", default="localhost:8001", help="Triton gRPC endpoint (default: %(default)s)")
    parser.add_argument("--model", default=contract.MODEL_NAME, help="model name (default: %(default)s)")
    add_connection_args(parser)


def describe_server(url: str, model_name: str = contract.MODEL_NAME,
                    connection: Connection = Connection()) -> ServerDescription | None:
    """What the server says of itself in its model config (api/description); None for a config without it."""
    client = connection.client(url)
    try:
        config = client.get_model_config(model_name, as_json=True)["config"]
    except InferenceServerException as exc:
        raise StreamError(f"reading {model_name!r}'s config from {url} failed: {exc.message()}") from exc
    finally:
        client.close()
    params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
    try:
        return ServerDescription.from_parameters(params)
    except ValueError as exc:
        raise StreamError(f"{model_name!r} at {url} describes itself wrongly: {exc}") from exc


def fill_size(args: argparse.Namespace, more: bool = False) -> ServerDescription | None:
    """--height and --width the user left out (None), from the server's description (default_height and
    default_width), else 480 x 832; returns the description (None: the server has none, or it was not needed:
    read only for a size left out, or when the caller needs `more` of it)."""
    needed = more or args.height is None or args.width is None
    described = describe_server(args.url, args.model, connection_of(args)) if needed else None
    if args.height is None:
        args.height = described.default_height if described else 480
    if args.width is None:
        args.width = described.default_width if described else 832
    return described


def new_sequence_id() -> int:
    """A random Triton correlation id (non-zero, 63 bits)."""
    return secrets.randbits(63) or 1


def pack_inputs(arrays: dict[str, np.ndarray]) -> list[grpcclient.InferInput]:
    """Triton inputs from named arrays, each typed by the wire contract (an unknown name is an error)."""
    inputs = []
    for name, array in arrays.items():
        spec = contract.INPUT_SPECS.get(name)
        if spec is None:
            raise ValueError(f"{name!r} is not an input of {contract.MODEL_NAME}; inputs: {list(contract.INPUT_SPECS)}")
        array = np.ascontiguousarray(array, dtype=spec.dtype)
        inputs.append(grpcclient.InferInput(name, list(array.shape), spec.triton_dtype).set_data_from_numpy(array))
    return inputs


def build_inputs(
    image: np.ndarray,
    prompt: str,
    poses: np.ndarray,
    intrinsics: np.ndarray | None,
    *,
    num_frames: int,
    seed: int,
    height: int,
    width: int,
    block_frames: int = contract.BLOCK_FRAMES,
) -> list[grpcclient.InferInput]:
    """Validate one generation request (as the server will: `check_request`, `check_frame_counts`) and pack it as Triton inputs
    (intrinsics optional); block_frames: the server's latent frames per AR block (3 for the diffusers download,
    4 for the official one). Raises ValueError naming the bad input."""
    first = contract.block_video_frames(block_frames, first=True)
    if num_frames < first or (num_frames - first) % contract.block_video_frames(block_frames, first=False):
        raise ValueError(f"num_frames must be {contract.frames_rule(block_frames)}, got {num_frames}")
    if height < 1 or width < 1:
        raise ValueError(f"height and width must be positive, got {height}x{width}")
    request = SessionRequest(image=np.asarray(image), prompt=prompt, poses=np.asarray(poses, dtype=np.float32),
                             intrinsics=None if intrinsics is None else np.asarray(intrinsics, dtype=np.float32),
                             num_frames=num_frames, seed=seed, height=height, width=width)
    check_request(request)
    check_frame_counts(request, block_frames)
    return request_inputs(request)


def request_inputs(request: SessionRequest) -> list[grpcclient.InferInput]:
    """The inputs of a `backend.api.request.SessionRequest` (the engine's own request type)."""
    return pack_inputs(request_arrays(request))


def parse_response(result: grpcclient.InferResult, arrival_s: float) -> tuple[BlockResponse | Place | None, bool]:
    """(block, is_final) of one streamed response; block is None for an empty final response, a `Place` for a
    waiting session's place in the queue (never final)."""
    response = result.get_response()
    final = _FINAL_FLAG in response.parameters and response.parameters[_FINAL_FLAG].bool_param
    if not response.outputs:
        return None, final
    try:
        place = parse_place(result.as_numpy)
        return place or parse_block(result.as_numpy, arrival_s), final
    except ResponseError as exc:
        raise StreamError(str(exc)) from exc


def show_place(place: Place) -> str:
    """A place in the queue in words, as the players print it."""
    if place.position == 0:
        return "a slot is free: computing the first block"
    wait = f", about {place.wait_s:.0f} s" if place.wait_s >= 0 else ""
    return f"waiting: {ordinal(place.position)} in the queue{wait}"


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def model_error(error: InferenceServerException) -> str | None:
    """The model's own sentence when the error is a response from the model (no gRPC status), else None."""
    return error.message() if error.status() is None else None


class StreamingSession:
    """A gRPC client holding one stream at a time, carrying one generation request.

    send() opens the stream and enqueues the request; responses() yields its blocks and
    closes the stream after the final one (cancelling it if iteration stops early).
    """

    def __init__(self, url: str, *, model_name: str = contract.MODEL_NAME, verbose: bool = False,
                 on_place: Callable[[Place], None] | None = None, capacity_retries: int = 0,
                 connection: Connection = Connection()) -> None:
        """on_place: called with each place in the queue the server tells a waiting request (blocks only are yielded);
        capacity_retries: how often a request refused with CAPACITY_EXHAUSTED before its first block is sent again
        after the server's retry_after_s (within responses()' timeout); connection: TLS and the key."""
        self.url = url
        self.connection = connection
        self.model_name = model_name
        self.on_place = on_place
        self.capacity_retries = capacity_retries
        self._sent: tuple[list[grpcclient.InferInput], str, dict | None] | None = None  # to send again on a retry
        self.request_id = ""
        self.sent_s: float | None = None  # time.perf_counter() when the request was enqueued
        self._client = connection.client(url, verbose)
        self._queue: queue.Queue[Any] | None = None  # responses of the request in flight

    @staticmethod
    def _on_response(responses: queue.Queue[Any], result: grpcclient.InferResult | None = None,
                     error: InferenceServerException | None = None) -> None:
        # Runs on tritonclient's stream thread: hand everything over to the consumer.
        responses.put((result, error, time.perf_counter()))

    def send(self, inputs: list[grpcclient.InferInput], *, request_id: str = "",
             parameters: dict[str, bool | int | float | str] | None = None) -> float:
        """Open the stream and enqueue the request; returns the send time (time.perf_counter())."""
        if self._queue is not None:
            raise StreamError("a request is already in flight on this session; read or cancel it first")
        responses: queue.Queue[Any] = queue.Queue()
        self.request_id = request_id
        try:
            self._client.start_stream(callback=functools.partial(self._on_response, responses),
                                      headers=self.connection.headers())
            # A whole trajectory is a Triton sequence of one request (the model uses the sequence batcher).
            self._client.async_stream_infer(
                self.model_name, inputs, request_id=request_id, parameters=parameters,
                enable_empty_final_response=True, sequence_id=new_sequence_id(), sequence_start=True,
                sequence_end=True,
            )
        except InferenceServerException as exc:
            # The stream may have died before the request was enqueued (e.g. no server):
            # its stream thread has then reported the actual cause through the callback.
            self._client.stop_stream(cancel_requests=True)
            try:
                _, error, _ = responses.get_nowait()
            except queue.Empty:
                error = None
            raise StreamError(self._describe(error or exc)) from exc
        self._queue = responses
        self._sent = (inputs, request_id, parameters)
        self.sent_s = time.perf_counter()
        return self.sent_s

    def responses(self, timeout: float | None = None) -> Iterator[BlockResponse]:
        """Blocks of the request in flight as they arrive; `timeout` seconds from send() in all."""
        if self._queue is None or self.sent_s is None:
            raise StreamError("no request in flight; call send() first")
        deadline = None if timeout is None else self.sent_s + timeout
        finished, retries, blocks = False, self.capacity_retries, 0
        try:
            while not finished:
                wait = None if deadline is None else max(0.0, deadline - time.perf_counter())
                try:
                    item = self._queue.get(timeout=wait)
                except queue.Empty:
                    raise StreamTimeoutError(
                        f"no final response from {self.model_name!r} within {timeout:g} s; request cancelled"
                    ) from None
                if item is _CANCELLED:
                    raise StreamCancelledError(f"request {self.request_id!r} cancelled by the client")
                result, error, arrival_s = item
                if error is not None:
                    refused = StreamError(self._describe(error), model_error(error))
                    if blocks or not retries or not self._send_again(refused, deadline):
                        raise refused
                    retries -= 1
                    continue
                block, finished = parse_response(result, arrival_s)
                if isinstance(block, Place):
                    if self.on_place is not None:
                        self.on_place(block)
                elif block is not None:
                    blocks += 1
                    yield block
        finally:
            self._queue = None
            # After the final response the server has nothing left to send; otherwise cancel.
            self._client.stop_stream(cancel_requests=not finished)

    def _send_again(self, refused: StreamError, deadline: float | None) -> bool:
        """After a CAPACITY_EXHAUSTED refusal: wait its retry_after_s (a cancel() ends the wait), then send the
        request again on a new stream; False for another refusal or when the deadline comes first."""
        if refused.code != contract.CAPACITY_EXHAUSTED or refused.refusal is None or self._sent is None:
            return False
        wait = refused.refusal.retry_after_s or 1.0
        if deadline is not None and time.perf_counter() + wait >= deadline:
            return False
        assert self._queue is not None
        until = time.perf_counter() + wait
        while (left := until - time.perf_counter()) > 0:
            try:
                if self._queue.get(timeout=left) is _CANCELLED:
                    raise StreamCancelledError(f"request {self.request_id!r} cancelled by the client")
            except queue.Empty:
                break
        self._client.stop_stream(cancel_requests=True)
        self._queue, sent_s = None, self.sent_s
        inputs, request_id, parameters = self._sent
        self.send(inputs, request_id=request_id, parameters=parameters)
        self.sent_s = sent_s  # the time to first block counts from the first send
        return True

    def _describe(self, error: InferenceServerException) -> str:
        """The failure with its context (model, request or URL)."""
        status = error.status()  # None for an error response from the model itself
        if status is None:
            return f"{self.model_name!r} failed request {self.request_id!r}: {error.message()}"
        hint = f" (is Triton serving gRPC at {self.url}?)" if status == "StatusCode.UNAVAILABLE" else \
            " (the balancer refused a request larger than its --max-request-bytes)" if "status: 413" in error.message() \
            else ""
        return f"stream to {self.url} failed with {status}: {error.message()}{hint}"

    def cancel(self) -> None:
        """Thread-safe: make responses() raise StreamCancelledError and cancel the request."""
        responses = self._queue
        if responses is not None:
            responses.put(_CANCELLED)

    def close(self) -> None:
        self._client.stop_stream(cancel_requests=True)
        self._client.close()

    def __enter__(self) -> StreamingSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclass(frozen=True)
class StreamRequest:
    inputs: list[grpcclient.InferInput]
    request_id: str = ""
    parameters: dict[str, bool | int | float | str] | None = None


@dataclass
class SessionResult:
    request_id: str
    sent_s: float | None = None
    blocks: list[BlockResponse] = field(default_factory=list)
    error: Exception | None = None

    @property
    def time_to_first_block_s(self) -> float | None:
        return None if not self.blocks or self.sent_s is None else self.blocks[0].arrival_s - self.sent_s

    @property
    def inter_block_s(self) -> list[float]:
        return [b.arrival_s - a.arrival_s for a, b in zip(self.blocks, self.blocks[1:])]


def run_sessions(
    url: str,
    requests: Sequence[StreamRequest],
    *,
    model_name: str = contract.MODEL_NAME,
    timeout: float | None = None,
    keep_data: bool = True,
    connection: Connection = Connection(),
) -> list[SessionResult]:
    """Run the requests concurrently, one stream (and thread) each, all sent at once.

    Errors are recorded per session instead of raised. With keep_data=False, frames and
    latents are dropped on arrival (frames keep their [0, H, W, 3] shape) to bound memory.
    """
    results = [SessionResult(r.request_id) for r in requests]
    sessions = [StreamingSession(url, model_name=model_name, connection=connection) for _ in requests]
    go = threading.Event()

    def run(session: StreamingSession, request: StreamRequest, result: SessionResult) -> None:
        go.wait()
        try:
            result.sent_s = session.send(request.inputs, request_id=request.request_id, parameters=request.parameters)
            for block in session.responses(timeout):
                if not keep_data:
                    block = replace(block, frames=block.frames[:0], latents=None)
                result.blocks.append(block)
        except Exception as exc:  # recorded for the caller, one failure must not stop the others
            result.error = exc

    threads = [threading.Thread(target=run, args=args, daemon=True) for args in zip(sessions, requests, results)]
    try:
        for thread in threads:
            thread.start()
        go.set()
        for thread in threads:
            thread.join()
    finally:  # on an interrupt: cancel what is in flight, give threads a moment to finish
        go.set()
        for session in sessions:
            session.cancel()
        for thread, session in zip(threads, sessions):
            thread.join(timeout=10.0)
            if not thread.is_alive():
                session.close()
    return results
