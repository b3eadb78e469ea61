"""The first-frame condition: streamed block by block, it equals the reference's whole-clip encode bit for bit, on
either of the VAE's float32 CPU kernels (cpu_vae_kernels: oneDNN's, torch's own)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan

from backend.model.condition import StreamingConditionEncoder, condition_mask, prepare_image

LATENT_FRAMES = 27  # the tiny VAE reaches its fixed point on zero frames after 22 zero chunks


@pytest.fixture(scope="module", params=[True, False], ids=["onednn", "torch"])
def fast_cpu(request: pytest.FixtureRequest) -> bool:
    if request.param and not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN: the fast path does not apply")
    return request.param


@pytest.fixture(scope="module")
def vae(fast_cpu: bool) -> AutoencoderKLWan:
    """On the kernels `fast_cpu` picks (an encoder switches its VAE in place): the whole clip's too."""
    torch.manual_seed(0)
    model = AutoencoderKLWan(base_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, z_dim=4,
                             temperal_downsample=[False, True, True],
                             latents_mean=[0.1, -0.2, 0.3, -0.4], latents_std=[1.5, 0.7, 2.0, 1.1]).eval()
    StreamingConditionEncoder(model, fast_cpu=fast_cpu)
    return model


@pytest.fixture(scope="module")
def image() -> torch.Tensor:
    # 24 x 32 pixels: a 3 x 4 latent grid (on CPU a 2 x 2 grid picks another 1x1x1 conv kernel per frame).
    pixels = np.random.default_rng(1).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    return prepare_image(torch.from_numpy(pixels), 24, 32)


@pytest.fixture(scope="module")
def whole(vae: AutoencoderKLWan, image: torch.Tensor) -> torch.Tensor:
    """The reference: encode [image, zeros...] at once, normalised distribution mean."""
    video = torch.cat([image[:, None], torch.zeros(3, 4 * (LATENT_FRAMES - 1), 24, 32)], dim=1)[None]
    with torch.no_grad():
        mean = vae.encode(video).latent_dist.mode()
    z = vae.config.z_dim
    mu = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1)
    return (mean - mu) * (1.0 / torch.tensor(vae.config.latents_std)).view(1, z, 1, 1, 1)


def test_prepare_image_scales_then_resizes_bicubic() -> None:
    pixels = (np.arange(8 * 12 * 3) % 256).astype(np.uint8).reshape(8, 12, 3)
    t = torch.from_numpy(pixels).permute(2, 0, 1).float() / 255
    expected = torch.nn.functional.interpolate(((t - 0.5) / 0.5)[None], size=(16, 24), mode="bicubic",
                                               align_corners=False, antialias=False)[0]
    assert torch.equal(prepare_image(torch.from_numpy(pixels), 16, 24), expected)


def test_mask_is_one_on_the_first_latent_frame_only() -> None:
    first, later = condition_mask(0, 3, 2, 2, torch.device("cpu")), condition_mask(3, 3, 2, 2, torch.device("cpu"))
    assert first.shape == (1, 4, 3, 2, 2)
    assert torch.all(first[:, :, 0] == 1) and torch.all(first[:, :, 1:] == 0) and torch.all(later == 0)


def test_blocks_equal_the_whole_clip_and_the_fixed_point_is_reused(vae, fast_cpu, image, whole) -> None:
    encoder = StreamingConditionEncoder(vae, fast_cpu=fast_cpu)
    state = encoder.start(image)
    streamed = torch.cat([encoder.encode_next(state, 3) for _ in range(LATENT_FRAMES // 3)], dim=2)
    assert streamed.shape == whole.shape == (1, 4, LATENT_FRAMES, 3, 4)
    assert torch.equal(streamed, whole)
    assert state.steady is not None and state.feature_cache is None  # the cache is freed at the fixed point
    assert state.stats["reused"] > 0 and state.stats["encoded"] + state.stats["reused"] == LATENT_FRAMES
    # The reused latent is what encoding gives: equal to the reference's last frames.
    reused = state.stats["reused"]
    assert all(torch.equal(whole[:, :, -1 - i], state.steady[:, :, 0]) for i in range(reused))


def test_first_block_encodes_only_its_own_frames(vae, fast_cpu, image, whole) -> None:
    encoder = StreamingConditionEncoder(vae, max_probe_chunks=2, fast_cpu=fast_cpu)
    state = encoder.start(image)
    assert torch.equal(encoder.encode_next(state, 3), whole[:, :, :3])
    assert state.stats["encoded"] == 3
    assert torch.equal(encoder.encode_next(state, 5), whole[:, :, 3:8]) and state.steady is None
