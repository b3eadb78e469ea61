"""Pluecker-ray camera features."""
from __future__ import annotations

import numpy as np
import torch

from backend.model.camera import latent_camera_features, plucker_rays
from backend.api.request import default_intrinsics
from factories import forward_poses


def rays_for(poses: np.ndarray, size: int = 8) -> torch.Tensor:
    n = len(poses)
    return plucker_rays(torch.from_numpy(poses), torch.from_numpy(default_intrinsics(n, 64, 64)), 64, 64, size, size)


def test_first_camera_at_origin_looks_down_z() -> None:
    rays = rays_for(forward_poses(3))  # [N, 6, h, w]: moment, direction
    moment, direction = rays[0, :3], rays[0, 3:]
    assert torch.allclose(moment, torch.zeros_like(moment), atol=1e-6)
    assert torch.allclose(direction.norm(dim=0), torch.ones(8, 8), atol=1e-6)
    centre = direction[:, 3:5, 3:5].mean(dim=(1, 2))
    assert torch.allclose(centre, torch.tensor([0.0, 0.0, 1.0]), atol=1e-2)
    assert (direction[0, :, :4] < 0).all() and (direction[0, :, 4:] > 0).all()  # x grows to the right


def test_rays_depend_on_motion_relative_to_the_first_camera() -> None:
    poses = forward_poses(5)
    poses[:, :3, :3] = np.array([[0, 0, 1], [0, 1, 0], [-1, 0, 0]], np.float32)  # turned 90 degrees
    shifted = poses.copy()
    shifted[:, :3, 3] += np.array([10.0, -3.0, 2.0], np.float32)  # the whole trajectory moved
    assert torch.allclose(rays_for(poses), rays_for(shifted), atol=1e-5)
    sideways = forward_poses(5)
    sideways[:, 0, 3], sideways[:, 2, 3] = sideways[:, 2, 3], 0.0
    assert not torch.allclose(rays_for(forward_poses(5))[1:], rays_for(sideways)[1:], atol=1e-3)


def test_latent_frames_stack_their_video_frames() -> None:
    rays = torch.arange(9, dtype=torch.float32).view(9, 1, 1, 1).expand(9, 6, 2, 2)
    features = latent_camera_features(rays, latent_frames=3, temporal_factor=4)  # [24, 3, 2, 2]
    per_sub_frame = features[::6, :, 0, 0].T  # [latent frame, sub-frame]: the video frame index
    assert per_sub_frame.tolist() == [[0, 0, 0, 0], [1, 2, 3, 4], [5, 6, 7, 8]]
