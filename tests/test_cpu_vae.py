"""The Wan VAE's float32 CPU fast path (backend/model/cpu_vae.py) decodes what torch's default kernels decode
and encodes the first-frame condition they encode, to float32 rounding, block after block, and never reaches
torch's slow 3D convolution."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan
from torch.profiler import ProfilerActivity, profile

from backend.model.condition import StreamingConditionEncoder, prepare_image
from backend.model.vae import StreamingVae

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = torch.device("cpu")
Z = 4
BLOCKS = 2  # the first block (9 frames) and a streamed one (12 frames) that reads the causal cache


def tiny_vae() -> AutoencoderKLWan:
    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, z_dim=Z,
                            temperal_downsample=[False, True, True],
                            latents_mean=[0.1, -0.2, 0.3, -0.4], latents_std=[1.3, 0.7, 2.9, 1.1]).eval()


@pytest.fixture(scope="module")
def latents() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(1, Z, 3, 4, 4, generator=generator) for _ in range(BLOCKS)]


def streamed(vae: StreamingVae, latents: list[torch.Tensor]) -> tuple[list[np.ndarray], set[str]]:
    """Each block's frames, and the kernels the decode ran."""
    state = vae.new_decode_state()
    with profile(activities=[ProfilerActivity.CPU]) as recorded:
        frames = [vae.decode_block(block, state) for block in latents]
    return frames, {event.key for event in recorded.key_averages()}


@pytest.mark.timeout(60)
def test_fast_path_streams_the_default_kernels_frames_without_the_slow_conv3d(latents: list[torch.Tensor]) -> None:
    default, default_kernels = streamed(StreamingVae(tiny_vae(), CPU, fast_cpu=False), latents)
    fast, fast_kernels = streamed(StreamingVae(tiny_vae(), CPU), latents)
    for index, (a, b) in enumerate(zip(default, fast)):
        assert a.shape == b.shape == ((9 if index == 0 else 12), 32, 32, 3)
        assert int(np.abs(a.astype(int) - b.astype(int)).max()) <= 1  # a rounding step at most
        assert np.mean(a != b) < 1e-3
    assert "aten::slow_conv3d_forward" in default_kernels  # the case the fast path exists for
    assert "aten::slow_conv3d_forward" not in fast_kernels and "aten::mkldnn_convolution" in fast_kernels


@pytest.mark.timeout(60)
def test_fast_path_matches_to_float32_rounding(latents: list[torch.Tensor]) -> None:
    clip = torch.cat(latents, dim=2)
    default, fast = tiny_vae(), tiny_vae()
    StreamingVae(fast, CPU)  # switches its decoder in place
    with torch.no_grad():
        expected, got = default.decode(clip).sample, fast.decode(clip).sample
    assert got.shape == expected.shape == (1, 3, 4 * clip.shape[2] - 3, 32, 32)
    assert (got - expected).abs().max().item() < 1e-5 * expected.abs().max().item()


def encoded(encoder: StreamingConditionEncoder, blocks: int) -> tuple[torch.Tensor, set[str]]:
    """The condition latents of `blocks` blocks of 3 latent frames (a 32x32 image), and the kernels they ran."""
    image = torch.from_numpy(np.random.default_rng(2).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    state = encoder.start(prepare_image(image, 32, 32))
    with profile(activities=[ProfilerActivity.CPU]) as recorded:
        latents = torch.cat([encoder.encode_next(state, 3) for _ in range(blocks)], dim=2)
    return latents, {event.key for event in recorded.key_averages()}


@pytest.mark.timeout(60)
def test_the_condition_encode_takes_the_fast_path_to_float32_rounding() -> None:
    """The encoder's output is the DiT's input: close to torch's kernels' (not the same bits: cpu_vae_kernels=torch
    keeps those), streamed block after block through the causal cache."""
    default, default_kernels = encoded(StreamingConditionEncoder(tiny_vae(), fast_cpu=False), BLOCKS)
    fast, fast_kernels = encoded(StreamingConditionEncoder(tiny_vae()), BLOCKS)
    assert fast.shape == default.shape == (1, Z, 3 * BLOCKS, 4, 4)
    assert (fast - default).abs().max().item() < 1e-5 * default.abs().max().item()
    assert "aten::slow_conv3d_forward" in default_kernels
    assert "aten::slow_conv3d_forward" not in fast_kernels and "aten::mkldnn_convolution" in fast_kernels
