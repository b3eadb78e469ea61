"""Which of the steps a player sent each block ran on, as the server used them, and the block's label.

The server takes a steered session's steps in order, one a block; a held block (its step came late, on_starve
hold) takes none and repeats the last motion, so the step a player sent for block k may run at block k + 1.
A label from what was sent would shift from the first held block on; this one follows the server's held flag
and its prompt_used.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from backend.api.codec import BlockResponse
from backend.api.request import Controls


@dataclass(frozen=True)
class BlockLabel:
    keys: str  # the held keys it ran on ("poses" for a pose step, "held" for a held block)
    prompt: str  # the prompt in force, as the server used it
    event: bool  # the prompt changed at this block (a prompt event took hold)
    held: bool


class UsedSteps:
    """Feed it every step sent (the first request's camera first), then each block as it arrives."""

    def __init__(self, first: Controls, prompt: str | None) -> None:
        """prompt: the session's first (None: not known, a resumed world's: its first block says it)."""
        self._unused: deque[Controls] = deque([first])
        self._prompt = prompt

    def sent(self, controls: Controls) -> None:
        self._unused.append(controls)

    def label(self, block: BlockResponse) -> BlockLabel:
        """The block's label; its prompt is the server's prompt_used when the block carries it (return_used)."""
        step = None if block.held or not self._unused else self._unused.popleft()
        prompt = block.used.prompt if block.used is not None else \
            (step.prompt if step is not None and step.prompt is not None else self._prompt)
        # A resumed world's prompt before its first block is not known: an event there is its step's.
        changed = prompt != self._prompt if self._prompt is not None else step is not None and step.prompt is not None
        event, self._prompt = changed, prompt
        keys = "held" if step is None else "poses" if step.keys is None else step.keys or "-"
        return BlockLabel(keys, prompt, event, block.held)
