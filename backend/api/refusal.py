"""A refusal or an ending as its client reads it: a code from the contract's table, a sentence, and for some
codes a retry time. On the wire it is a Triton error's text, `[CODE] sentence` or `[CODE retry_after_s=N]
sentence`, so every gRPC client (perf_analyzer's too) reads it as an error and a program reads its code."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .contract import ERROR_CODE_SPECS, INVALID_INPUT

_WIRE = re.compile(r"^\[([A-Z_]+)(?: retry_after_s=(\d+))?\] (.*)$", re.DOTALL)


@dataclass(frozen=True)
class Refusal:
    code: str  # a name of contract.ERROR_CODES
    sentence: str
    retry_after_s: float | None = None  # only for codes that declare retry_after

    def __post_init__(self) -> None:
        spec = ERROR_CODE_SPECS.get(self.code)
        if spec is None:
            raise ValueError(f"unknown error code {self.code!r}")
        if (self.retry_after_s is not None) != spec.retry_after:
            raise ValueError(f"error code {self.code} {'needs' if spec.retry_after else 'takes no'} retry_after_s")

    @property
    def message(self) -> str:
        """The wire text (a whole number of seconds, at least 1)."""
        retry = "" if self.retry_after_s is None else f" retry_after_s={max(1, math.ceil(self.retry_after_s))}"
        return f"[{self.code}{retry}] {self.sentence}"

    def __str__(self) -> str:
        return self.message

    @classmethod
    def parse(cls, message: str) -> Refusal | None:
        """The refusal in an error text (Triton may add its own words around it); None: not one of ours."""
        start = message.find("[")
        match = _WIRE.match(message[start:]) if start >= 0 else None
        if match is None or match.group(1) not in ERROR_CODE_SPECS:
            return None
        code, retry, sentence = match.groups()
        try:
            return cls(code, sentence, None if retry is None else float(retry))
        except ValueError:  # a code with the wrong retry part: not ours
            return None


def invalid(sentence: str) -> Refusal:
    return Refusal(INVALID_INPUT, sentence)
