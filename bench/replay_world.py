"""A stand-in for a steered session on Triton (client/steer.SteeredSession) that plays frames made beforehand: the
bridge's video measured without the model's work in the way (bench.delivery), and the tests of the bridge's video.

    python -m bench.replay_world --height 480 --width 832 --block-s 0.75 --url unused:1 --port 8080 ...

runs `python -m client serve` (the other arguments are its own) on such sessions: a clip of the panned test scene.

Each request is answered `block_s` after the answer before it (or after it was sent, if later): a start with 9
frames, each step with the next 12 of the clip (from its start again at its end), the camera moved by the step's
keys; an end without a step is answered with no block. Thread-safe as SteeredSession: the bridge steps from the
event loop and waits for blocks on its page's thread.
"""
from __future__ import annotations

import argparse
import threading
import time
from collections import deque

import numpy as np

from backend.api.codec import BlockResponse, BlockUsed
from backend.api.controls import integrate
from backend.api.request import Controls, SessionRequest
from client.stream import StreamTimeoutError

FIRST_FRAMES, STEP_FRAMES = 9, 12
SETTINGS = "block_frames=3;denoise_steps=4;dtype=float32;sink_frames=3;timestep_shift=5.0;window_frames=9"


def panned_scene(height: int, width: int, frames: int, step_px: int = 4) -> np.ndarray:
    """A clip [frames, height, width, 3]: the generated test scene seen by a camera turning right (its window slides
    `step_px` a frame over a scene wide enough for the whole clip)."""
    from client.images import synthetic_image

    scene = synthetic_image(height, width + step_px * frames)
    return np.stack([scene[:, i * step_px:i * step_px + width] for i in range(frames)])


class ReplaySession:
    """Built as SteeredSession is (its arguments ignored): ReplaySession.factory(clip, block_s) makes the factory."""

    def __init__(self, clip: np.ndarray, block_s: float) -> None:
        self.clip, self.block_s = clip, block_s
        self.answered_sent_s: float | None = None
        self.sent_s: list[float] = []
        self.steps: list[Controls] = []  # every step received, in order
        self._pending: deque[tuple[float, str | None]] = deque()  # (sent, keys) per request; keys None: an end alone
        self._ready = threading.Condition()
        self._due = 0.0
        self._frame = 0
        self._block = 0
        self._pose = np.eye(4)
        self._closed = False

    @classmethod
    def factory(cls, clip: np.ndarray, block_s: float, made: list[ReplaySession] | None = None):
        """A session_factory for PlayedWorld (or a stand-in for bridge.SteeredSession); `made` collects them."""
        def make(*args: object, **kwargs: object) -> ReplaySession:
            session = cls(clip, block_s)
            if made is not None:
                made.append(session)
            return session
        return make

    def start(self, request: SessionRequest) -> None:
        self._send(request.keys or "")

    def resume(self, snapshot_id: str, controls: Controls, fork_seed: int | None = None, **kwargs: object) -> None:
        self._send(controls.keys or "")

    def step(self, controls: Controls, end: bool = False, save: bool = False) -> None:
        self.steps.append(controls)
        self._send(controls.keys or "")

    def end(self) -> None:
        self._send(None)

    def _send(self, keys: str | None) -> None:
        with self._ready:
            now = time.perf_counter()
            self.sent_s.append(now)
            self._pending.append((now, keys))
            self._ready.notify_all()

    def waiting_since(self) -> float | None:
        with self._ready:
            return self._pending[0][0] if self._pending else None

    def next_block(self, timeout: float | None = None) -> BlockResponse | None:
        deadline = None if timeout is None else time.perf_counter() + timeout
        with self._ready:
            while not self._pending and not self._closed:
                if not self._ready.wait(None if deadline is None else max(0.0, deadline - time.perf_counter())):
                    raise StreamTimeoutError(f"no step within {timeout:g} s")
            if self._closed:
                return None
            sent, keys = self._pending[0]
        self._due = max(self._due + self.block_s, sent + self.block_s)
        time.sleep(max(0.0, self._due - time.perf_counter()))
        with self._ready:
            self._pending.popleft()
        self.answered_sent_s = sent
        if keys is None:
            return None
        count = FIRST_FRAMES if self._block == 0 else STEP_FRAMES
        index = [(self._frame + i) % len(self.clip) for i in range(count)]
        self._frame += count
        camera = integrate(self._pose, keys or "-", count)
        self._pose = camera[-1]
        block = BlockResponse(self._block, 0, None, self.clip[index], (), time.perf_counter(), False,
                              BlockUsed(camera, "a replayed clip", f"{self._block:064x}",
                                        SETTINGS if self._block == 0 else None))
        self._block += 1
        return block

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify_all()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="python -m client serve on replayed worlds (the clip made once)")
    parser.add_argument("--height", type=int, required=True)
    parser.add_argument("--width", type=int, required=True)
    parser.add_argument("--block-s", type=float, required=True, help="a block's time (0.75: 12 frames at 16 fps)")
    parser.add_argument("--clip-frames", type=int, default=96)
    args, serve_args = parser.parse_known_args(argv)
    from client.web import bridge, serve

    bridge.SteeredSession = ReplaySession.factory(panned_scene(args.height, args.width, args.clip_frames), args.block_s)
    return serve.main(serve_args)


if __name__ == "__main__":
    raise SystemExit(main())
