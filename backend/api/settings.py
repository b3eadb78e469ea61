"""Settings dataclasses <-> the string key/values of config.pbtxt `parameters` (torch-free).

A field marked `runtime_field()` is set by the process (the device, say), not by a parameter.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from .errors import ConfigError

T = TypeVar("T")


def runtime_field(default: Any) -> Any:
    return dataclasses.field(default=default, metadata={"runtime": True})


def parameter_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of a settings dataclass that config.pbtxt sets."""
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("runtime")]


def format_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def to_parameters(settings: Any) -> dict[str, str]:
    """Every parameter of a settings dataclass as config.pbtxt strings (`from_parameters` reads them back)."""
    return {f.name: format_value(getattr(settings, f.name)) for f in parameter_fields(type(settings))}


def from_parameters(cls: type[T], params: Mapping[str, str]) -> T:
    """Build a settings dataclass from string key/values; unknown keys and bad values name themselves."""
    fields = {f.name: f for f in parameter_fields(cls)}
    unknown = sorted(set(params) - set(fields))
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} parameter(s) {unknown}; known: {sorted(fields)}")
    values: dict[str, Any] = {}
    for name, raw in params.items():
        kind = fields[name].type
        try:
            values[name] = parse_value(raw, kind)
        except ValueError as exc:
            raise ConfigError(f"parameter {name}={raw!r}: expected {kind}") from exc
    try:
        return cls(**values)
    except TypeError as exc:
        raise ConfigError(f"{cls.__name__}: {exc}") from exc


def parse_value(raw: str, kind: str) -> Any:
    if kind == "int":
        return int(raw)
    if kind == "float":
        return float(raw)
    if kind == "bool":
        lowered = raw.strip().lower()
        if lowered not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(raw)
        return lowered in ("true", "1", "yes")
    return raw
