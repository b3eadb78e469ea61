"""Start-up validation fails with a clear message before any weight is read; request validation too."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import backend.engine.parts
from backend.engine.geometry import VideoGeometry, sizes_near
from backend.engine.rollout import WorldModelEngine
from backend.engine.validation import checked_spec
from backend.model.kv_cache import SelfAttentionCache
from backend.model.layout import CheckpointLayout
from backend.api.errors import ConfigError, InputError
from backend.parallel.sequence import SequenceParallel
from backend.api.codec import parse_request, request_arrays, request_parameters
from backend.api.contract import CAMERA_POSES, IMAGE
from backend.serving.admission import Admission
from backend.serving.settings import ServingSettings
from factories import forward_poses, tiny_settings, tiny_request


class FakeGroup(SequenceParallel):
    """A world size without processes: validation needs only the number."""

    def __init__(self, degree: int) -> None:
        super().__init__()
        self.degree = degree


@pytest.fixture()
def unreadable_checkpoint(tiny_checkpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A copy of the checkpoint whose weight files are garbage, with every loader made to fail loudly."""
    root = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, root)
    for weights in root.rglob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a weight file was opened before validation finished")

    monkeypatch.setattr(backend.engine.parts, "load_transformer", refuse)
    for name in ("load_text_encoder", "load_vae"):
        monkeypatch.setattr(CheckpointLayout, name, refuse)
    monkeypatch.setattr("backend.model.checkpoint.read_tensor", refuse)
    monkeypatch.setattr("backend.model.weight_files.read_header", refuse)
    return str(root)


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        ({"sp_degree": 3}, 3, r"num_heads=4 is not divisible by tp_degree x sp_degree = 1 x 3 = 3"),
        ({"tp_degree": 3}, 1, r"num_heads=4 is not divisible by tp_degree x sp_degree = 3 x 1 = 3"),
        ({"tp_degree": 2}, 1, r"tp_degree x sp_degree = 2 x 1 = 2 must equal the process group's world size 1"),
        ({"tp_degree": 2, "sp_degree": 2}, 2, r"tp_degree x sp_degree = 2 x 2 = 4 must equal .* world size 2"),
        ({"tp_degree": 4, "sp_degree": 2}, 8, r"num_heads=4 is not divisible by tp_degree x sp_degree = 4 x 2 = 8"),
        ({"sp_degree": 2, "default_height": 16, "default_width": 16}, 2,
         r"block token count 3 .* not divisible by sp_degree=2; sizes near it that are: 16 x 32, 32 x 16, 32 x 32"),
        ({"sp_mode": "ring"}, 1, r"mode 'ring' is not supported"),
        ({"sp_mode": "all_gather"}, 1, r"mode 'all_gather' is not supported"),
        ({"sp_mode": "a2a_permute"}, 1, r"mode 'a2a_permute' is not supported"),
        ({"sp_mode": "zigzag"}, 1, r"unknown sequence-parallel mode 'zigzag'"),
        ({"sp_degree": 4}, 2, r"sp_degree=4 is larger than the process group's world size 2"),
        ({"default_height": 72}, 1, r"width x height = 64 x 72: each must be a positive multiple of the VAE x patch factor"),
        ({"dtype": "int8"}, 1, r"dtype='int8'"),
        ({"cpu_vae_kernels": "mkl"}, 1, r"cpu_vae_kernels='mkl'; supported: \['onednn', 'torch'\]"),
        ({"window_frames": 5, "sink_frames": 3}, 1,
         r"window_frames=5 \(parameter\) must hold sink_frames=3 \(parameter\) plus one block of block_frames=3 "
         r"\(sink_frames from 0 to "
         r"window_frames - block_frames = 2\)"),
        ({"block_frames": -1}, 1, r"block_frames=-1 and denoise_steps=4 must be >= 1"),  # 0: the checkpoint's
        ({"denoise_steps": 0}, 1, r"block_frames=3 and denoise_steps=0 must be >= 1"),
        ({"denoise_steps": 3}, 1, r"denoise_steps=3 must divide the 1000 training timesteps"),
        ({"window_frames": 2, "sink_frames": 0}, 1,
         r"window_frames=2 \(parameter\) must hold sink_frames=0 \(parameter\) plus one block"),
    ],
)
def test_config_errors_before_weights(
    unreadable_checkpoint: str, overrides: dict, world: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        WorldModelEngine.load(tiny_settings(unreadable_checkpoint, **overrides), FakeGroup(world))


@pytest.mark.parametrize("overrides", [{"block_frames": 1}, {"denoise_steps": 1}, {"denoise_steps": 1000}])
def test_the_smallest_block_and_the_fewest_or_most_steps_are_accepted(unreadable_checkpoint: str,
                                                                       overrides: dict) -> None:
    spec = checked_spec(tiny_settings(unreadable_checkpoint, **overrides), 1)
    assert all(getattr(spec.settings, name) == value for name, value in overrides.items())


def test_missing_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        WorldModelEngine.load(tiny_settings(str(tmp_path / "nowhere")))
    (tmp_path / "model_index.json").write_text('{"transformer": ["backend", "WanModelFast"]}')
    with pytest.raises(ConfigError, match=r"partial diffusers layout .*missing \['text_encoder', 'tokenizer', "
                                          r"'transformer', 'vae'\]"):
        WorldModelEngine.load(tiny_settings(str(tmp_path)))


def test_mismatched_weights_are_reported(tiny_checkpoint: str, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, root)
    config_path = root / "transformer" / "config.json"
    config_path.write_text(config_path.read_text().replace('"num_layers": 2', '"num_layers": 3'))
    with pytest.raises(ConfigError, match=r"missing 35 \[blocks\.2\."):
        WorldModelEngine.load(tiny_settings(str(root)))


def bad_poses(kind: str) -> np.ndarray:
    poses = forward_poses(9)
    if kind == "nan":
        poses[3, 0, 3] = np.nan
    elif kind == "inf":
        poses[1, 1, 1] = np.inf
    elif kind == "not_rotation":
        poses[2, :3, :3] *= 2.0
    elif kind == "last_row":
        poses[0, 3] = [1.0, 0.0, 0.0, 1.0]
    return poses


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_frames": 10, "poses": forward_poses(10)}, r"num_frames=10 must be 1 \+ 4 x k"),
        ({"num_frames": 13, "poses": forward_poses(13)}, r"gives 4 latent frames, not a multiple of block_frames=3"),
        ({"num_frames": 2000, "poses": forward_poses(2000)}, r"num_frames=2000 must be between 1 and max_frames"),
        ({"height": 40}, r"width x height = 64 x 40: each must be a positive multiple"),
        ({"height": 1 << 20}, r"width x height = 64 x 1048576 = 67108864 pixels is more than max_pixels=1638400"),
        ({"prompt": "   "}, r"prompt is empty"),
        ({"image": np.zeros((64, 64), np.uint8)}, r"image must be UINT8 \[H, W, 3\]"),
        ({"image": np.zeros((64, 64, 3), np.float32)}, r"input 'image' must be uint8; got float32"),
        ({"poses": forward_poses(5)}, r"camera_poses must be FP32 \[9, 4, 4\]; got float32 \[5, 4, 4\]"),
        ({"poses": forward_poses(9).astype(np.float64)}, r"input 'camera_poses' must be float32; got float64"),
        ({"poses": bad_poses("nan")}, r"NaN or Inf"),
        ({"poses": bad_poses("inf")}, r"NaN or Inf"),
        ({"poses": bad_poses("not_rotation")}, r"camera_poses\[2\]: the 3x3 block is not a rotation"),
        ({"poses": bad_poses("last_row")}, r"last row of every 4x4 pose"),
        ({"intrinsics": np.ones((9, 3), np.float32)}, r"camera_intrinsics must be FP32 \[n, 4\]"),
        ({"intrinsics": -np.ones((9, 4), np.float32)}, r"fx, fy > 0"),
    ],
)
def test_request_errors(engine: WorldModelEngine, overrides: dict, message: str) -> None:
    """Through the one path a served request takes: its inputs parsed as they arrive (their dtypes as sent),
    then the owner's admission step."""
    request = tiny_request(num_frames=9, **{k: v for k, v in overrides.items() if k != "num_frames"})
    if "num_frames" in overrides:
        request.num_frames = overrides["num_frames"]
    arrays = request_arrays(request) | {IMAGE: request.image, CAMERA_POSES: request.poses}
    with pytest.raises(InputError, match=message):
        Admission(ServingSettings(), engine.spec).session(parse_request(arrays.get, json.dumps(request_parameters(request))),
                                                        "s", 0)


