"""A world's video for its viewers over WebRTC (the page's own peer connection and its watchers'): one encode per
codec in use, normally one (H.264), whatever the number of viewers; each viewer's sender packetizes the same packets.

Frames come in a block at a time (`push`) and go out at 16 fps, paced by the broadcast's clock; a frame's RTP
timestamp is the moment it goes out: 1/16 s after the one before while the world keeps up, the wait's length later
after a wait for the server. The frames queued are bounded like the page's own JPEG queue: the newest block's frames
and SLACK_FRAMES more; beyond that the oldest are skipped (`skipped`). So a server faster than playback grows no
queue, and a slow link gets a lower bitrate (`bitrate`, from the player's receiver estimate), not a backlog.

aiortc's MediaRelay relays decoded frames (each consumer's sender then encodes its own copy) through unbounded
queues; a world's one encode needs its packets relayed, each viewer starting at a keyframe, behind a bounded queue:
`Viewer` does that. Everything here runs on the event loop but the encodes, on the broadcast's own thread.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import av
import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from client.video import DEFAULT_FPS
from client.web.encoder import DEFAULT_BITRATE, VIDEO_CLOCK, VideoEncoder, target

log = logging.getLogger("client.web")
SLACK_FRAMES = 4  # queued beyond the newest block's frames (a quarter second), as the page's JPEG queue
VIEWER_PACKETS = 32  # a viewer's queue; a sender that falls this far behind starts again at a keyframe
KEYFRAME_GAP_S = 1.0  # asked keyframes (a viewer joining, a receiver's loss report) at most once a second


@dataclass(frozen=True)
class _Frame:
    block: int
    rgb: np.ndarray


class Viewer(MediaStreamTrack):
    """One viewer's video track: the broadcast's packets from a keyframe on. Its codec is set once its peer
    connection negotiated one (`codec`); it joins the broadcast when its sender first asks for a packet."""

    kind = "video"

    def __init__(self, broadcast: Broadcast) -> None:
        super().__init__()
        self.broadcast = broadcast
        self.codec: str | None = None
        self._packets: asyncio.Queue[av.Packet | None] = asyncio.Queue(VIEWER_PACKETS)
        self._joined = self._keyframe_seen = False

    async def recv(self) -> av.Packet:
        if not self._joined:
            if self.codec is None:
                raise MediaStreamError("no codec negotiated")
            self._joined = True
            self.broadcast.join(self)
        if self.readyState != "live":
            raise MediaStreamError
        packet = await self._packets.get()
        if packet is None:
            self.stop()
            raise MediaStreamError
        return packet

    def deliver(self, packet: av.Packet) -> None:
        """A packet of the broadcast: kept from the first keyframe on; a full queue starts again at a keyframe."""
        if not self._keyframe_seen and not packet.is_keyframe:
            return
        self._keyframe_seen = True
        try:
            self._packets.put_nowait(packet)
        except asyncio.QueueFull:
            self._drain()
            self._keyframe_seen = False
            self.broadcast.request_keyframe(self.codec)

    async def finish(self) -> None:
        """Wait until the frames queued went out (at once when no viewer takes them)."""
        while self._queue and self._pacer is not None and not self._pacer.done():
            self._went_out.clear()
            await self._went_out.wait()

    def end(self) -> None:
        """No more packets: the sender's next ask ends the track."""
        self._drain()
        self._packets.put_nowait(None)

    def stop(self) -> None:
        super().stop()
        self.broadcast.leave(self)

    def _drain(self) -> None:
        while not self._packets.empty():
            self._packets.get_nowait()


