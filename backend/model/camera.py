"""Camera conditioning as LingBot-World v2 computes it: poses per latent frame, Pluecker rays, 8x8 fold.

Per-video-frame camera-to-world poses (OpenCV axes) are interpolated to one pose per latent frame (rotation by
SLERP, translation linearly, at linspace(0, N-1, F)), made relative to the first, then frame to frame
(inv(P[i-1]) @ P[i]); translations are divided by the largest translation norm (the clip's, or a running one).
Each output pixel's ray is [origin, unit direction] (6 channels: the origin, not the moment o x d), rotated by
the pose; the 8x8 pixels behind each latent pixel are folded into 384 channels. The first frame's intrinsics
serve every frame, as in the reference. Interpolation runs in float64, the rest in float32, as the reference.
"""
from __future__ import annotations

import numpy as np
import torch


# Rotations in float64 numpy: the algorithm of the reference's scipy calls (Rotation.from_matrix, sign-continuous
# quaternions, Slerp through rotation vectors; linear translation), so the float32 result matches it.
def _quat_from_matrix(m: np.ndarray) -> np.ndarray:
    """[N,3,3] -> [N,4] (x,y,z,w).  Non-orthogonal inputs (e.g. float32 poses) are
    first projected with an SVD (U @ Vt), as scipy does when |M M^T - I| > 1e-12."""
    m = np.array(m, dtype=np.float64)
    gram = m @ np.swapaxes(m, -1, -2)
    ortho = np.all(np.isclose(gram, np.eye(3), atol=1e-12), axis=(-2, -1))
    if not ortho.all():
        U, _, Vt = np.linalg.svd(m[~ortho], full_matrices=False)
        m[~ortho] = U @ Vt
    tr = m[:, 0, 0] + m[:, 1, 1] + m[:, 2, 2]
    choice = np.stack([m[:, 0, 0], m[:, 1, 1], m[:, 2, 2], tr], -1).argmax(-1)
    q = np.empty((len(m), 4), dtype=np.float64)
    for k, (a, t, c) in enumerate(zip(m, tr, choice)):
        if c == 0:
            q[k] = [1 - t + 2 * a[0, 0], a[1, 0] + a[0, 1], a[2, 0] + a[0, 2], a[2, 1] - a[1, 2]]
        elif c == 1:
            q[k] = [a[1, 0] + a[0, 1], 1 - t + 2 * a[1, 1], a[2, 1] + a[1, 2], a[0, 2] - a[2, 0]]
        elif c == 2:
            q[k] = [a[2, 0] + a[0, 2], a[2, 1] + a[1, 2], 1 - t + 2 * a[2, 2], a[1, 0] - a[0, 1]]
        else:
            q[k] = [a[2, 1] - a[1, 2], a[0, 2] - a[2, 0], a[1, 0] - a[0, 1], 1 + t]
    return q / np.linalg.norm(q, axis=-1, keepdims=True)