def reference_visible_frames(window: int, sink: int, block: int, blocks: int, forwards: int) -> list[list[float]]:
    """The frames each forward attends to under the reference's cache (model_fast.py's CausalWanSelfAttention,
    one token per frame): evict on a new block's first write when it does not fit, keep the sink, roll the rest."""
    cache = np.zeros(window)
    global_end = local_end = 0
    seen = []
    for b in range(blocks):
        start, end = b * block, (b + 1) * block
        for step in range(forwards):
            evicted = 0
            if end > global_end and block + local_end > window:
                evicted = block + local_end - window
                rolled = local_end - evicted - sink
                cache[sink:sink + rolled] = cache[sink + evicted:sink + evicted + rolled].copy()
            local_end = local_end + end - evicted - global_end
            cache[local_end - block:local_end] = np.arange(start, end) + step / 10  # this forward's K
            seen.append(cache[:local_end].tolist())
            global_end = end
    return seen


@pytest.mark.parametrize(("window", "sink"), [(6, 3), (18, 6), (7, 2), (3, 0), (9, 6), (18, 0)])
def test_every_reference_geometry_is_accepted_and_cached_as_the_reference_does(
    unreadable_checkpoint: str, window: int, sink: int
) -> None:
    spec = checked_spec(tiny_settings(unreadable_checkpoint, window_frames=window, sink_frames=sink), 1)
    assert (spec.window_frames, spec.sink_frames) == (window, sink)

    block, blocks, forwards = 3, 8, 5  # 4 denoising steps and the commit
    cache = SelfAttentionCache(1, window, block, sink, 1, 1, torch.float64, torch.device("cpu"))
    seen = []
    for b in range(blocks):
        cache.make_room()
        for step in range(forwards):
            k = torch.arange(b * block, (b + 1) * block, dtype=torch.float64).view(1, block, 1, 1) + step / 10
            keys, _ = cache.layer(0).attend_over(k, k)
            seen.append(keys.flatten().tolist())
        cache.commit()
    assert seen == reference_visible_frames(window, sink, block, blocks, forwards)


