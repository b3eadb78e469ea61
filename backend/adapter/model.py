"""Triton Python-backend adapter: one instance per device joins the SP group and serves through it."""
from __future__ import annotations

import dataclasses
import contextlib
import ctypes
import functools
import gc
import json
import logging
import os
import socket

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from ..api.codec import parse_request
from ..api.errors import ConfigError, InputError
from ..api.request import StepRequest
from ..engine.rollout import WorldModelEngine
from ..engine.validation import checked_spec, describe_settings
from ..parallel.doorbell import StoreDoorbell
from ..parallel.group import join_group, leave_group
from ..parallel.layout import RankLayout
from ..parallel.mesh import Mesh
from ..parallel.secret import group_secret
from ..parallel.sequence import SequenceParallel
from ..serving.config import split_parameters
from ..serving.coordinator import GroupCoordinator
from ..serving.loop_cpu import LoopCpu
from ..serving.threads import CoreSplit, instance_cores
from .metrics import StreamMetrics
from .responder import TritonLogHandler, TritonResponder
from .placement import instance_rank

log = logging.getLogger("backend")


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        if not log.handlers:
            log.addHandler(TritonLogHandler())
            log.setLevel(logging.INFO)
        model_config = json.loads(args["model_config"])
        self.model_name = args["model_name"]
        params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        engine_config, serving = split_parameters(params)
        rank, world = instance_rank(args, model_config, serving.host_rank, serving.host_count)
        on_gpu = args["model_instance_kind"] == "GPU"
        device = f"cuda:{args['model_instance_device_id']}" if on_gpu else "cpu"
        engine_config = dataclasses.replace(engine_config, device=device)
        layout = RankLayout(engine_config.tp_degree, engine_config.sp_degree)
        if layout.world != world:
            raise ConfigError(
                f"tp_degree x sp_degree = {engine_config.tp_degree} x {engine_config.sp_degree} must equal the number "
                f"of model instances of all servers ({world} = host_count={serving.host_count} x "
                f"{world // serving.host_count})"
            )
        layout.check_hosts(serving.host_count)
        # Fail fast, alone, before waiting for peers or reading weights.
        spec = checked_spec(engine_config, world)
        threads = None
        if on_gpu:
            torch.cuda.set_device(device)
            # On an NCCL timeout abort the communicators but keep the process, so the loop's next
            # collective raises and the failure path answers the streams (PyTorch's default, 3, kills it).
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        else:
            cores = instance_cores(world // serving.host_count)  # this host's cores shared among its own instances
            torch.set_num_threads(cores)  # this thread's (loading); the loop and the decode sender set their own
            threads = CoreSplit.of(cores)
        self.rank = rank
        self.metrics = StreamMetrics(self.model_name, rank)
        self.metrics.show_settings(spec.settings)
        if rank == 0:
            log.info("checkpoint %s: %s layout", engine_config.checkpoint, spec.checkpoint.layout.kind.name)
            for line in describe_settings(spec):
                log.info("setting %s", line)
        secret = group_secret() if world > 1 else ""
        groups = join_group(rank, world, serving.rendezvous_host, serving.rendezvous_port, "nccl" if on_gpu else "gloo",
                            serving.init_timeout_s, serving.collective_timeout_s, secret, engine_config.split_decode)
        self.load_id, self.host_rank, self._unload_claim = groups.load_id, serving.host_rank, None
        self._finalizing = False
        log.info("rank %d/%d on %s: loading %s (RSS before: %s)", rank, world, device, engine_config.checkpoint,
                 _rss())
        group = SequenceParallel(groups.data)
        mesh = Mesh.build(group, engine_config.tp_degree, serving.collective_timeout_s)
        self.engine = WorldModelEngine(spec, group, mesh=mesh, decode_group=groups.decode)
        self.settings_used = self.engine.settings_used  # sent with a session's first block on return_used
        groups.all_arrived("loaded")  # every rank has loaded before the loop starts
        doorbell = StoreDoorbell(serving.rendezvous_host, serving.rendezvous_port, secret, serving.collective_timeout_s) \
            if world > 1 else None
        self.coordinator = GroupCoordinator(self.engine, serving, groups.control, on_failure=self._on_group_failure,
                                            doorbell=doorbell, threads=threads, cpu=LoopCpu(self.metrics.loop_block),
                                            on_prompts=self.metrics.prompts, on_ended=self.metrics.session_ended,
                                            send_lock=TritonResponder.process_lock)
        log.info("rank %d/%d ready (attention: %s; torch threads: %s)", rank, world, self.engine.attention_name,
                 f"DiT {threads.dit}, decode {threads.decode}" if threads else "as they are")

    def execute(self, requests: list) -> None:
        with TritonResponder.process_lock:  # no response is sent while the stub is in here (see responder)
            self._execute(requests)

    def _execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            key = str(request.correlation_id() or "")
            if key:  # a pause of this sequence is answered before this request (whatever it holds)
                self.coordinator.end_pause(key)
            try:
                parsed = parse_request(functools.partial(_input, request), request.parameters(), key, request.flags())
            except InputError as exc:
                TritonResponder(sender, False, self.metrics).send_error(str(exc))
                continue
            steered = isinstance(parsed, StepRequest) or parsed.steered
            used = self.settings_used if parsed.return_used else None
            self.coordinator.submit(parsed, TritonResponder(sender, parsed.return_latents, self.metrics, steered, used))
        return None

    def finalize(self) -> None:
        self._finalizing = True  # the model is being unloaded: a loop failing now must not unload a later load
        self.coordinator.stop()
        leave_group()
        self._drop_engine()

    def _drop_engine(self) -> None:
        self.engine = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        with contextlib.suppress(OSError, AttributeError):  # glibc keeps freed heap pages; give them back
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        log.info("rank %d: model released (RSS now %s)", self.rank, _rss())

    def _on_group_failure(self, exc: BaseException) -> None:
        """In-flight streams already got their error; leave the group and unload the model.

        Leaving now, not in finalize, matters when a peer that owned a stream died: Triton 2.51 keeps a
        model loaded while a dead stub's response factory lives (forever), so finalize never runs here,
        and a reload needs this rank's rendezvous port and sockets back.
        """
        leave_group()
        self._drop_engine()  # the weights and caches go now: finalize may never run (see above)
        if self._finalizing:
            log.error("rank %d: sequence-parallel group failed (%r) while the model unloads", self.rank, exc)
            return
        self._unload_claim = claim_for_this_host(f"lingbot-unload-{self.load_id}-{self.host_rank}")
        if self._unload_claim is None:  # another instance of this server asked: a second ask, landing after an
            # operator's prompt reload, would unload the new load
            log.error("rank %d: sequence-parallel group failed (%r); this server's model is being unloaded",
                      self.rank, exc)
            return
        log.error("rank %d: sequence-parallel group failed (%r); unloading %s", self.rank, exc, self.model_name)
        try:
            pb_utils.unload_model(self.model_name)
        except Exception as unload_error:  # noqa: BLE001 - only explicit model control allows it
            log.error(
                "cannot unload %s (%s); without --model-control-mode=explicit the model keeps reading ready "
                "and refuses every request until the server restarts", self.model_name, unload_error,
            )


def claim_for_this_host(name: str) -> socket.socket | None:
    """A claim that the first process of this host (network namespace) to ask holds until it exits: the name of
    an abstract unix socket, which the kernel frees with its process (nothing to clean up). None: held already."""
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        claim.bind("\0" + name)
    except OSError:
        claim.close()
        return None
    return claim


def _rss() -> str:
    """This process's resident memory, where /proc tells it."""
    try:
        pages = int(open("/proc/self/statm").read().split()[1])
    except (OSError, IndexError, ValueError):
        return "unknown"
    return f"{pages * os.sysconf('SC_PAGE_SIZE') / 2**20:.0f} MB"


def _input(request: pb_utils.InferenceRequest, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()
