"""The layouts a checkpoint may be in, and which one a directory holds (from its files alone)."""
from __future__ import annotations

from pathlib import Path

from ..api.errors import ConfigError
from .layout import PARTS, CheckpointLayout, Layout
from .layout_diffusers import DIFFUSERS
from .layout_official import OFFICIAL

LAYOUTS: tuple[Layout, ...] = (OFFICIAL, DIFFUSERS)


def resolve_layout(checkpoint: str) -> CheckpointLayout:
    """Detect the layout from the files; a directory with part of one layout is refused, naming what it lacks."""
    root = Path(checkpoint)
    if not root.is_dir():
        raise ConfigError(f"checkpoint directory {root} does not exist")
    missing = {k.name: sorted(p for p in k.parts.values() if not (root / p).exists()) for k in LAYOUTS}
    complete = [k for k in LAYOUTS if not missing[k.name]]
    if len(complete) > 1:
        raise ConfigError(f"checkpoint {root} holds both the {complete[0].name} and the {complete[1].name} layout; "
                          "point it at one")
    if not complete:
        kind = min(LAYOUTS, key=lambda k: len(missing[k.name]) / len(k.parts))
        if len(missing[kind.name]) == len(kind.parts):
            raise ConfigError(f"checkpoint {root} holds neither layout: {each_layouts_parts()}")
        present = sorted(set(kind.parts.values()) - set(missing[kind.name]))
        raise ConfigError(f"checkpoint {root} is a partial {kind.name} layout (has {present}): missing {missing[kind.name]}")
    kind = complete[0]
    return CheckpointLayout(kind, root, *(root / kind.parts[part] for part in PARTS))


def each_layouts_parts() -> str:
    """'the official download has [...], the diffusers one [...]'"""
    first, *others = LAYOUTS
    return ", ".join([f"the {first.name} download has {sorted(first.parts.values())}",
                      *(f"the {k.name} one {sorted(k.parts.values())}" for k in others)])
