"""What a client needs to know of a server, read from the model's config (`get_model_config`): the checkpoint's
layout, its block size and so the valid frame counts, the size limits and the slots. The launcher writes it into
config.pbtxt `parameters` (keys `described_*`) from the settings it resolved; every instance checks them against
its own at load and refuses to load on a difference, so a loaded model's description is what it runs.
Torch-free: the client reads it."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from . import contract
from .errors import ConfigError

PREFIX = "described_"
DEFAULT_VIDEO_FRAMES = 81  # a whole trajectory's default length: the largest whole-block count of frames up to it


@dataclass(frozen=True)
class ServerDescription:
    layout: str  # the checkpoint's layout: official or diffusers
    block_frames: int  # latent frames per AR block (3: diffusers, 4: the official script)
    settings_used: str  # what the latents depend on (api/provenance): equal on every group of one deployment
    max_frames: int
    max_pixels: int
    max_input_pixels: int
    max_sessions: int
    max_queue: int
    default_height: int
    default_width: int

    def parameters(self) -> dict[str, str]:
        """As config.pbtxt parameters."""
        return {PREFIX + f.name: str(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> ServerDescription | None:
        """The description among a model config's parameters; None when it has none (a config not written by
        the launcher). Raises ConfigError naming a missing or malformed entry."""
        if not any(k.startswith(PREFIX) for k in params):
            return None
        values = {}
        for f in dataclasses.fields(cls):
            key = PREFIX + f.name
            if key not in params:
                raise ConfigError(f"model config parameter {key!r} is missing (the launcher writes every one)")
            try:
                values[f.name] = int(params[key]) if f.type == "int" else str(params[key])
            except ValueError:
                raise ConfigError(f"model config parameter {key!r} must be a whole number; got "
                                  f"{params[key]!r}") from None
        return cls(**values)

    @property
    def first_block_frames(self) -> int:
        return contract.block_video_frames(self.block_frames, first=True)

    @property
    def step_frames(self) -> int:
        return contract.block_video_frames(self.block_frames, first=False)

    @staticmethod
    def whole_frames_up_to(frames: int, block_frames: int) -> int:
        """The most video frames of whole AR blocks up to `frames` (one block at least)."""
        step = contract.VAE_TEMPORAL_FACTOR * block_frames  # a block's frames; the first has 3 fewer
        blocks = max(1, (frames + contract.VAE_TEMPORAL_FACTOR - 1) // step)
        return contract.whole_block_frames(blocks, block_frames)

    def differences(self, other: ServerDescription) -> list[str]:
        """`name: this != other` for each entry that differs."""
        return [f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}" for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(other, f.name)]


def split_description(params: Mapping[str, str]) -> tuple[ServerDescription | None, dict[str, str]]:
    """(the description, the other parameters: the engine's and the serving layer's)."""
    return ServerDescription.from_parameters(params), {k: v for k, v in params.items() if not k.startswith(PREFIX)}