def _quat_mul(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    c = np.cross(p[..., :3], q[..., :3])
    return np.stack([
        p[..., 3] * q[..., 0] + q[..., 3] * p[..., 0] + c[..., 0],
        p[..., 3] * q[..., 1] + q[..., 3] * p[..., 1] + c[..., 1],
        p[..., 3] * q[..., 2] + q[..., 3] * p[..., 2] + c[..., 2],
        p[..., 3] * q[..., 3] - p[..., 0] * q[..., 0] - p[..., 1] * q[..., 1] - p[..., 2] * q[..., 2],
    ], -1)


def _quat_canonical(q: np.ndarray) -> np.ndarray:
    """Sign so that w > 0 (ties broken by x, y, z)."""
    out = q.copy()
    for k in range(len(q)):
        for c in (3, 0, 1, 2):
            if q[k, c] != 0:
                if q[k, c] < 0:
                    out[k] = -q[k]
                break
    return out


def _quat_log(q: np.ndarray) -> np.ndarray:
    """Unit quaternion -> rotation vector (shortest)."""
    q = _quat_canonical(q)
    n = np.linalg.norm(q[:, :3], axis=-1, keepdims=True)
    ang = 2 * np.arctan2(n, q[:, 3:4])
    small = ang <= 1e-3
    a2 = ang ** 2
    scale = np.where(small, 2 + a2 / 12 + 7 * a2 ** 2 / 2880, ang / (np.sin(ang / 2) + small))
    return scale * q[:, :3]


def _quat_exp(rv: np.ndarray) -> np.ndarray:
    ang = np.linalg.norm(rv, axis=-1, keepdims=True)
    small = ang <= 1e-3
    a2 = ang ** 2
    scale = np.where(small, 0.5 - a2 / 48 + a2 ** 2 / 3840, np.sin(ang / 2) / (ang + small))
    return np.concatenate([rv * scale, np.cos(ang / 2)], -1)


def _quat_to_matrix(q: np.ndarray) -> np.ndarray:
    x, y, z, w = q[:, 0], q[:, 1], q[:, 2], q[:, 3]
    x2, y2, z2, w2 = x * x, y * y, z * z, w * w
    xy, zw, xz, yw, yz, xw = x * y, z * w, x * z, y * w, y * z, x * w
    return np.stack([x2 - y2 - z2 + w2, 2 * (xy - zw), 2 * (xz + yw),
                     2 * (xy + zw), -x2 + y2 - z2 + w2, 2 * (yz - xw),
                     2 * (xz - yw), 2 * (yz + xw), -x2 - y2 + z2 + w2], -1).reshape(-1, 3, 3)


def interpolate_poses(poses, latent_frames: int) -> torch.Tensor:
    """Per-video-frame c2w poses [N,4,4] -> one pose per latent frame [F,4,4].

    Sample positions ``linspace(0, N-1, F)`` over source positions 0..N-1.
    Rotation: SLERP along the shortest arc, R_i * exp(alpha * log(R_i^-1 R_{i+1}))
    with i = searchsorted(src, t) - 1 (so an exact integer t = k > 0 is taken as
    alpha = 1 from k-1); translation: linear.  float64 inside, float32 out (the
    reference returns ``torch.from_numpy(poses).float()``).
    """
    P = poses.detach().cpu().numpy() if isinstance(poses, torch.Tensor) else np.asarray(poses)
    n = P.shape[0]
    if n < 2 or latent_frames < 1:
        raise ValueError("need at least two poses and one latent frame")
    src = np.linspace(0, n - 1, n)
    tgt = np.linspace(0, n - 1, latent_frames)
    q = _quat_from_matrix(P[:, :3, :3])
    for i in range(1, n):                       # sign continuity (no effect on the arc chosen)
        if np.dot(q[i], q[i - 1]) < 0:
            q[i] = -q[i]
    q = q / np.linalg.norm(q, axis=-1, keepdims=True)
    q_inv = np.concatenate([-q[:-1, :3], q[:-1, 3:]], -1)
    rotvecs = _quat_log(_quat_mul(q_inv, q[1:]))
    ind = np.searchsorted(src, tgt) - 1
    ind[tgt == src[0]] = 0
    alpha = (tgt - src[ind]) / np.diff(src)[ind]
    rot = _quat_to_matrix(_quat_mul(q[:-1][ind], _quat_exp(rotvecs[ind] * alpha[:, None])))
    y = P[:, :3, 3]                              # keep float32 input as float32 here:
    if not np.issubdtype(y.dtype, np.inexact):   # the difference y_hi - y_lo is taken in the
        y = y.astype(np.float64)                 # source dtype, then promoted (interp1d does so)
    hi = np.clip(np.searchsorted(src, tgt), 1, n - 1)
    lo = hi - 1
    slope = (y[hi] - y[lo]) / (src[hi] - src[lo])[:, None]
    trans = slope * (tgt - src[lo])[:, None] + y[lo]
    out = np.zeros((latent_frames, 4, 4), dtype=np.float64)
    out[:, :3, :3] = rot
    out[:, :3, 3] = trans
    out[:, 3, 3] = 1.0
    return torch.from_numpy(out).float()


def se3_inverse(T: torch.Tensor) -> torch.Tensor:
    """Rigid inverse [R^T | -R^T t] of [B,4,4] (same dtype as input)."""
    R = T[:, :3, :3]
    t = T[:, :3, 3:]
    Rt = R.transpose(-1, -2)
    out = torch.eye(4, dtype=T.dtype, device=T.device).repeat(T.shape[0], 1, 1)
    out[:, :3, :3] = Rt
    out[:, :3, 3:] = -torch.bmm(Rt, t)
    return out


def relative_to_first(poses: torch.Tensor) -> torch.Tensor:
    """inv(c2w_0) @ c2w_i; frame 0 is set to exactly the identity."""
    rel = torch.matmul(se3_inverse(poses[0:1]), poses)
    rel[0] = torch.eye(4, dtype=poses.dtype, device=poses.device)
    return rel


def framewise_deltas(poses: torch.Tensor) -> torch.Tensor:
    """out[0] = poses[0]; out[i] = inv(poses[i-1]) @ poses[i] for i >= 1."""
    out = poses.clone()
    if poses.shape[0] > 1:
        out[1:] = torch.bmm(se3_inverse(poses[:-1]), poses[1:])
    return out


def translation_scale(poses: torch.Tensor) -> float:
    """Largest translation norm over the clip (0.0 when static)."""
    return float(torch.norm(poses[:, :3, 3], dim=-1).max())


def normalise_translations(poses: torch.Tensor, scale: float) -> torch.Tensor:
    """Divide every translation by ``scale`` (no-op when scale <= 0).

    A live session may pass a running maximum instead of the clip maximum.
    Note: the reference divides by a float32 tensor; passing a Python float
    that came from that tensor gives the identical result.
    """
    out = poses.clone()
    if scale > 0:
        out[:, :3, 3] = poses[:, :3, 3] / torch.tensor(scale, dtype=poses.dtype)
    return out


def pixel_directions(K: torch.Tensor, height: int, width: int, dtype=torch.float32) -> torch.Tensor:
    """Unit camera-space ray directions for pixel centres (+0.5): [H*W, 3]."""
    ys = torch.arange(height, dtype=dtype) + 0.5
    xs = torch.arange(width, dtype=dtype) + 0.5
    gy, gx = torch.meshgrid(ys, xs, indexing="ij")
    K = K.to(dtype)
    fx, fy, cx, cy = K[0], K[1], K[2], K[3]
    gx = gx.reshape(-1)
    gy = gy.reshape(-1)
    d = torch.stack([(gx - cx) / fx, (gy - cy) / fy, torch.ones_like(gx)], dim=-1)
    return d / d.norm(dim=-1, keepdim=True)


def plucker_rays(poses: torch.Tensor, K: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[F,4,4] poses, K=[fx,fy,cx,cy] -> [F, 6, H, W] = [rays_o(3), rays_d(3)].

    rays_d = R @ unit_dir (per frame), rays_o = t broadcast (NOT the moment o x d).
    Dtype follows the poses (float32 in the reference).
    """
    f = poses.shape[0]
    dirs = pixel_directions(K, height, width, poses.dtype)            # [HW,3]
    rays_d = (poses[:, :3, :3] @ dirs.T)                                # [F,3,HW]
    rays_o = poses[:, :3, 3:].expand(f, 3, height * width)              # [F,3,HW]
    return torch.cat([rays_o, rays_d], dim=1).reshape(f, 6, height, width)


def fold_to_latent(rays: torch.Tensor, factor: int = 8) -> torch.Tensor:
    """[F, C, H, W] -> [F, C*p*p, H/p, W/p] with ``c (h p1) (w p2) -> (c p1 p2) h w``.

    Output channel index = c*p*p + p1*p + p2 (p1 = row offset, p2 = column
    offset inside the patch), matching the reference's
    ``'f (h c1) (w c2) c -> (f h w) (c c1 c2)'``.
    """
    f, c, H, W = rays.shape
    if H % factor or W % factor:
        raise ValueError(f"H, W ({H}, {W}) must be divisible by {factor}")
    h, w = H // factor, W // factor
    x = rays.reshape(f, c, h, factor, w, factor)       # f c h p1 w p2
    x = x.permute(0, 1, 3, 5, 2, 4)                     # f c p1 p2 h w
    return x.reshape(f, c * factor * factor, h, w)


def camera_features(poses: torch.Tensor, intrinsics: torch.Tensor, height: int, width: int, fold: int) -> torch.Tensor:
    """Model poses [F, 4, 4] and [fx, fy, cx, cy] in output pixels -> the model's camera input
    [6 * fold * fold, F, height / fold, width / fold] (float32)."""
    folded = fold_to_latent(plucker_rays(poses.float(), intrinsics.float(), height, width), fold)
    return folded.permute(1, 0, 2, 3).contiguous()
