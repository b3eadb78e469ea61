"""Triton Python-backend adapter: one instance per device joins the SP group and serves through it."""
from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import logging
import os
import threading
import time

import numpy as np
import torch
import torch.distributed as dist
import triton_python_backend_utils as pb_utils

from .config import read_checkpoint_configs, split_parameters
from .coordinator import GroupCoordinator
from .engine import BlockOutput, WorldModelEngine
from .errors import ConfigError, InputError
from .parallel import SequenceParallel, init_process_group
from .triton_io import block_outputs, instance_rank, parse_request
from .triton_metrics import StreamMetrics
from .validation import validate_engine

log = logging.getLogger("backend")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


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
    """Replies of one request through its decoupled response sender; nothing is sent after the final flag."""

    def __init__(
        self, sender: pb_utils.InferenceResponseSender, return_latents: bool, metrics: StreamMetrics
    ) -> None:
        self.sender = sender
        self.return_latents = return_latents
        self.metrics = metrics
        self.arrival = time.perf_counter()
        self.last_block: float | None = None
        self.closed = False
        self._lock = threading.Lock()
        metrics.streams_open.increment(1)

    def send_block(self, output: BlockOutput, frames: np.ndarray, decode_ms: float, final: bool) -> None:
        now = time.perf_counter()
        since_arrival_ms = (now - self.arrival) * 1000.0
        latents = output.latents[0].numpy() if self.return_latents else None
        tensors = block_outputs(
            output.block_index, output.num_blocks, latents, frames, (output.dit_ms, decode_ms, since_arrival_ms)
        )
        response = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in tensors.items()])
        if self._send(response, FINAL if final else 0):
            m = self.metrics
            m.blocks.increment(1)
            m.block_dit.observe(output.dit_ms / 1000.0)
            if self.last_block is None:
                m.time_to_first_block.observe(now - self.arrival)
            else:
                m.inter_block.observe(now - self.last_block)
            self.last_block = now

    def send_error(self, message: str) -> None:
        if self._send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), FINAL):
            self.metrics.errors.increment(1)

    def finish(self) -> None:
        self._send(None, FINAL)

    def is_cancelled(self) -> bool:
        return self.closed or self.sender.is_cancelled()

    def _send(self, response: pb_utils.InferenceResponse | None, flags: int) -> bool:
        """Send unless the stream is closed; returns whether it was sent."""
        with self._lock:
            if self.closed:
                return False
            self.closed = bool(flags & FINAL)
            if response is None:
                self.sender.send(flags=flags)
            else:
                self.sender.send(response, flags=flags)
            if self.closed:
                self.metrics.streams_open.increment(-1)
            return True


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        if not log.handlers:
            log.addHandler(TritonLogHandler())
            log.setLevel(logging.INFO)
        model_config = json.loads(args["model_config"])
        self.model_name = args["model_name"]
        params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        engine_config, limits = split_parameters(params)
        rank, world = instance_rank(args, model_config)
        on_gpu = args["model_instance_kind"] == "GPU"
        device = f"cuda:{args['model_instance_device_id']}" if on_gpu else "cpu"
        engine_config = dataclasses.replace(engine_config, device=device)
        if engine_config.sp_degree != world:
            raise ConfigError(
                f"sp_degree={engine_config.sp_degree} must equal the number of model instances ({world})"
            )
        # Fail fast, alone, before waiting for peers or reading weights.
        validate_engine(engine_config, read_checkpoint_configs(engine_config.checkpoint), world)
        if on_gpu:
            torch.cuda.set_device(device)
            # On an NCCL timeout abort the communicators but keep the process, so the loop's next
            # collective raises and the failure path answers the streams (PyTorch's default, 3, kills it).
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        self.rank = rank
        self.metrics = StreamMetrics(self.model_name, rank)
        control = data = None
        if world > 1:
            backend = "nccl" if on_gpu else "gloo"
            init_process_group(rank, world, limits.rendezvous_host, limits.rendezvous_port, backend,
                               limits.init_timeout_s)
            # Block-time collectives get the short timeout: a dead or hung peer is detected in bounded time.
            timeout = datetime.timedelta(seconds=limits.collective_timeout_s)
            data = dist.new_group(backend=backend, timeout=timeout)
            control = dist.new_group(backend="gloo", timeout=timeout)
        log.info("rank %d/%d on %s: loading %s", rank, world, device, engine_config.checkpoint)
        self.engine = WorldModelEngine(
            engine_config, SequenceParallel(data), max_frames=limits.max_frames, max_pixels=limits.max_pixels
        )
        if world > 1:
            dist.barrier()  # every rank has loaded (under the long start-up timeout) before the loop starts
        self.coordinator = GroupCoordinator(self.engine, limits, control, on_failure=self._on_group_failure)
        log.info("rank %d/%d ready (attention: %s)", rank, world, self.engine.attention_name)

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                session_request = parse_request(functools.partial(_input, request), request.parameters())
            except InputError as exc:
                TritonResponder(sender, False, self.metrics).send_error(str(exc))
                continue
            responder = TritonResponder(sender, session_request.return_latents, self.metrics)
            self.coordinator.submit(session_request, responder)
        return None

    def finalize(self) -> None:
        self.coordinator.stop()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _on_group_failure(self, exc: BaseException) -> None:
        """In-flight streams already got their error; unload the model so Triton reports it not ready."""
        log.error("rank %d: sequence-parallel group failed (%r); unloading %s", self.rank, exc, self.model_name)
        try:
            pb_utils.unload_model(self.model_name)
        except Exception as unload_error:  # noqa: BLE001 - only explicit model control allows it
            log.error(
                "cannot unload %s (%s); without --model-control-mode=explicit the model keeps reading ready "
                "and refuses every request until the server restarts", self.model_name, unload_error,
            )


def _input(request: pb_utils.InferenceRequest, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()
