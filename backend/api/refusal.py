"""A refusal or an ending as its client reads it: a code from the contract's table, a sentence, and for some
codes a retry time or the id of the snapshot the session was saved in. On the wire it is a Triton error's text,
`[CODE] sentence`, `[CODE retry_after_s=N] sentence` or `[CODE snapshot_id=ID] sentence`, so every gRPC client
(perf_analyzer's too) reads it as an error and a program reads its code."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .contract import ERROR_CODE_SPECS, INVALID_INPUT, SNAPSHOT_ID_PATTERN

_WIRE = re.compile(rf"^\[([A-Z_]+)(?: retry_after_s=(\d+))?(?: snapshot_id=({SNAPSHOT_ID_PATTERN}))?\] (.*)$",
                   re.DOTALL)


@dataclass(frozen=True)
class Refusal:
    code: str  # a name of contract.ERROR_CODES
    sentence: str
    retry_after_s: float | None = None  # only for codes that declare retry_after
    snapshot_id: str | None = None  # only for codes that declare snapshot

    def __post_init__(self) -> None:
        spec = ERROR_CODE_SPECS.get(self.code)
        if spec is None:
            raise ValueError(f"unknown error code {self.code!r}")
        if (self.retry_after_s is not None) != spec.retry_after:
            raise ValueError(f"error code {self.code} {'needs' if spec.retry_after else 'takes no'} retry_after_s")
        if (self.snapshot_id is not None) != spec.snapshot:
            raise ValueError(f"error code {self.code} {'needs' if spec.snapshot else 'takes no'} snapshot_id")

    @property
    def message(self) -> str:
        """The wire text (a whole number of seconds, at least 1)."""
        retry = "" if self.retry_after_s is None else f" retry_after_s={max(1, math.ceil(self.retry_after_s))}"
        saved = "" if self.snapshot_id is None else f" snapshot_id={self.snapshot_id}"
        return f"[{self.code}{retry}{saved}] {self.sentence}"

    def __str__(self) -> str:
        return self.message

    @classmethod
    def parse(cls, message: str) -> Refusal | None:
        """The refusal in an error text (Triton may add its own words around it); None: not one of ours."""
        start = message.find("[")
        match = _WIRE.match(message[start:]) if start >= 0 else None
        if match is None or match.group(1) not in ERROR_CODE_SPECS:
            return None
        code, retry, saved, sentence = match.groups()
        try:
            return cls(code, sentence, None if retry is None else float(retry), saved)
        except ValueError:  # a code with the wrong retry part: not ours
            return None


def invalid(sentence: str) -> Refusal:
    return Refusal(INVALID_INPUT, sentence)
