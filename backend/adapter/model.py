"""Triton Python-backend adapter: one instance per device is one member of the serving group (serving/bootstrap)."""
from __future__ import annotations

import functools
import json
import logging

import numpy as np
import triton_python_backend_utils as pb_utils

from ..api.description import split_description
from ..api.refusal import Refusal
from ..api.request import SavesRequest, SessionRequest, StepRequest
from ..parallel.host_claim import claim_for_this_host
from ..serving.books import BooksAddress
from ..serving.bootstrap import GroupMember, Hooks, Location
from ..serving.settings import split_parameters
from ..serving.host_signals import HostSignals, StopWatch
from ..serving.key_watch import KeyWatch, gate_of
from ..serving.waits import QueueCounts
from ..serving.parent_watch import watch_parent
from .metrics import ParkMetrics, StreamMetrics
from .placement import instance_rank
from .responder import TritonLogHandler, TritonResponder

log = logging.getLogger("backend")


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        if not log.handlers:
            log.addHandler(TritonLogHandler())
            log.setLevel(logging.INFO)
        watch_parent()  # a stub whose tritonserver died outright ends too (serving/parent_watch)
        model_config = json.loads(args["model_config"])
        self.model_name = args["model_name"]
        params = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        description, params = split_description(params)
        engine_settings, serving = split_parameters(params)
        rank, ranks = instance_rank(args, model_config, serving.host_rank, serving.host_count)
        on_gpu = args["model_instance_kind"] == "GPU"
        location = Location(rank, ranks, f"cuda:{args['model_instance_device_id']}" if on_gpu else "cpu",
                            ranks // serving.host_count)
        self.rank, self.host_rank, self._unload_claim = rank, serving.host_rank, None
        self.metrics = StreamMetrics(self.model_name, rank)
        self.park_metrics = ParkMetrics({"model": self.model_name, "rank": str(rank)})
        self.metrics.queue(QueueCounts(0, 0, 0, 0, serving.max_sessions))  # Triton keeps a family's values: a reload
        # starts from an empty group
        self.member = GroupMember(engine_settings, serving, location, Hooks(
            on_failure=self._on_group_failure, on_settings=self.metrics.show_settings,
            on_prompts=self.metrics.prompts, on_ended=self.metrics.session_ended,
            on_loop_block=self.metrics.loop_block, on_queue=self.metrics.queue, on_snapshot=self.metrics.snapshot,
            on_request=self.metrics.key_request, on_park=self.park_metrics.parks,
            on_parked_bytes=self.park_metrics.held, on_unpark=self.park_metrics.unparked,
        ), description, BooksAddress.from_environment())
        # The launcher's signals (serving/host_signals): a stop ends every session at once, so Triton's exit need
        # not wait out its timeout for them; a failed group asks the launcher for a reload.
        self.signals = HostSignals.from_environment()
        self._stop_watch = (StopWatch(self.signals, self.member.end_sessions, self._drain) if self.signals
                            else None)
        # The door (serving/keys): the launcher's keys file, reloaded whenever the launcher publishes it again.
        self.gate = gate_of(self.signals)
        self._key_watch = (KeyWatch(self.signals, self.gate, self.member.revoke) if self.gate.ring is not None
                           else None)

    def execute(self, requests: list) -> None:
        with TritonResponder.process_lock:  # no response is sent while the stub is in here (see responder)
            for request in requests:
                sender = request.get_response_sender()
                who, parameters = self.gate.admit(request.parameters())  # the key is checked and stripped first
                if isinstance(who, Refusal):  # before any work: no input is read, the group never hears of it
                    self.member.refuse(self._responder(sender, "", None), who)
                    continue
                self.member.handle(functools.partial(_input, request), parameters,
                                   str(request.correlation_id() or ""), request.flags(),
                                   functools.partial(self._responder, sender, who.name), who)
        return None

    def _responder(self, sender: pb_utils.InferenceResponseSender, user: str,
                   parsed: SessionRequest | StepRequest | SavesRequest | None) -> TritonResponder:
        """user: the request's key name ("" without keys), for the metrics by key."""
        if parsed is None or isinstance(parsed, SavesRequest):
            return TritonResponder(sender, False, self.metrics, user=user)
        steered = isinstance(parsed, StepRequest) or parsed.steered
        used = self.member.settings_used if parsed.return_used else None
        return TritonResponder(sender, parsed.return_latents, self.metrics, steered, used, user)

    def _drain(self) -> None:
        self.metrics.drains.increment(1)
        self.member.drain()

    def finalize(self) -> None:
        for watch in (self._stop_watch, self._key_watch):
            if watch is not None:
                watch.close()
        self.member.stop()

    def _on_group_failure(self, exc: BaseException) -> None:
        """The group failed: ask the launcher for a reload (it waits for the unload, see launch/heal.py) and
        Triton to unload the model so that it reads not ready meanwhile (the member then leaves the group and
        frees the model at once, not in finalize: Triton 2.51 keeps a model loaded while a dead stub's response
        factory lives, forever, so finalize may never run here, and a reload needs this rank's rendezvous port and
        sockets back)."""
        self._unload_claim = claim_for_this_host(f"lingbot-unload-{self.member.load_id}-{self.host_rank}")
        if self._unload_claim is None:  # another instance of this server asked: a second ask, landing after an
            # operator's prompt reload, would unload the new load
            log.error("rank %d: sequence-parallel group failed (%r); this server's model is being unloaded",
                      self.rank, exc)
            return
        log.error("rank %d: sequence-parallel group failed (%r); unloading %s", self.rank, exc, self.model_name)
        if self.signals is not None:
            self.signals.ask_heal(f"rank {self.rank}: {exc!r}")
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
