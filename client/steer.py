"""A steered session over Triton's gRPC stream: a sequence whose every request gets one block back.

The first request (sequence start) carries the image, prompt, seed, size and the first block's camera; each
step carries the next block's camera, as poses or held keys; the end flag closes the session.

Keep-alive: Triton's Python backend learns that a client left only through a request it still holds, so
whenever every request of the session is answered this client sends a pause (request parameter `pause`), which
the server holds open until the next request: a client that vanishes then ends its session at once, and one
that sends nothing for minutes keeps it. Pauses are tagged with `PAUSE_ID` and their answers never reach the
caller.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from tritonclient.utils import InferenceServerException

from backend.api import contract
from backend.api.codec import (BlockResponse, Place, controls_arrays, controls_parameters, parse_place, request_arrays,
                               request_parameters)
from backend.api.request import Controls, SessionRequest
from client.connection import Connection
from client.stream import StreamError, model_error, new_sequence_id, pack_inputs, parse_response

PAUSE_ID = "lingbot-pause"  # the request id of this client's pauses
PAUSE_REFUSAL = f"request parameter '{contract.PARAM_PAUSE}'"  # in every error the server answers a pause with
# An open pause is renewed this often (so it is at most twice as old): Triton's sequence batcher forgets a
# sequence that sent no request for session_idle_timeout_s + 60 s, however long its pause has been open.
RENEW_S = 20.0


class SteeredSession:
    """Use as a context manager; `start`, then `step` (as many as wanted ahead), `next_block` for each.
    keep_alive=False sends no pauses: the server then ends the session session_idle_timeout_s after its last
    answer, and learns of a disconnect only while a step waits for its block."""

    def __init__(self, url: str, *, model_name: str = contract.MODEL_NAME, sequence_id: int | None = None,
                 keep_alive: bool = True, on_place: Callable[[Place], None] | None = None,
                 connection: Connection = Connection()) -> None:
        """on_place: called (on tritonclient's thread) with each place in line the server tells the session
        while it waits for a slot; those responses answer no request. connection: TLS and the key (sent on the
        stream, so with every request of the session)."""
        self.url = url
        self.on_place = on_place
        self.model_name = model_name
        self.sequence_id = sequence_id or new_sequence_id()
        self.sent_s: list[float] = []  # send time of every request, in order (pauses not included)
        self._step_parameters: dict[str, bool] = {}  # the start's per-request choices, repeated on every step
        self._client = connection.client(url)
        self._responses: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()  # sends, and the record of what is unanswered
        self._unanswered: deque[bool] = deque()  # every request sent and not answered yet: is it a pause?
        self._keep_alive = keep_alive  # pauses still wanted: not after the end flag, a refused pause, or close
        self._closed = threading.Event()
        self._client.start_stream(callback=self._on_response, headers=connection.headers())
        if keep_alive:
            threading.Thread(target=self._renew, name=f"steer-keep-alive-{self.sequence_id}", daemon=True).start()

    def _on_response(self, result: Any = None, error: Any = None) -> None:
        """tritonclient's stream thread: a request's answer (or the stream's failure)."""
        arrival = time.perf_counter()
        if error is None and (place := parse_place(result.as_numpy)) is not None:  # the start still waits
            if self.on_place is not None:
                self.on_place(place)
            return
        with self._lock:
            if error is not None and error.status() is not None:  # the stream failed: no request's answer
                self._keep_alive, pause = False, False
            else:  # a result names its request; the server's refusal of a pause names the parameter. Any other
                # error goes to the caller (a pause answered with the session's end: the next step learns why).
                pause = result.get_response().id == PAUSE_ID if error is None else PAUSE_REFUSAL in error.message()
                if pause in self._unanswered:
                    self._unanswered.remove(pause)
                if pause and error is not None:  # refused: the session is not running
                    self._keep_alive = False
                elif not pause and not self._unanswered:
                    self._pause()
        if not pause:
            self._responses.put((result, error, arrival))

    def _pause(self) -> None:
        """Hold the session open while the caller sends nothing (under the lock)."""
        if not self._keep_alive:
            return
        try:
            self._client.async_stream_infer(
                self.model_name, [], request_id=PAUSE_ID, parameters={contract.PARAM_PAUSE: True},
                sequence_id=self.sequence_id, enable_empty_final_response=True,
            )
        except InferenceServerException:
            return  # the stream is gone: the caller's next request or next_block says so
        self._unanswered.append(True)

    def _renew(self) -> None:
        while not self._closed.wait(RENEW_S):
            with self._lock:
                if list(self._unanswered) == [True]:  # only a pause is open: a new one answers it
                    self._pause()

    def start(self, request: SessionRequest) -> None:
        if not request.steered:
            raise ValueError("a steered session's request has no num_frames")
        self._step_parameters = {contract.PARAM_RETURN_LATENTS: request.return_latents,
                                 contract.PARAM_RETURN_USED: request.return_used}
        self._send(request_arrays(request), start=True, parameters=request_parameters(request))

    def step(self, controls: Controls, end: bool = False) -> None:
        self._send(controls_arrays(controls), end=end, parameters=self._step_parameters | controls_parameters(controls))

    def end(self) -> None:
        """Close the session without another block (its answer is an empty final response)."""
        self._send({}, end=True)

    def _send(self, arrays: dict, start: bool = False, end: bool = False, parameters: dict | None = None) -> None:
        with self._lock:
            try:
                self._client.async_stream_infer(
                    self.model_name, pack_inputs(arrays), parameters=parameters, sequence_id=self.sequence_id,
                    sequence_start=start, sequence_end=end, enable_empty_final_response=True,
                )
            except InferenceServerException as exc:
                raise StreamError(f"sending to {self.url} failed: {exc.message()}") from exc
            self._unanswered.append(False)
            self._keep_alive &= not end
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
        with self._lock:
            self._keep_alive = False
        self._closed.set()
        self._client.stop_stream(cancel_requests=True)
        self._client.close()

    def __enter__(self) -> SteeredSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
