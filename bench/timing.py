"""Marks on the device's timeline: CUDA events on a GPU, wall time on CPU, through one code path."""
from __future__ import annotations

import time
from types import TracebackType

import torch

Mark = torch.cuda.Event | float


class Clock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Mark:
        """Now on the current stream (a recorded CUDA event), or the wall clock on CPU."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start: Mark, end: Mark) -> float:
        """Milliseconds between two marks; on CUDA both events must have completed (synchronize first)."""
        if self.cuda:
            return start.elapsed_time(end)
        return (end - start) * 1000.0


class ForwardTimer:
    """Times each call of a module through forward pre/post hooks: the timed code is left unchanged."""

    def __init__(self, module: torch.nn.Module, clock: Clock) -> None:
        self.clock = clock
        self._marks: list[list[Mark]] = []
        self._hooks = [
            module.register_forward_pre_hook(lambda _m, _a: self._marks.append([clock.mark()])),
            module.register_forward_hook(lambda _m, _a, _o: self._marks[-1].append(clock.mark())),
        ]

    def take(self) -> list[float]:
        """Milliseconds of each forward since the last take (the device must have finished them)."""
        ms = [self.clock.ms(start, end) for start, end in self._marks]
        self._marks.clear()
        return ms

    def __enter__(self) -> ForwardTimer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for hook in self._hooks:
            hook.remove()


