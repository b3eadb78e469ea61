"""The distilled 4-step flow-matching schedule of LingBot-World v2, as the reference samples it.

The reference's scheduler (1000 training steps) is set to 1000 steps with `shift`: sigmas are
linspace(0.999, 0, 1001)[:-1] warped by shift*s / (1 + (shift-1)*s) in float64, timesteps are int(sigma*1000)
(truncated), sigmas are stored in float32. The DMD steps take the timesteps at indices [0, 250, 500, 750]
(whole numbers: [999, 937, 833, 624] at shift 5). Where one integer timestep covers several indices, the x0
conversion uses the sigma of the first and re-noising (add_noise) that of the second; the schedule keeps both.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

STEP_INDICES = (0, 250, 500, 750)
TRAIN_TIMESTEPS = 1000


@dataclass(frozen=True)
class DmdSchedule:
    timesteps: tuple[float, ...]  # fed to the model, one per step
    sigmas: tuple[float, ...]  # x0 = x_t - sigma * v at each step
    renoise_sigmas: tuple[float, ...]  # noise level of step k + 1's input, k = 0 .. steps - 2


def dmd_schedule(shift: float, step_indices: tuple[int, ...] = STEP_INDICES) -> DmdSchedule:
    n = TRAIN_TIMESTEPS
    sigma_max = float(np.float32(1.0 - 1.0 / n))  # the scheduler's largest training sigma, stored in float32
    sig = np.linspace(sigma_max, 0.0, n + 1)[:-1]
    sig = shift * sig / (1.0 + (shift - 1.0) * sig)
    timesteps = (sig * n).astype(np.int64)
    sigmas = sig.astype(np.float32)
    steps, x0, renoise = [], [], []
    for index in step_indices:
        same = np.flatnonzero(timesteps == timesteps[index])
        steps.append(float(timesteps[index]))
        x0.append(float(sigmas[same[0]]))
        renoise.append(float(sigmas[same[1] if len(same) > 1 else same[0]]))
    return DmdSchedule(tuple(steps), tuple(x0), tuple(renoise[1:]))


def flow_to_x0(x_t: torch.Tensor, velocity: torch.Tensor, sigma: float) -> torch.Tensor:
    """x0 = x_t - sigma * v, computed in float64 as the reference does; float32 out."""
    return (x_t.double() - sigma * velocity.double()).float()


def renoise(x0: torch.Tensor, noise: torch.Tensor, sigma: float) -> torch.Tensor:
    """(1 - sigma) * x0 + sigma * noise in float32 (the scheduler's add_noise)."""
    s = torch.tensor(sigma, dtype=torch.float32)
    return (1 - s) * x0 + s * noise
