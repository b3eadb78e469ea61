"""A session's camera, block by block: the model poses of each block's latent frames from its video frames.

The reference prepares a whole clip at once (see `backend.model.camera`); a steered session learns its camera
one block at a time, so both kinds of session go through this track, which keeps what the next block needs:
the first latent pose's inverse, the last latent pose (for the frame-to-frame delta), the last video pose (the
interpolation window's start) and the translation scale. A whole trajectory divides by its clip's largest
translation norm, as the reference; a steered session by the running maximum so far (the same number for
constant-speed motion). Latent frame l sits on video frame 4l, so each block interpolates over its own frames
plus the previous latent frame's pose.
"""
from __future__ import annotations

import numpy as np
import torch

from ..api.controls import integrate
from ..api.contract import block_video_frames
from ..api.request import Controls
from ..model.camera import framewise_deltas, interpolate_poses, normalise_translations, se3_inverse, translation_scale


class CameraTrack:
    def __init__(self, intrinsics: np.ndarray, block_frames: int, scale: float | None = None) -> None:
        """scale: the clip's translation scale (a whole trajectory), None for the running maximum."""
        self.block_frames = block_frames
        self.intrinsics = torch.from_numpy(np.asarray(intrinsics, dtype=np.float32))
        self.fixed_scale = scale
        self.running_scale = 0.0
        self.first_inverse: torch.Tensor | None = None
        self.last_latent: torch.Tensor | None = None  # relative pose of the last latent frame
        self.last_video: np.ndarray | None = None  # camera-to-world of the last video frame
        self.last_motion: np.ndarray | None = None  # the last frame-to-frame motion (float64 [4, 4])

    @classmethod
    def whole(cls, poses: np.ndarray, intrinsics: np.ndarray, block_frames: int) -> CameraTrack:
        """A whole trajectory's track: its scale is the clip's largest translation, found by a dry run."""
        dry = cls(intrinsics, block_frames)
        for block in split_blocks(poses, block_frames):
            dry.next_block(block)
        return cls(intrinsics, block_frames, dry.running_scale)

    @property
    def started(self) -> bool:
        return self.last_video is not None

    def video_frames(self) -> int:
        """New video frames the next block takes."""
        return block_video_frames(self.block_frames, first=not self.started)

    def resolve(self, controls: Controls | None) -> np.ndarray:
        """The next block's video poses [n, 4, 4]: given, integrated from held keys, or (None) a held block: the
        last frame-to-frame motion repeated, as if the controls were still held."""
        if controls is not None and controls.poses is not None:
            return controls.poses
        if controls is not None:
            if not self.started:
                start = np.eye(4, dtype=np.float32)
                return np.concatenate([start[None], integrate(start, controls.keys, self.video_frames() - 1)])
            return integrate(self.last_video, controls.keys, self.video_frames())
        if self.last_motion is None:
            raise ValueError("no motion to hold before the first block")
        poses, pose = [], self.last_video.astype(np.float64)
        for _ in range(self.video_frames()):
            pose = pose @ self.last_motion
            poses.append(pose)
        return np.stack(poses).astype(np.float32)

    def next_block(self, video_poses: np.ndarray) -> torch.Tensor:
        """The model poses [block_frames, 4, 4] of the block whose new video frames have these camera-to-world poses."""
        first = not self.started
        window = video_poses if first else np.concatenate([self.last_video[None], video_poses])
        latent = interpolate_poses(window, 1 + (len(window) - 1) // 4)
        if first:
            self.first_inverse = se3_inverse(latent[:1])
        relative = torch.matmul(self.first_inverse, latent)
        if first:
            relative[0] = torch.eye(4)
        else:
            relative = torch.cat([self.last_latent[None], relative[1:]])
        deltas = framewise_deltas(relative)
        if not first:
            deltas = deltas[1:]
        self.last_motion = np.linalg.inv(window[-2].astype(np.float64)) @ window[-1].astype(np.float64)
        self.last_latent, self.last_video = relative[-1], video_poses[-1]
        self.running_scale = max(self.running_scale, translation_scale(deltas))
        scale = self.running_scale if self.fixed_scale is None else self.fixed_scale
        return normalise_translations(deltas, scale)


def split_blocks(poses: np.ndarray, block_frames: int) -> list[np.ndarray]:
    """A whole trajectory's per-frame poses as each block's new video frames (9, then 12 each at 3 latent frames)."""
    first, later = block_video_frames(block_frames, first=True), block_video_frames(block_frames, first=False)
    return [poses[:first]] + [poses[i : i + later] for i in range(first, len(poses), later)]
