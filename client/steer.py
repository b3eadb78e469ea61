"""A steered session over Triton's gRPC stream: a sequence whose every request gets one block back.

The first request (sequence start) carries the image, prompt, seed, size and the first block's camera, or
(`resume`) a saved world's snapshot id and its next block's camera; each step carries the next block's camera,
as poses or held keys, and may ask for a save after its block; the end flag closes the session.

Keep-alive: Triton's Python backend learns that a client left only through a request it still holds, so
whenever every request of the session is answered this client sends a pause (request parameter `pause`), which
the server holds open until the next request: a client that vanishes then ends its session at once, and one
that sends nothing for minutes keeps it. Pauses are tagged with `PAUSE_ID` and their answers never reach the
caller.

Responses that answer no request: a waiting session's place in the queue (`on_place`) and a save's outcome
(`on_snapshot`: the snapshot is durable, or why it failed), both on tritonclient's thread. A save the server
refuses at once (SNAPSHOT_STORE_FULL, or INVALID_INPUT from a server without a snapshot store: its block is not run,
the session goes on) is answered before the blocks of the steps sent ahead of it; `next_block` still raises it in
its request's turn.
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tritonclient.utils import InferenceServerException

from backend.api import contract
from backend.api.codec import (BlockResponse, Place, SnapshotNotice, controls_arrays, controls_parameters,
                               parse_place, parse_snapshot, request_arrays, request_parameters, resume_parameters)
from backend.api.errors import ResponseError
from backend.api.request import Controls, ResumeRequest, SessionRequest, check_snapshot_id
from client.connection import Connection
from client.stream import StreamError, StreamTimeoutError, model_error, new_sequence_id, pack_inputs, parse_response

PAUSE_ID = "lingbot-pause"  # the request id of this client's pauses
PAUSE_REFUSAL = f"request parameter '{contract.PARAM_PAUSE}'"  # in every error the server answers a pause with
SAVE_NAMED = f"'{contract.PARAM_SAVE}'"  # in the INVALID_INPUT a save gets from a server that cannot save
# An open pause is renewed this often (so it is at most twice as old): Triton's sequence batcher forgets a
# sequence that sent no request for session_idle_timeout_s + 60 s, however long its pause has been open.
RENEW_S = 20.0


@dataclass
class _Answer:
    """A request's place in the queue for its answer: (result, failure, arrival) once it came."""

    save: bool  # it asks for a save (its refusal may come before earlier requests' blocks)
    sent_s: float
    item: tuple[Any, StreamError | None, float] | None = None


def refuses_save(failure: StreamError) -> bool:
    """A save refused at once, its block not run: the store is full, or the server keeps no snapshots."""
    return failure.code == contract.SNAPSHOT_STORE_FULL or (failure.code == contract.INVALID_INPUT
                                                            and SAVE_NAMED in failure.sentence)


