"""A server's description (api/description) from the settings it resolved: what the launcher writes into
config.pbtxt, and what every instance checks at load."""
from __future__ import annotations

from ..api.description import ServerDescription
from ..api.errors import ConfigError
from ..api.provenance import settings_of
from ..engine.validation import EngineSpec
from .settings import ServingSettings


def describe(spec: EngineSpec, serving: ServingSettings) -> ServerDescription:
    settings = spec.settings
    return ServerDescription(
        layout=spec.checkpoint.layout.kind.name, block_frames=settings.block_frames,
        settings_used=settings_of(settings),
        max_frames=serving.max_frames, max_pixels=serving.max_pixels, max_input_pixels=serving.max_input_pixels,
        max_sessions=serving.max_sessions, max_queue=serving.max_queue, default_height=settings.default_height,
        default_width=settings.default_width,
    )


def check_description(written: ServerDescription | None, spec: EngineSpec, serving: ServingSettings) -> None:
    """A model config's description against what this instance resolved; ConfigError names each difference."""
    if written is None:
        return
    if differ := written.differences(describe(spec, serving)):
        raise ConfigError(f"config.pbtxt's description differs from what this instance resolved (described != "
                          f"resolved): {'; '.join(differ)}; rewrite it with the launcher")
