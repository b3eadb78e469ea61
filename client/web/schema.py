"""What a page may send the bridge: each message checked against one table before anything acts on it.

A message that does not fit gets a ValueError in plain words (the bridge sends it to the page, code INVALID_MESSAGE,
and closes).
"""
from __future__ import annotations

import json
from typing import Any

MAX_MESSAGE_BYTES = 24 << 20  # a start message carries the first frame as a data URL
# sdp: bounded here by the message only; client/web/rtc.read_offer refuses a long one with its own code
MAX_TEXT = {"prompt": 4000, "keys": 64, "image": MAX_MESSAGE_BYTES, "resume": 32, "sdp": MAX_MESSAGE_BYTES}
INT_RANGE = {"height": (1, 1 << 16), "width": (1, 1 << 16), "seed": (-(1 << 63), (1 << 63) - 1)}

# type -> its fields and their JSON types (every field optional; start_request says what a start needs)
MESSAGES: dict[str, dict[str, type]] = {
    # resume: a saved world's snapshot id (the page's ?resume=ID), instead of a prompt and a first frame
    "start": {"prompt": str, "image": str, "height": int, "width": int, "seed": int, "keys": str, "resume": str},
    "keys": {"keys": str},
    "event": {"prompt": str, "recache": bool},  # a prompt event: the prompt from the next step's block on
    "save": {},  # save the world after the next step's block ("Save world")
    "stop": {},
    "offer": {"sdp": str},  # the page's WebRTC offer: the world's video (client/web/rtc.py checks it)
    "jpeg": {},  # the page's WebRTC failed: the world's frames come as JPEG on the websocket
    "watch": {},  # a watch link to the world (client/web/watch.py)
    "revoke": {},  # revoke it: its watchers' streams end
}
# What the page's data channel may carry (the rest goes on its websocket).
CHANNEL_MESSAGES = ("keys", "event", "save", "stop")


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def parse_message(text: str) -> dict[str, Any]:
    """A page's text message as a dict that fits MESSAGES; ValueError naming what does not."""
    try:
        message = json.loads(text, parse_constant=_no_constants)
    except (ValueError, RecursionError):
        raise ValueError("the bridge received a message that is not JSON") from None
    if not isinstance(message, dict):
        raise ValueError(f"a message must be a JSON object, not {type(message).__name__}")
    kind = message.get("type")
    if not isinstance(kind, str) or kind not in MESSAGES:
        raise ValueError(f"unknown message type {kind!r}; expected one of {sorted(MESSAGES)}")
    fields = MESSAGES[kind]
    unknown = sorted(set(message) - {"type"} - set(fields))
    if unknown:
        raise ValueError(f"unknown field(s) {unknown} in a {kind!r} message")
    for name, value in message.items():
        if name == "type" or value is None:
            continue
        expected = fields[name]
        if expected is bool:
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false")
        elif expected is int:
            low, high = INT_RANGE[name]
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name} must be a whole number between {low} and {high}")
        elif not isinstance(value, expected):
            raise ValueError(f"{name} must be a {'string' if expected is str else expected.__name__}")
        elif isinstance(value, str) and len(value) > MAX_TEXT[name]:
            raise ValueError(f"{name} is longer than {MAX_TEXT[name]} characters")
    return message
