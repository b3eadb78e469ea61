"""One request's decoupled response stream, and the package's logging routed into the server log."""
from __future__ import annotations

import logging
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from ..api.codec import BlockUsed, SnapshotNotice, block_outputs, place_outputs, saves_outputs, snapshot_outputs
from ..api.provenance import latents_sha256
from ..api.refusal import Refusal
from ..engine.blocks import BlockOutput
from .metrics import StreamMetrics

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
log = logging.getLogger(__name__)


class TritonLogHandler(logging.Handler):
    """Route the package's logging into the server log."""

    def emit(self, record: logging.LogRecord) -> None:
        message = f"lingbot_world: {self.format(record)}"
        if record.levelno >= logging.ERROR:
            pb_utils.Logger.log_error(message)
        elif record.levelno >= logging.WARNING:
            pb_utils.Logger.log_warn(message)
        else:
            pb_utils.Logger.log_info(message)


class TritonResponder:
    """Replies of one request through its decoupled response sender; nothing is sent after the final flag.

    Every send comes from the member's intake thread (serving/intake), serialised with `execute` (which holds
    `process_lock` too): a send from another thread while the stub's main thread was inside or leaving `execute`
    crashed the 2.51 Python backend's IPC (boost lock_exception, or a segfault) when steered steps came fast.
    """

    process_lock = threading.RLock()

    def __init__(
        self, sender: pb_utils.InferenceResponseSender, return_latents: bool, metrics: StreamMetrics, step: bool = False,
        settings_used: str | None = None, user: str = "",
    ) -> None:
        self.sender = sender
        self.user = user  # the request's key name ("": no keys), for the metrics by key
        self.step = step  # a steered session's request: one block, its latency is the step latency
        self.return_latents = return_latents
        self.settings_used = settings_used  # the request asked for return_used: the engine's settings_used
        self.metrics = metrics
        self.arrival = time.perf_counter()
        self.last_block: float | None = None
        self.closed = False
        metrics.streams_open.increment(1)

    def send_block(self, output: BlockOutput, frames: np.ndarray, decode_ms: float, final: bool) -> None:
        now = time.perf_counter()
        since_arrival_ms = (now - self.arrival) * 1000.0
        latents = output.latents[0].numpy()
        used = None if self.settings_used is None else BlockUsed(
            output.camera, output.prompt, latents_sha256(latents),
            self.settings_used if output.block_index == 0 else None, output.recached)
        tensors = block_outputs(
            output.block_index, output.num_blocks, latents if self.return_latents else None, frames,
            (output.dit_ms, decode_ms, since_arrival_ms), output.held, used,
        )
        response = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in tensors.items()])
        if self._send(response, FINAL if final else 0):
            m = self.metrics
            m.blocks.increment(1)
            m.key_block(self.user)
            m.block_dit.observe(output.dit_ms / 1000.0)
            if output.held:
                m.held_blocks.increment(1)
            if self.step:
                m.step_latency.observe(now - self.arrival)
            if self.last_block is None:
                m.time_to_first_block.observe(now - self.arrival)
            else:
                m.inter_block.observe(now - self.last_block)
            self.last_block = now

    def send_error(self, refusal: Refusal) -> None:
        if self._send(pb_utils.InferenceResponse(error=pb_utils.TritonError(refusal.message)), FINAL):
            self.metrics.errors.increment(1)
            self.metrics.refused(refusal.code, self.user)

    def send_place(self, position: int, wait_s: float) -> None:
        tensors = place_outputs(position, wait_s)
        self._send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in tensors.items()]), 0)

    def send_notice(self, notice: SnapshotNotice) -> None:
        tensors = snapshot_outputs(notice)
        self._send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in tensors.items()]), 0)

    def send_saves(self, listing: str) -> None:
        tensors = saves_outputs(listing)
        self._send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in tensors.items()]),
                   FINAL)

    def finish(self) -> None:
        self._send(None, FINAL)

    def is_cancelled(self) -> bool:
        return self.closed or self.sender.is_cancelled()

    def _send(self, response: pb_utils.InferenceResponse | None, flags: int) -> bool:
        """Send unless the stream is closed; returns whether it was sent. A send that fails (its client's stream
        is gone) is logged, never raised: the sends to other clients that follow it go on, and a final one closes
        the stream here all the same, so the open streams' count (what a drain waits on) never keeps it."""
        with self.process_lock:
            if self.closed:
                return False
            self.closed = bool(flags & FINAL)
            try:
                if response is None:
                    self.sender.send(flags=flags)
                else:
                    self.sender.send(response, flags=flags)
            except Exception as exc:  # noqa: BLE001 - the Python backend's error for a stream that is gone
                log.warning("a response could not be sent (its client's stream is gone?): %r", exc)
                return False
            finally:
                if self.closed:
                    self.metrics.streams_open.increment(-1)
            return True
