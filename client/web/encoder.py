"""One video encoder through av: H.264 (libx264) or VP8 (libvpx), uint8 RGB frames in, av.Packets out. aiortc's
RTCRtpSender sends a packet as it is (it only packetizes it), so one encoder serves any number of senders.

Its settings follow aiortc's own encoders (Baseline H.264 at level 3.1, zero latency; VP8 in real time), with a
keyframe every KEYFRAME_EVERY frames and when asked only (a keyframe costs every viewer its bits). Its target
bitrate (`target`) is the receiver's estimate held between a floor and the picture's ceiling: the ceiling is
BITS_PER_PIXEL a pixel a frame (MIN_BITRATE to MAX_BITRATE), so a small picture never spends a fast link's bits;
the floor FLOOR_BITRATE (or the ceiling, if lower), aiortc's own: a receiver's estimate is at most about 1.5 times
what it receives, and with no probing of the link (aiortc sends none) a target that followed it all the way down
would stay down. As in aiortc, a target that moves by more than a tenth reopens the encoder, whose next frame is
then a keyframe.
"""
from __future__ import annotations

import fractions

import av
import numpy as np

H264, VP8 = "video/H264", "video/VP8"
LIBRARIES = {H264: "libx264", VP8: "libvpx"}
MIN_BITRATE, FLOOR_BITRATE, DEFAULT_BITRATE, MAX_BITRATE = 100_000, 500_000, 2_000_000, 10_000_000  # bit/s
BITS_PER_PIXEL = 0.3  # a frame's most: 1.9 Mbit/s at 480x832 and 16 fps, 4.4 at 1280x720
KEYFRAME_EVERY = 64  # frames: 4 s at 16 fps, the longest a viewer that lost a packet for good waits to see again
VIDEO_CLOCK = 90_000  # Hz: RTP's clock for video, the unit of a packet's pts
TIME_BASE = fractions.Fraction(1, VIDEO_CLOCK)


def ceiling(width: int, height: int, fps: float) -> int:
    """The most bit/s a picture of this size gets, whatever the link allows."""
    return max(MIN_BITRATE, min(MAX_BITRATE, round(BITS_PER_PIXEL * width * height * fps)))


def target(estimate: int, width: int, height: int, fps: float) -> int:
    """The bit/s a picture of this size is encoded at for a receiver's `estimate`."""
    top = ceiling(width, height, fps)
    return max(min(FLOOR_BITRATE, top), min(estimate, top))


class VideoEncoder:
    """Not thread-safe: one thread encodes (the broadcast's own)."""

    def __init__(self, mime: str, fps: float) -> None:
        if mime not in LIBRARIES:
            raise ValueError(f"no encoder for {mime}; this bridge sends {sorted(LIBRARIES)}")
        self.mime, self.fps = mime, fps
        self.frames = 0  # frames encoded, over every reopening
        self._codec: av.VideoCodecContext | None = None

    def encode(self, rgb: np.ndarray, pts: int, keyframe: bool = False, bitrate: int = DEFAULT_BITRATE) -> list[av.Packet]:
        """One frame [H, W, 3] at `pts` (VIDEO_CLOCK ticks, increasing) and about `bitrate` bit/s (clamped): its
        packets, a keyframe's if asked."""
        frame = av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format="yuv420p")
        frame.pts, frame.time_base = pts, TIME_BASE
        frame.pict_type = av.video.frame.PictureType.I if keyframe else av.video.frame.PictureType.NONE
        codec = self._open(frame.width, frame.height, target(bitrate, frame.width, frame.height, self.fps))
        packets = list(codec.encode(frame))
        for packet in packets:
            packet.pts, packet.time_base = pts, TIME_BASE
        self.frames += 1
        return packets

    def _open(self, width: int, height: int, bitrate: int) -> av.VideoCodecContext:
        codec = self._codec
        if codec is not None and (codec.width, codec.height) == (width, height) and \
                abs(bitrate - codec.bit_rate) <= codec.bit_rate / 10:
            return codec
        codec = av.CodecContext.create(LIBRARIES[self.mime], "w")
        codec.width, codec.height, codec.pix_fmt = width, height, "yuv420p"
        codec.bit_rate, codec.time_base = bitrate, TIME_BASE
        codec.framerate = fractions.Fraction(self.fps).limit_denominator(1000)
        codec.gop_size = KEYFRAME_EVERY
        rate = {"maxrate": str(bitrate), "bufsize": str(bitrate)}  # at most a second's bits in flight
        if self.mime == H264:
            codec.profile = "Baseline"
            codec.options = rate | {"level": "31", "preset": "veryfast", "tune": "zerolatency",
                                    "x264-params": "scenecut=0"}  # keyframes when asked or due, not on a cut
        else:
            codec.qmin, codec.qmax = 2, 56
            codec.options = rate | {"deadline": "realtime", "cpu-used": "-6", "lag-in-frames": "0",
                                    "static-thresh": "1", "undershoot-pct": "100", "overshoot-pct": "15"}
        self._codec = codec
        return codec