@pytest.mark.parametrize("sp", [2, 4, 8])
def test_the_sp_size_error_names_near_sizes_that_work(sp: int) -> None:
    near = sizes_near(48, 48, 16, 16, block_frames=3, sp=sp)
    assert len(near) == 3
    for width, height in near:
        assert width % 16 == 0 and height % 16 == 0 and (3 * (width // 16) * (height // 16)) % sp == 0
        assert abs(width - 48) + abs(height - 48) <= 2 * sp * 16


@pytest.mark.parametrize(("num_frames", "blocks"), [(0, None), (1, 1), (2, None), (4, None), (5, 2), (9, 3)])
def test_one_latent_frame_a_block_takes_every_1_plus_4k_frames(engine: WorldModelEngine, num_frames: int,
                                                                blocks: int | None) -> None:
    """block_frames=1, the smallest block: a 1-frame clip is one block, each 4 frames more another."""
    settings = dataclasses.replace(engine.settings, block_frames=1)
    if blocks is None:
        with pytest.raises(InputError, match=f"num_frames={num_frames} must be 1 \\+ 4 x k"):
            VideoGeometry.build(settings, engine.ckpt, 64, 64, num_frames, error=InputError)
    else:
        assert VideoGeometry.build(settings, engine.ckpt, 64, 64, num_frames, error=InputError).num_blocks == blocks


@pytest.mark.parametrize(("width", "height", "sp"), [(48, 48, 8), (16, 16, 8), (16, 112, 8), (112, 16, 8), (112, 80, 16),
                                                     (48, 16, 32)])
def test_the_near_sizes_are_the_nearest(width: int, height: int, sp: int) -> None:
    """Against every size of up to 64 patches a side: none that works is nearer than the ones named."""
    def distance(size: tuple[int, int]) -> int:
        return abs(size[0] - width) + abs(size[1] - height)

    near = sizes_near(width, height, 16, 16, block_frames=3, sp=sp)
    works = [(16 * w, 16 * h) for w in range(1, 65) for h in range(1, 65) if (3 * w * h) % sp == 0]
    assert sorted(map(distance, near)) == sorted(map(distance, works))[:3]


def test_ffn_width_not_divisible_by_tp_is_named(unreadable_checkpoint: str) -> None:
    config_path = Path(unreadable_checkpoint) / "transformer" / "config.json"
    config_path.write_text(config_path.read_text().replace('"ffn_dim": 128', '"ffn_dim": 130'))
    with pytest.raises(ConfigError, match=r"ffn_dim=130 is not divisible by tp_degree=4 \(FFN column split\)"):
        WorldModelEngine.load(tiny_settings(unreadable_checkpoint, tp_degree=4), FakeGroup(4))
