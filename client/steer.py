"""A steered session over Triton's gRPC stream: a sequence whose every request gets one block back.

The first request (sequence start) carries the image, prompt, seed, size and the first block's camera; each
step carries the next block's camera, as poses or held keys; the end flag closes the session.
"""
from __future__ import annotations

import functools
import queue
import time
from typing import Any

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from backend.api import contract
from backend.api.codec import BlockResponse, controls_arrays, request_arrays, request_parameters
from backend.api.request import Controls, SessionRequest
from client.stream import StreamError, model_error, new_sequence_id, pack_inputs, parse_response


class SteeredSession:
    """Use as a context manager; `start`, then `step` (as many as wanted ahead), `next_block` for each."""

    def __init__(self, url: str, *, model_name: str = contract.MODEL_NAME, sequence_id: int | None = None) -> None:
        self.url = url
        self.model_name = model_name
        self.sequence_id = sequence_id or new_sequence_id()
        self.sent_s: list[float] = []  # send time of every request, in order
        self._step_parameters: dict[str, bool] = {}  # the start's per-request choices, repeated on every step
        self._client = grpcclient.InferenceServerClient(url=url)
        self._responses: queue.Queue[Any] = queue.Queue()
        self._client.start_stream(callback=functools.partial(self._on_response, self._responses))

    @staticmethod
    def _on_response(responses: queue.Queue, result: Any = None, error: Any = None) -> None:
        responses.put((result, error, time.perf_counter()))

    def start(self, request: SessionRequest) -> None:
        if not request.steered:
            raise ValueError("a steered session's request has no num_frames")
        self._step_parameters = {contract.PARAM_RETURN_LATENTS: request.return_latents,
                                 contract.PARAM_RETURN_USED: request.return_used}
        self._send(request_arrays(request), start=True, parameters=request_parameters(request))

    def step(self, controls: Controls, end: bool = False) -> None:
        self._send(controls_arrays(controls), end=end, parameters=self._step_parameters)

    def end(self) -> None:
        """Close the session without another block (its answer is an empty final response)."""
        self._send({}, end=True)

    def _send(self, arrays: dict, start: bool = False, end: bool = False, parameters: dict | None = None) -> None:
        try:
            self._client.async_stream_infer(
                self.model_name, pack_inputs(arrays), parameters=parameters, sequence_id=self.sequence_id,
                sequence_start=start, sequence_end=end, enable_empty_final_response=True,
            )
        except InferenceServerException as exc:
            raise StreamError(f"sending to {self.url} failed: {exc.message()}") from exc
        self.sent_s.append(time.perf_counter())

    def next_block(self, timeout: float | None = None) -> BlockResponse | None:
        """The answer to the oldest unanswered request: its block, or None for an end without a camera."""
        try:
            result, error, arrival = self._responses.get(timeout=timeout)
        except queue.Empty:
            raise StreamError(f"no block from {self.model_name!r} within {timeout:g} s") from None
        if error is not None:
            raise StreamError(f"session {self.sequence_id}: {error.message()}", model_error(error))
        block, _ = parse_response(result, arrival)
        return block

    def close(self) -> None:
        self._client.stop_stream(cancel_requests=True)
        self._client.close()

    def __enter__(self) -> SteeredSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
