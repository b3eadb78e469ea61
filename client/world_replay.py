"""A played world's replay check: the blocks made again after a resume against those received (client/world.py)."""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from backend.api.codec import BlockResponse, BlockUsed
from client.stream import StreamError
from client.world_failover import WorldLostError


class ReplayCheck:
    """After a resume, the hashes expected of the blocks made again (their latents' SHA-256, in order), each
    checked against the block made. strict: a difference loses the world (WorldLostError); else the block made
    again is the world's from then on and the difference is counted (a failover's `differed`)."""

    def __init__(self, strict: bool) -> None:
        self.strict = strict
        self._expect: deque[str] = deque()

    def expect(self, hashes: Iterable[str]) -> None:
        """A new session: the hashes of the blocks it makes again (none: every block it makes is new)."""
        self._expect = deque(hashes)

    @property
    def pending(self) -> bool:
        """The next block is one made again."""
        return bool(self._expect)

    def check(self, block: BlockResponse) -> str | None:
        """A block made again: None when it is bit for bit the one received, else its hash (not strict)."""
        want, got = self._expect.popleft(), latents_sha256(block)
        if got == want:
            return None
        if self.strict:
            raise WorldLostError(f"block {block.block_index} made again after the resume differs from the one "
                                 f"received (latents {got[:16]}... against {want[:16]}...)")
        return got


def used(block: BlockResponse) -> BlockUsed:
    """What the block was made from (the world asks for it with return_used)."""
    if block.used is None:
        raise StreamError(f"block {block.block_index} came without what it was made from (return_used)")
    return block.used


def latents_sha256(block: BlockResponse) -> str:
    return used(block).latents_sha256
