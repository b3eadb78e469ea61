"""The owner's index of its steered sessions by their Triton sequence: which session a sequence's steps go to, and
how the last KEEP_ENDED sequences' sessions ended, so a late step is told why. The intake's thread's alone."""
from __future__ import annotations

from collections import OrderedDict

from ..api.refusal import Refusal
from . import messages

KEEP_ENDED = 1024  # sequences whose session ended, remembered to tell a late step why


class Sequences:
    def __init__(self) -> None:
        self._steering: dict[str, str] = {}  # Triton sequence id -> the steered session that takes its steps
        self._ended: OrderedDict[str, Refusal] = OrderedDict()  # sequence id -> what a late step of it is told

    def session_of(self, sequence: str) -> str | None:
        """The session whose steps sequence `sequence` carries, if one runs."""
        return self._steering.get(sequence)

    def start(self, sequence: str, session_id: str) -> None:
        self._steering[sequence] = session_id

    def end(self, sequence: str | None, session_id: str, ending: Refusal) -> None:
        """The sequence no longer steers session `session_id` (if it still did); a late request is told `ending`,
        for as long as the sequence is among the last KEEP_ENDED to end. None: a whole trajectory's (no sequence)."""
        if sequence is None:
            return
        if self._steering.get(sequence) == session_id:
            del self._steering[sequence]
        self._ended[sequence] = ending
        self._ended.move_to_end(sequence)
        while len(self._ended) > KEEP_ENDED:
            self._ended.popitem(last=False)

    def ending_of(self, sequence: str) -> Refusal:
        """How the last session of a sequence that steers none ended (or that none began)."""
        return self._ended.get(sequence, messages.NEVER_STARTED)