class SteeredSession:
    """Use as a context manager; `start` (or `resume`), then `step` (as many as wanted ahead), `next_block` for
    each. keep_alive=False sends no pauses: the server then ends the session session_idle_timeout_s after its last
    answer, and learns of a disconnect only while a step waits for its block."""

    def __init__(self, url: str, *, model_name: str = contract.MODEL_NAME, sequence_id: int | None = None,
                 keep_alive: bool = True, on_place: Callable[[Place], None] | None = None,
                 on_snapshot: Callable[[SnapshotNotice], None] | None = None,
                 connection: Connection = Connection()) -> None:
        """on_place: called (on tritonclient's thread) with each place in the queue the server tells the session
        while it waits for a slot; on_snapshot: likewise with each save's outcome, once its snapshot is durable
        (or its write failed); neither answers a request. connection: TLS and the key (sent on the stream, so
        with every request of the session)."""
        self.url = url
        self.on_place = on_place
        self.on_snapshot = on_snapshot
        self.model_name = model_name
        self.sequence_id = sequence_id or new_sequence_id()
        self.sent_s: list[float] = []  # send time of every request, in order (pauses not included)
        self.answered_sent_s: float | None = None  # the send time of the request next_block answered last
        self._step_parameters: dict[str, bool] = {}  # the start's per-request choices, repeated on every step
        self._client = connection.client(url)
        self._lock = threading.Lock()  # sends, and the record of what is unanswered
        self._ready = threading.Condition(self._lock)  # an answer came for the oldest request, or the stream ended
        self._answers: deque[_Answer] = deque()  # every request but pauses, oldest first, until next_block takes it
        self._pauses = 0  # pauses sent and not answered
        self._over: StreamError | None = None  # the stream failed, or the session's end came on a pause
        self._keep_alive = keep_alive  # pauses still wanted: not after the end flag, a refused pause, or close
        self._closed = threading.Event()
        self._client.start_stream(callback=self._on_response, headers=connection.headers())
        if keep_alive:
            threading.Thread(target=self._renew, name=f"steer-keep-alive-{self.sequence_id}", daemon=True).start()

    def _on_response(self, result: Any = None, error: Any = None) -> None:
        """tritonclient's stream thread: a request's answer (or the stream's failure)."""
        arrival = time.perf_counter()
        if error is None:
            try:
                if (place := parse_place(result.as_numpy)) is not None:  # the start still waits
                    if self.on_place is not None:
                        self.on_place(place)
                    return
                if (notice := parse_snapshot(result.as_numpy)) is not None:  # a save's outcome
                    if self.on_snapshot is not None:
                        self.on_snapshot(notice)
                    return
            except ResponseError as exc:  # a response that breaks the contract: nothing after it can be trusted
                self._end_stream(StreamError(f"session {self.sequence_id}: {exc}"))
                return
        with self._lock:
            if error is not None and error.status() is not None:  # the stream failed: no request's answer
                self._keep_alive = False
                self._end_stream_locked(StreamError(f"session {self.sequence_id}: {error.message()}"))
                return
            # A result names its request; the server's refusal of a pause names the parameter.
            if (result.get_response().id == PAUSE_ID) if error is None else PAUSE_REFUSAL in error.message():
                self._pauses = max(0, self._pauses - 1)
                self._keep_alive &= error is None  # refused: the session is not running
                return
            failure = None if error is None else StreamError(f"session {self.sequence_id}: {error.message()}",
                                                             model_error(error))
            answer = self._answer_for(failure)
            if answer is None:  # no request waits: the session's end, told on its open pause
                self._pauses = max(0, self._pauses - 1)
                self._end_stream_locked(failure or StreamError(f"session {self.sequence_id}: an answer to no request"))
                return
            answer.item = (result, failure, arrival)
            self._ready.notify_all()
            if not self._unanswered() and not self._pauses:
                self._pause()

    def _answer_for(self, failure: StreamError | None) -> _Answer | None:
        """The request an answer is for: the oldest unanswered one, but a save's at-once refusal is its own."""
        saving = failure is not None and refuses_save(failure)
        waiting = self._unanswered()
        return next((a for a in waiting if a.save), None) if saving else next(iter(waiting), None)

    def _unanswered(self) -> list[_Answer]:
        return [a for a in self._answers if a.item is None]

    def _end_stream(self, failure: StreamError) -> None:
        with self._lock:
            self._keep_alive = False
            self._end_stream_locked(failure)

    def _end_stream_locked(self, failure: StreamError) -> None:
        if self._over is None:
            self._over = failure
        self._ready.notify_all()

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
        self._pauses += 1

    def _renew(self) -> None:
        while not self._closed.wait(RENEW_S):
            with self._lock:
                if self._pauses == 1 and not self._unanswered():  # only a pause is open: a new one answers it
                    self._pause()

    def start(self, request: SessionRequest) -> None:
        if not request.steered:
            raise ValueError("a steered session's request has no num_frames")
        self._step_parameters = {contract.PARAM_RETURN_LATENTS: request.return_latents,
                                 contract.PARAM_RETURN_USED: request.return_used}
        self._send(request_arrays(request), start=True, parameters=request_parameters(request), save=request.save)

    def resume(self, snapshot_id: str, controls: Controls, fork_seed: int | None = None, *,
               return_latents: bool = True, return_used: bool = False, save: bool = False) -> None:
        """Start from a saved world: its next block (the one after the snapshot's) on `controls`, its image,
        prompt, seed, size and session parameters the snapshot's; fork_seed: new noise from here on. ValueError
        for an id that is not one (32 lowercase hex digits) or a negative fork_seed."""
        if fork_seed is not None and fork_seed < 0:
            raise ValueError(f"fork_seed must be 0 or more, got {fork_seed}")
        controls = dataclasses.replace(controls, save=save or controls.save)
        resume = ResumeRequest(check_snapshot_id(snapshot_id), controls, "",
                               contract.NO_FORK if fork_seed is None else fork_seed, return_latents, return_used)
        self._step_parameters = {contract.PARAM_RETURN_LATENTS: return_latents,
                                 contract.PARAM_RETURN_USED: return_used}
        self._send(controls_arrays(controls), start=True, parameters=resume_parameters(resume), save=controls.save)

    def step(self, controls: Controls, end: bool = False, save: bool = False) -> None:
        """The next block's camera; `save`: a snapshot of the world after that block (its id comes to
        on_snapshot once durable). One save at a time may wait for its block (ValueError otherwise)."""
        controls = dataclasses.replace(controls, save=save or controls.save)
        self._send(controls_arrays(controls), end=end,
                   parameters=self._step_parameters | controls_parameters(controls), save=controls.save)

    def end(self) -> None:
        """Close the session without another block (its answer is an empty final response)."""
        self._send({}, end=True)

    def _send(self, arrays: dict, start: bool = False, end: bool = False, parameters: dict | None = None,
              save: bool = False) -> None:
        with self._lock:
            if save and any(a.save for a in self._unanswered()):
                raise ValueError("a save already waits for its block: ask for the next one after it")
            try:
                self._client.async_stream_infer(
                    self.model_name, pack_inputs(arrays), parameters=parameters, sequence_id=self.sequence_id,
                    sequence_start=start, sequence_end=end, enable_empty_final_response=True,
                )
            except InferenceServerException as exc:
                raise StreamError(f"sending to {self.url} failed: {exc.message()}") from exc
            now = time.perf_counter()
            self._answers.append(_Answer(save, now))
            self._keep_alive &= not end
            self.sent_s.append(now)

    def next_block(self, timeout: float | None = None) -> BlockResponse | None:
        """The answer to the oldest request not taken yet: its block, or None for an end without a camera.
        StreamTimeoutError when none comes within `timeout`; StreamError for a refusal or a failed stream."""
        with self._ready:
            if not self._ready.wait_for(self._taken_next, timeout):
                raise StreamTimeoutError(f"no block from {self.model_name!r} within {timeout:g} s")
            if not (self._answers and self._answers[0].item is not None):
                raise self._over
            answer = self._answers.popleft()
        self.answered_sent_s = answer.sent_s
        result, failure, arrival = answer.item
        if failure is not None:
            raise failure
        block, _ = parse_response(result, arrival)
        return block

    def waiting_since(self) -> float | None:
        """The send time of the oldest request whose answer has not come (None: every one has)."""
        with self._lock:
            return next((a.sent_s for a in self._unanswered()), None)

    def _taken_next(self) -> bool:
        return bool(self._answers and self._answers[0].item is not None) or self._over is not None

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
