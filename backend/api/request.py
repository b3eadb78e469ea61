"""Session requests and steps, and their checks (numpy only: shared by the engine, the Triton adapter and clients).

A session is a whole trajectory (every frame's pose up front, `num_frames` set) or steered (open-ended: the first
request carries the first block's camera, each step the next block's, as poses or as held keys)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from .contract import (CAMERA_INTRINSICS, INPUT_SPECS, MAX_PROMPT_BYTES, NO_FORK, ON_STARVE, PARAM_RECACHE,
                       PARAM_RESUME, POSE_SCALES, PROMPT, SNAPSHOT_ID_PATTERN, block_video_frames)
from .errors import InputError
from .provenance import parse_settings

DEFAULT_HFOV_DEG = 60.0
_INTRINSICS = INPUT_SPECS[CAMERA_INTRINSICS]  # fx, fy: its positive columns


def default_intrinsics(num_frames: int, height: int, width: int, hfov_deg: float = DEFAULT_HFOV_DEG) -> np.ndarray:
    """Intrinsics [num_frames, 4] float32 (fx, fy, cx, cy) of a centred pinhole with square pixels."""
    if not 0.0 < hfov_deg < 180.0:
        raise ValueError(f"horizontal FOV must be in (0, 180) degrees, got {hfov_deg}")
    focal = 0.5 * width / math.tan(math.radians(hfov_deg) / 2.0)
    row = np.array([focal, focal, width / 2.0, height / 2.0], dtype=np.float32)
    return np.tile(row, (num_frames, 1))


@dataclass
class Controls:
    """One block's camera: its new video frames' poses, or the keys held during it (see `controls`)."""

    poses: np.ndarray | None = None  # float32 [n, 4, 4] camera-to-world, OpenCV axes
    keys: str | None = None  # normalised held keys ("" holds none)
    prompt: str | None = None  # a step's prompt event: the session's prompt from this block on
    recache: bool = False  # with the event: the cached frames' K/V are recomputed under it before this block
    save: bool = False  # save the world after this block (request parameter save)
    release: str = ""  # with save: an older snapshot of the world, deleted once this save is durable ("": none)
    share: bool = False  # with save: any key that holds its id may resume and fork it (request parameter share)

    def check(self) -> None:
        """Each input on its own (at parse); the frame count is the server's to check (`check_frames`)."""
        if (self.poses is None) == (self.keys is None):
            raise InputError("a step needs exactly one of camera_poses (the block's new frames) or action (held keys)")
        if self.poses is not None:
            check_poses(self.poses)
        if self.prompt is not None:
            check_prompt(self.prompt)
        elif self.recache:
            raise InputError(f"request parameter '{PARAM_RECACHE}' rides on a prompt event: send it with '{PROMPT}'")

    def check_frames(self, frames: int) -> None:
        """The block's poses against the video frames the server's block has (at admission)."""
        if self.poses is not None:
            check_pose_count(self.poses, frames)


@dataclass
class SessionRequest:
    image: np.ndarray  # uint8 [H, W, 3], any size: resized to (height, width)
    prompt: str
    poses: np.ndarray | None  # float32 [num_frames, 4, 4] camera-to-world; steered: the first block's (9 frames)
    num_frames: int | None  # video frames of a whole trajectory; None: a steered, open-ended session
    seed: int
    height: int
    width: int
    intrinsics: np.ndarray | None = None  # float32 [n, 4] fx, fy, cx, cy; the first row serves every frame
    decode: bool = True
    return_latents: bool = True
    keys: str | None = None  # steered: the keys held during the first block, instead of poses
    on_starve: str = ON_STARVE[0]
    max_blocks: int = 0  # steered: end after this many blocks (0: when the client ends it)
    sequence_id: str | None = None  # steered: the Triton sequence (correlation id) that carries it
    return_used: bool = False  # send what each block was made from (api/provenance)
    expect_settings: str = ""  # refuse unless the server's settings_used equal these ("": no check)
    pose_scale: str = POSE_SCALES[0]  # a whole trajectory's translation scale: "clip" or "running" (as steered)
    save: bool = False  # steered: save the world after the first block
    share: bool = False  # with save: the snapshot is shared (any key that holds its id may resume it)

    @property
    def steered(self) -> bool:
        return self.num_frames is None

    @property
    def first_controls(self) -> Controls:
        return Controls(poses=self.poses, keys=self.keys, save=self.save, share=self.share)

    def camera_intrinsics(self) -> np.ndarray:
        """[fx, fy, cx, cy] of the first frame, in output pixels."""
        if self.intrinsics is None:
            return default_intrinsics(1, self.height, self.width)[0]
        return self.intrinsics[0]


