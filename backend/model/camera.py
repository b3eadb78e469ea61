"""Camera conditioning: per-frame poses and intrinsics -> Pluecker-ray maps on the latent grid."""
from __future__ import annotations

import torch


def plucker_rays(
    poses: torch.Tensor,
    intrinsics: torch.Tensor,
    height: int,
    width: int,
    grid_h: int,
    grid_w: int,
) -> torch.Tensor:
    """Pluecker rays (o x d, d) per frame and grid cell: [N, 6, grid_h, grid_w].

    poses: [N, 4, 4] camera-to-world (OpenCV axes), made relative to the first frame.
    intrinsics: [N, 4] fx, fy, cx, cy in pixels of (height, width).
    """
    poses = poses.double()
    relative = torch.linalg.solve(poses[:1], poses)  # inv(P0) @ Pi: the first camera is the origin
    scale = torch.tensor([grid_w / width, grid_h / height, grid_w / width, grid_h / height], dtype=torch.float64)
    fx, fy, cx, cy = (intrinsics.double() * scale).unbind(-1)
    v, u = torch.meshgrid(
        torch.arange(grid_h, dtype=torch.float64) + 0.5,
        torch.arange(grid_w, dtype=torch.float64) + 0.5,
        indexing="ij",
    )
    x = (u[None] - cx[:, None, None]) / fx[:, None, None]
    y = (v[None] - cy[:, None, None]) / fy[:, None, None]
    dirs_cam = torch.stack([x, y, torch.ones_like(x)], dim=-1)  # [N, h, w, 3]
    rotation = relative[:, :3, :3]
    origin = relative[:, :3, 3]
    dirs = torch.einsum("nij,nhwj->nhwi", rotation, dirs_cam)
    dirs = dirs / dirs.norm(dim=-1, keepdim=True)
    moment = torch.cross(origin[:, None, None, :].expand_as(dirs), dirs, dim=-1)
    return torch.cat([moment, dirs], dim=-1).permute(0, 3, 1, 2).float()


def latent_camera_features(rays: torch.Tensor, latent_frames: int, temporal_factor: int) -> torch.Tensor:
    """Stack the rays of the video frames behind each latent frame: [6 x t, latent_frames, h, w].

    Latent frame 0 holds video frame 0 alone (repeated t times, as the causal VAE treats it);
    latent frame l > 0 holds video frames t(l-1)+1 .. tl.
    """
    t = temporal_factor
    index = [0] * t + list(range(1, 1 + t * (latent_frames - 1)))
    grouped = rays[index].reshape(latent_frames, t, *rays.shape[1:])  # [F, t, 6, h, w]
    return grouped.flatten(1, 2).transpose(0, 1).contiguous()