class Broadcast:
    """One world's video. `push` blocks of frames, `end` it once; viewers `join` and `leave` (Viewer does both)."""

    def __init__(self, fps: float = DEFAULT_FPS, on_air: Callable[[int, int], None] | None = None) -> None:
        """on_air(block, pts): called when a block's first frame to go out goes out (pts: VIDEO_CLOCK ticks)."""
        self.fps, self.on_air = fps, on_air
        self.skipped = 0  # frames skipped to keep up
        self.sent = 0  # frames that went out
        self.encoders: dict[str, VideoEncoder] = {}  # codec -> its one encoder
        self.bitrate = DEFAULT_BITRATE  # the encoders' target (they clamp it): the player's link's estimate
        self._logged_bitrate = DEFAULT_BITRATE
        self._size: tuple[int, int] | None = None  # the picture's (width, height), once a block came
        self.ended = False
        self._queue: deque[_Frame] = deque()
        self._arrived = asyncio.Event()
        self._went_out = asyncio.Event()  # a frame went out, or the pacer stopped
        self._viewers: set[Viewer] = set()
        self._keyframe_asked: set[str] = set()
        self._keyframe_s: dict[str, float] = {}
        self._pacer: asyncio.Task | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode")
        self._clock0 = time.monotonic()
        self._last_block = -1

    @property
    def viewers(self) -> int:
        return len(self._viewers)

    def push(self, block: int, frames: np.ndarray) -> None:
        """A block's frames [n, H, W, 3] to go out after those queued; the oldest beyond the bound are skipped."""
        if self.ended or not len(frames):
            return
        self._size = frames.shape[2], frames.shape[1]
        self._queue.extend(_Frame(block, frame) for frame in frames)
        while len(self._queue) > len(frames) + SLACK_FRAMES:
            self._queue.popleft()
            self.skipped += 1
        self._arrived.set()

    def follow(self, estimate: int) -> None:
        """The player's receiver's estimate of its link (REMB, bit/s) becomes the encoders' target. A move by more
        than a tenth from the last one logged is logged, with the bitrate it encodes this picture at."""
        self.bitrate = estimate
        if abs(estimate - self._logged_bitrate) > self._logged_bitrate / 10:
            self._logged_bitrate = estimate
            at = "" if self._size is None else f", encoding at {target(estimate, *self._size, self.fps) // 1000} kbit/s"
            log.info("link estimate %d kbit/s%s", estimate // 1000, at)

    def join(self, viewer: Viewer) -> None:
        if self.ended:
            viewer.end()
            return
        self._viewers.add(viewer)
        self.request_keyframe(viewer.codec)
        if self._pacer is None:
            self._pacer = asyncio.create_task(self._pace())
            self._pacer.add_done_callback(self._paced)

    def leave(self, viewer: Viewer) -> None:
        self._viewers.discard(viewer)
        if not self._viewers and self._pacer is not None:
            self._stop_pacer()

    def request_keyframe(self, codec: str | None) -> None:
        """The next frame of `codec` is a keyframe, or the first one a second after the last one asked for."""
        if codec is not None:
            self._keyframe_asked.add(codec)

    async def finish(self) -> None:
        """Wait until the frames queued went out (at once when no viewer takes them)."""
        while self._queue and self._pacer is not None and not self._pacer.done():
            self._went_out.clear()
            await self._went_out.wait()

    def end(self) -> None:
        """The world is over: every viewer's track ends; later pushes and joins find it ended."""
        if self.ended:
            return
        self.ended = True
        self._queue.clear()
        for viewer in list(self._viewers):
            viewer.end()
        self._viewers.clear()
        if self._pacer is not None:
            self._stop_pacer()
        self._thread.shutdown(wait=False)

    def _paced(self, pacer: asyncio.Task) -> None:
        if not pacer.cancelled() and (error := pacer.exception()) is not None:
            log.error("the world's video stopped: %s: %s", type(error).__name__, error)
            self.end()

    def _stop_pacer(self) -> None:
        self._pacer.cancel()
        self._pacer = None
        self._went_out.set()

    async def _next(self) -> _Frame:
        while not self._queue:
            self._arrived.clear()
            await self._arrived.wait()
        return self._queue.popleft()

    async def _pace(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while self._viewers:
            frame = await self._next()
            now = loop.time()
            if now < due:
                await asyncio.sleep(due - now)
            elif now - due > 1 / self.fps:  # it waited for the server: the frames after it count from now
                due = now
            due += 1 / self.fps
            pts = round((time.monotonic() - self._clock0) * VIDEO_CLOCK)
            if frame.block != self._last_block:
                self._last_block = frame.block
                if self.on_air is not None:
                    self.on_air(frame.block, pts)
            for codec in {viewer.codec for viewer in self._viewers}:
                if codec not in self.encoders:
                    self.encoders[codec] = VideoEncoder(codec, self.fps)
                encoder = self.encoders[codec]
                packets = await loop.run_in_executor(self._thread, encoder.encode, frame.rgb, pts,
                                                     self._keyframe_due(codec), self.bitrate)
                for viewer in [v for v in self._viewers if v.codec == codec]:
                    for packet in packets:
                        viewer.deliver(packet)
            self.sent += 1
            self._went_out.set()

    def _keyframe_due(self, codec: str) -> bool:
        now = time.monotonic()
        if codec not in self._keyframe_asked or now - self._keyframe_s.get(codec, -KEYFRAME_GAP_S) < KEYFRAME_GAP_S:
            return False
        self._keyframe_asked.discard(codec)
        self._keyframe_s[codec] = now
        return True