@dataclass
class StepRequest:
    """The next block's camera for a running steered session; `end` closes it after that block; a `pause`
    carries no camera and holds the session open until the sequence's next request."""

    sequence_id: str
    controls: Controls | None  # None with `end` (close without another block) or `pause`
    end: bool = False
    return_latents: bool = True
    return_used: bool = False
    pause: bool = False


@dataclass
class ResumeRequest:
    """A steered session's start that opens a saved world where it stood: the snapshot's id and the next block's
    camera (the rest of the session is the snapshot's)."""

    snapshot_id: str
    controls: Controls
    sequence_id: str
    fork_seed: int = NO_FORK
    return_latents: bool = True
    return_used: bool = False

    @property
    def steered(self) -> bool:
        return True


@dataclass(frozen=True)
class SavesRequest:
    """A request about its key's own snapshots (request parameter saves): list them, or share or unshare one."""

    action: str  # "list", "share" or "unshare"
    snapshot_id: str = ""  # share and unshare: which


def check_snapshot_id(snapshot_id: str, name: str = PARAM_RESUME) -> str:
    if not re.fullmatch(SNAPSHOT_ID_PATTERN, snapshot_id):
        raise InputError(f"request parameter '{name}' must be a snapshot id ({SNAPSHOT_ID_PATTERN}); got "
                         f"{snapshot_id[:40]!r}")
    return snapshot_id


def check_prompt(prompt: str) -> None:
    if not prompt.strip():
        raise InputError(f"{PROMPT} is empty")
    if (size := len(prompt.encode("utf-8"))) > MAX_PROMPT_BYTES:
        raise InputError(f"{PROMPT} is {size} bytes of UTF-8; at most {MAX_PROMPT_BYTES}")


def check_poses(poses: np.ndarray, name: str = "camera_poses") -> None:
    """FP32 [n, 4, 4] rigid camera-to-world poses, n >= 1 (how many is the request's to say: `check_pose_count`)."""
    if poses.dtype != np.float32 or poses.ndim != 3 or poses.shape[1:] != (4, 4) or len(poses) < 1:
        raise InputError(f"{name} must be FP32 [n, 4, 4]; got {poses.dtype} {list(poses.shape)}")
    if not np.isfinite(poses).all():
        raise InputError(f"{name} holds NaN or Inf")
    if not np.allclose(poses[:, 3], [0.0, 0.0, 0.0, 1.0], atol=1e-4):
        raise InputError(f"{name}: the last row of every 4x4 pose must be [0, 0, 0, 1]")
    rotations = poses[:, :3, :3].astype(np.float64)
    gram = rotations @ rotations.transpose(0, 2, 1)
    worst = int(np.abs(gram - np.eye(3)).max(axis=(1, 2)).argmax())
    if not np.allclose(gram, np.eye(3), atol=1e-2) or (np.linalg.det(rotations) <= 0).any():
        raise InputError(f"{name}[{worst}]: the 3x3 block is not a rotation (orthonormal, det +1)")


def check_pose_count(poses: np.ndarray, frames: int, name: str = "camera_poses") -> None:
    if len(poses) != frames:
        raise InputError(f"{name} must be FP32 [{frames}, 4, 4]; got {poses.dtype} {list(poses.shape)}")


def check_request(request: SessionRequest) -> None:
    """Each input of a session's first request on its own: types, shapes and values, as the contract declares
    them (parse_request runs it; how they fit the server is admission's: `check_frame_counts`). Raises InputError."""
    image = request.image
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3 or min(image.shape[:2]) < 1:
        raise InputError(f"image must be UINT8 [H, W, 3]; got {image.dtype} {list(image.shape)}")
    check_prompt(request.prompt)
    if request.steered:
        request.first_controls.check()
    elif request.poses is None:
        raise InputError("a whole-trajectory request (num_frames set) needs camera_poses for every frame")
    else:
        check_poses(request.poses)
    if request.expect_settings:
        parse_settings(request.expect_settings)
    if request.intrinsics is not None:
        k = request.intrinsics
        if k.dtype != np.float32 or k.ndim != 2 or k.shape[1] != 4 or len(k) < 1:
            raise InputError(f"camera_intrinsics must be FP32 [n, 4]; got {k.dtype} {list(k.shape)}")
        if not np.isfinite(k).all() or (k[:, :_INTRINSICS.positive_columns] <= 0).any():
            raise InputError("camera_intrinsics must be finite with fx, fy > 0")


def check_frame_counts(request: SessionRequest, block_frames: int) -> None:
    """The request's poses against its frames: every frame of a whole trajectory, or the server's first block."""
    if request.steered:
        request.first_controls.check_frames(block_video_frames(block_frames, first=True))
    else:
        check_pose_count(request.poses, request.num_frames)
