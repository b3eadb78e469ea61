"""Serving limits and group settings (config.pbtxt `parameters` beside the engine's; torch-free)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..api.contract import MAX_INPUT_PIXELS
from ..api.errors import ConfigError, InputError
from ..api.request import SessionRequest
from ..api.settings import from_parameters, parameter_fields
from ..engine.config import EngineConfig


@dataclass(frozen=True)
class ServingConfig:
    """Limits and group settings of the Triton model (config.pbtxt `parameters` beside the engine's)."""

    max_frames: int = 321  # video frames per request
    max_pixels: int = 1280 * 1280  # height x width per request
    max_input_pixels: int = MAX_INPUT_PIXELS  # the first-frame image's own height x width, before it is resized
    max_sessions: int = 4  # sessions generating at once (each holds a KV cache)
    max_queue: int = 16  # sessions waiting for a slot; more are rejected
    max_batch: int = 4  # sessions of one geometry run in one forward
    max_blocks_ahead: int = 2  # blocks a session may be computed ahead of what its client was sent
    host_rank: int = 0  # this server's place among the servers of one group (one per host under mpirun)
    host_count: int = 1  # servers in the group; each runs the same number of instances
    rendezvous_host: str = "127.0.0.1"  # where global rank 0 hosts the TCP store (its host's address)
    rendezvous_port: int = 29650  # the TCP store's port on rendezvous_host (global rank 0)
    init_timeout_s: float = 1800.0  # rendezvous and weight loading
    collective_timeout_s: float = 120.0  # a rank silent this long is declared failed
    session_idle_timeout_s: float = 60.0  # a steered session without a step this long is ended
    max_session_s: float = 3600.0  # a steered session is ended after this long in all
    sequence_slots: int = 4096  # Triton sequences held at once (a refused or abandoned start holds one a while)

    def __post_init__(self) -> None:
        if not 0 <= self.host_rank < self.host_count:
            raise ConfigError(f"host_rank={self.host_rank} must be in [0, host_count={self.host_count})")

    def check_limits(self, request: SessionRequest) -> None:
        """The request's size against the serving limits; raises InputError naming the input. The image is
        judged by its shape alone, before anything copies or resizes it."""
        image_h, image_w = request.image.shape[:2] if request.image.ndim >= 2 else (1, request.image.size)
        if image_h * image_w > self.max_input_pixels:
            raise InputError(f"image is {image_h} x {image_w} pixels, more than max_input_pixels="
                             f"{self.max_input_pixels}; send a smaller picture")
        if request.num_frames is not None and not 1 <= request.num_frames <= self.max_frames:
            raise InputError(f"num_frames={request.num_frames} must be between 1 and max_frames={self.max_frames}")
        if request.height * request.width > self.max_pixels:
            raise InputError(
                f"width x height = {request.width} x {request.height} = {request.width * request.height} pixels "
                f"is more than max_pixels={self.max_pixels}"
            )


def split_parameters(params: Mapping[str, str]) -> tuple[EngineConfig, ServingConfig]:
    """The engine's and the serving layer's settings from one set of config.pbtxt parameters."""
    serving_names = {f.name for f in parameter_fields(ServingConfig)}
    serving = {k: v for k, v in params.items() if k in serving_names}
    engine = {k: v for k, v in params.items() if k not in serving_names}
    return from_parameters(EngineConfig, engine), from_parameters(ServingConfig, serving)
