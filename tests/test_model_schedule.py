"""The distilled schedule's timesteps and sigmas, against the published numbers and an independent formula."""
from __future__ import annotations

import math

import pytest
import torch

from backend.model.schedule import dmd_schedule, flow_to_x0, renoise


def test_shift_5_gives_the_published_numbers() -> None:
    s = dmd_schedule(5.0)
    assert s.timesteps == (999.0, 937.0, 833.0, 624.0)
    assert s.sigmas == pytest.approx([0.99980, 0.93789, 0.83361, 0.62469], abs=5e-6)
    # Re-noising takes the second index of a repeated integer timestep: not the x0 sigma.
    assert s.renoise_sigmas == pytest.approx([0.937578, 0.833055, 0.624687], abs=2e-6)


def independent(shift: float, indices=(0, 250, 500, 750), n: int = 1000) -> tuple[list, list, list]:
    """sigma(j) = shift s / (1 + (shift - 1) s), s = float32(0.999) (1 - j / n); t = floor(1000 sigma)."""
    top = float(torch.tensor(1 - 1 / n, dtype=torch.float32))

    def sigma(j: int) -> float:
        s = top * (n - j) / n
        return shift * s / (1 + (shift - 1) * s)

    steps, x0, again = [], [], []
    for k in indices:
        t = math.floor(sigma(k) * n)
        same = [j for j in range(n) if math.floor(sigma(j) * n) == t]
        steps.append(float(t))
        x0.append(sigma(same[0]))
        again.append(sigma(same[1] if len(same) > 1 else same[0]))
    return steps, x0, again[1:]


@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0, 10.0])
def test_other_shifts_match_an_independent_computation(shift: float) -> None:
    steps, x0, again = independent(shift)
    s = dmd_schedule(shift)
    assert list(s.timesteps) == steps
    assert s.sigmas == pytest.approx(x0, abs=1e-6)
    assert s.renoise_sigmas == pytest.approx(again, abs=1e-6)


def test_x0_in_float64_and_renoise_in_float32() -> None:
    g = torch.Generator().manual_seed(0)
    v, x, n = (torch.randn(4, 3, 4, 4, generator=g) for _ in range(3))
    x0 = flow_to_x0(x, v, 0.9378895163536072)
    assert x0.dtype == torch.float32 and torch.equal(x0, (x.double() - 0.9378895163536072 * v.double()).float())
    s = torch.tensor(0.9375777840614319, dtype=torch.float32)
    assert torch.equal(renoise(x0, n, 0.9375777840614319), (1 - s) * x0 + s * n)
