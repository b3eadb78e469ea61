"""What a block was made from, as the server reports it (request parameter `return_used`) and a recording keeps.

`settings_used`: the server settings that change the latents or the frames (`decoder`), as `key=value` pairs
joined by ";" in name order.
A replay sends them back as `expect_settings`, and a server whose own differ refuses the request before any
work, naming each difference. `latents_sha256`: the SHA-256 of a block's float32 latents in C order, which the
server computes on the owner and a client can check against the latents it received.
"""
from __future__ import annotations

import hashlib

import numpy as np

from .errors import InputError

# The engine settings a block's latents or frames depend on (besides the request's own inputs). tp_degree, compile,
# the attention kernel and cpu_vae_kernels change the last bits too; they are not refused but show as hash mismatches
# (docs/replay.md).
RESULT_SETTINGS = ("block_frames", "decoder", "denoise_steps", "dtype", "kv_reuse", "sink_frames", "timestep_shift",
                   "window_frames")
# Settings a recording's text may lack (one made by a server that did not report them), each with the value such a
# server ran: a text without one was made with it.
ADDED_SETTINGS = {"decoder": "vae", "kv_reuse": "False"}
MAX_SETTINGS_BYTES = 512


def settings_of(settings: object) -> str:
    """The settings_used of an engine's settings (any object with the RESULT_SETTINGS as attributes)."""
    return format_settings({name: getattr(settings, name) for name in RESULT_SETTINGS})


def format_settings(values: dict[str, object]) -> str:
    """`key=value;...` of the RESULT_SETTINGS in `values` (every one must be there)."""
    missing = [name for name in RESULT_SETTINGS if name not in values]
    if missing:
        raise ValueError(f"settings lack {missing}")
    return ";".join(f"{name}={values[name]}" for name in RESULT_SETTINGS)


def parse_settings(text: str, name: str = "expect_settings") -> dict[str, str]:
    """The pairs of a `format_settings` text (in RESULT_SETTINGS order; an ADDED_SETTINGS key it lacks takes its
    earlier value); InputError names a malformed, unknown, repeated or missing key."""
    if len(text.encode("utf-8")) > MAX_SETTINGS_BYTES:
        raise InputError(f"{name} is longer than {MAX_SETTINGS_BYTES} bytes")
    pairs: dict[str, str] = {}
    for item in text.split(";"):
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise InputError(f"{name}: {item!r} is not key=value (expected e.g. {RESULT_SETTINGS[0]}=3)")
        if key not in RESULT_SETTINGS:
            raise InputError(f"{name}: unknown setting {key!r}; settings: {list(RESULT_SETTINGS)}")
        if key in pairs:
            raise InputError(f"{name}: {key!r} given twice")
        pairs[key] = value
    for key, value in ADDED_SETTINGS.items():
        pairs.setdefault(key, value)  # a text from before the setting existed
    if missing := [k for k in RESULT_SETTINGS if k not in pairs]:
        raise InputError(f"{name} lacks {missing}")
    return {key: pairs[key] for key in RESULT_SETTINGS}


def setting_differences(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    """`name: expected X, this server Y` for every setting that differs."""
    return [f"{k}: expected {expected[k]}, this server {actual[k]}" for k in RESULT_SETTINGS if expected[k] != actual[k]]


def latents_sha256(latents: np.ndarray) -> str:
    """The hex SHA-256 of a block's latents as float32 in C order."""
    return hashlib.sha256(np.ascontiguousarray(latents, dtype=np.float32).tobytes()).hexdigest()
