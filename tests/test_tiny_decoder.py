"""The tiny decoder (decoder=tiny, backend/model/tiny_vae.py) on random weights in the published taew2_1.pth
layout: it loads that layout (and refuses others by name), streams block by block exactly as it decodes a whole
clip, gives the Wan VAE's frame counts per block, and serves through the engine with its setting recorded."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan

from backend.api.errors import ConfigError, InputError
from backend.api.provenance import parse_settings
from backend.engine.rollout import WorldModelEngine
from backend.model.tiny_checkpoint import write_checkpoint
from backend.model.tiny_vae import StreamingTinyDecoder, load_tiny_decoder
from backend.model.tiny_vae_weights import published_layout, write_weights
from backend.model.vae import StreamingVae
from factories import sample_image, tiny_settings, tiny_request

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = torch.device("cpu")

# Shapes of taew2_1.pth as taehv.py's TAEHV(latent_channels=16, patch_size=1) names them: first and last layers,
# a memory block, and the three time-grow convolutions (stride 1, 2, 2).
PUBLISHED_SHAPES = {
    "encoder.0.weight": (64, 3, 3, 3), "encoder.2.conv.weight": (64, 128, 1, 1), "encoder.12.conv.weight": (64, 64, 1, 1),
    "encoder.17.weight": (16, 64, 3, 3), "encoder.17.bias": (16,),
    "decoder.1.weight": (256, 16, 3, 3), "decoder.3.conv.0.weight": (256, 512, 3, 3), "decoder.3.conv.4.bias": (256,),
    "decoder.7.conv.weight": (256, 256, 1, 1), "decoder.8.weight": (128, 256, 3, 3),
    "decoder.13.conv.weight": (256, 128, 1, 1), "decoder.19.conv.weight": (128, 64, 1, 1),
    "decoder.20.weight": (64, 64, 3, 3), "decoder.22.weight": (3, 64, 3, 3), "decoder.22.bias": (3,),
}


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_weights(Path(tmp_path_factory.mktemp("taehv")) / "taew2_1.pth")


@pytest.fixture(scope="module")
def tiny(weights: Path) -> StreamingTinyDecoder:
    return StreamingTinyDecoder(load_tiny_decoder(weights, CPU), CPU)


def test_the_published_layout_loads_and_others_are_refused_by_name(weights: Path, tmp_path: Path) -> None:
    layout = published_layout()
    assert {k: tuple(layout[k]) for k in PUBLISHED_SHAPES} == PUBLISHED_SHAPES
    assert len(layout) == 128 and sum(s.numel() for s in layout.values()) == 11_315_539
    state = torch.load(weights, weights_only=True)
    assert {k: v.shape for k, v in state.items()} == layout  # the writer writes the encoder's keys too
    safetensors = write_weights(tmp_path / "taew2_1.safetensors")
    for path in (weights, safetensors):
        decoder = load_tiny_decoder(path, CPU)
        assert torch.equal(decoder.state_dict()["decoder.22.weight"], state["decoder.22.weight"])
    grown = dict(state, **{"decoder.7.conv.weight": torch.randn(512, 256, 1, 1)})  # trained to grow time there too
    torch.save(grown, tmp_path / "grown.pth")
    kept = load_tiny_decoder(tmp_path / "grown.pth", CPU).state_dict()["decoder.7.conv.weight"]
    assert torch.equal(kept, grown["decoder.7.conv.weight"][256:])  # the last new frame's channels
    wan22 = dict(state, **{"decoder.1.weight": torch.zeros(256, 48, 3, 3)})  # taew2_2: 48 latent channels
    cases = {"lacks": {k: v for k, v in state.items() if k != "decoder.14.weight"}, "48 latent channels": wan22,
             "this layout lacks": dict(state, **{"decoder.23.weight": torch.zeros(1)})}
    for why, case in cases.items():
        torch.save(case, tmp_path / "bad.pth")
        with pytest.raises(ConfigError, match=f"bad.pth.*{why}"):
            load_tiny_decoder(tmp_path / "bad.pth", CPU)
    (tmp_path / "text.pth").write_text("not weights")
    with pytest.raises(ConfigError, match="text.pth.*cannot read it"):
        load_tiny_decoder(tmp_path / "text.pth", CPU)


@pytest.mark.timeout(120)
def test_streamed_blocks_equal_the_whole_clip_and_the_vae_frame_counts(tiny: StreamingTinyDecoder) -> None:
    generator = torch.Generator().manual_seed(1)
    clip = torch.randn(1, 16, 5, 2, 2, generator=generator)  # 16x16 frames; blocks of 3 and 2, or 1 latent frame
    whole = tiny.decode_block(clip, tiny.new_decode_state())
    assert whole.shape == (17, 16, 16, 3) and whole.dtype == np.uint8
    assert whole.std() > 10 and np.mean((whole == 0) | (whole == 255)) < 0.5  # random weights, not saturated
    torch.manual_seed(0)
    vae = StreamingVae(AutoencoderKLWan(base_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1, z_dim=16,
                                        temperal_downsample=[False, True, True]).eval(), CPU)
    for sizes in ((3, 2), (1,) * 5):
        tiny_state, vae_state, start, counts = tiny.new_decode_state(), vae.new_decode_state(), 0, []
        streamed = []
        for size in sizes:
            block = clip[:, :, start : start + size]
            streamed.append(tiny.decode_block(block, tiny_state))
            counts.append(len(vae.decode_block(block, vae_state)))
            start += size
        assert [len(f) for f in streamed] == counts  # 4k - 3 frames, then 4k: as the Wan VAE's
        # Frames batched differently round differently in the convolutions' last bits: a gray level, rarely.
        diff = np.abs(np.concatenate(streamed).astype(int) - whole)
        assert diff.max() <= 1 and np.mean(diff > 0) < 1e-3


@pytest.fixture(scope="module")
def wan21_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_checkpoint(Path(tmp_path_factory.mktemp("ckpt16")) / "tiny16", "tiny16", seed=0))


@pytest.mark.timeout(120)
def test_the_engine_decodes_with_it_and_records_it(wan21_checkpoint: str, tiny_checkpoint: str, weights: Path,
                                                   tiny: StreamingTinyDecoder) -> None:
    settings = tiny_settings(wan21_checkpoint, decoder="tiny", tiny_decoder_path=str(weights))
    engine = WorldModelEngine.load(settings)
    assert engine.conditions.vae.decoder is None  # the VAE keeps its encoder only
    assert parse_settings(engine.settings_used, "settings_used")["decoder"] == "tiny"
    request = tiny_request(num_frames=21, height=32, width=32, image=sample_image(32))  # 2 blocks
    blocks = engine.generate(request)
    assert [f.shape for _, f in blocks] == [(9, 32, 32, 3), (12, 32, 32, 3)]
    state = tiny.new_decode_state()
    for out, frames in blocks:
        np.testing.assert_array_equal(frames, tiny.decode_block(out.latents, state))
    vae_settings = engine.settings_used.replace("decoder=tiny", "decoder=vae")
    with pytest.raises(InputError, match="decoder: expected vae, this server tiny"):
        engine.geometry_of(dataclasses.replace(request, expect_settings=vae_settings))
    for changes, why in (({"tiny_decoder_path": ""}, "needs tiny_decoder_path"),
                         ({"tiny_decoder_path": str(weights) + ".missing"}, "is not a file"),
                         ({"checkpoint": tiny_checkpoint}, "this checkpoint's VAE has z_dim 4"),
                         ({"decoder": "taehv"}, "supported")):
        with pytest.raises(ConfigError, match=why):
            WorldModelEngine.load(dataclasses.replace(settings, **changes))
