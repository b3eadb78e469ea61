"""Start-up validation fails with a clear message before any weight is read; request validation too."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import backend.engine.rollout
from backend.engine.rollout import WorldModelEngine
from backend.api.errors import ConfigError, InputError
from backend.parallel.sequence import SequenceParallel
from backend.serving.config import ServingConfig
from factories import forward_poses, tiny_config, tiny_request


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

    for name in ("load_transformer", "load_text_encoder", "load_vae"):
        monkeypatch.setattr(backend.engine.rollout, name, refuse)
    monkeypatch.setattr("backend.model.checkpoint.read_tensor", refuse)
    monkeypatch.setattr("backend.model.weight_files.read_header", refuse)
    return str(root)


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        ({"sp_degree": 3}, 3, r"num_heads=4 is not divisible by tp_degree x sp_degree = 1 x 3 = 3"),
        ({"tp_degree": 3}, 1, r"num_heads=4 is not divisible by tp_degree x sp_degree = 3 x 1 = 3"),
        ({"tp_degree": 2}, 1, r"tp_degree=2: tensor parallelism is not supported"),
        ({"sp_degree": 2, "default_height": 16, "default_width": 16}, 2,
         r"block token count 3 .* not divisible by sp_degree=2"),
        ({"sp_mode": "ring"}, 1, r"mode 'ring' is not supported"),
        ({"sp_mode": "all_gather"}, 1, r"mode 'all_gather' is not supported"),
        ({"sp_mode": "a2a_permute"}, 1, r"mode 'a2a_permute' is not supported"),
        ({"sp_mode": "zigzag"}, 1, r"unknown sequence-parallel mode 'zigzag'"),
        ({"sp_degree": 4}, 2, r"sp_degree=4 is larger than the process group's world size 2"),
        ({"default_height": 72}, 1, r"height x width = 72 x 64 must be positive multiples of VAE x patch factors"),
        ({"dtype": "int8"}, 1, r"dtype='int8'"),
        ({"window_frames": 5}, 1, r"window_frames=5 \(parameter\) must hold sink_frames=3 \(parameter\) plus two blocks"),
    ],
)
def test_config_errors_before_weights(
    unreadable_checkpoint: str, overrides: dict, world: int, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        WorldModelEngine.load(tiny_config(unreadable_checkpoint, **overrides), FakeGroup(world))


def test_missing_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        WorldModelEngine.load(tiny_config(str(tmp_path / "nowhere")))
    (tmp_path / "model_index.json").write_text('{"transformer": ["backend", "WanModelFast"]}')
    with pytest.raises(ConfigError, match=r"partial diffusers layout .*missing \['text_encoder', 'tokenizer', "
                                          r"'transformer', 'vae'\]"):
        WorldModelEngine.load(tiny_config(str(tmp_path)))


def test_mismatched_weights_are_reported(tiny_checkpoint: str, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, root)
    config_path = root / "transformer" / "config.json"
    config_path.write_text(config_path.read_text().replace('"num_layers": 2', '"num_layers": 3'))
    with pytest.raises(ConfigError, match=r"missing 35 \[blocks\.2\."):
        WorldModelEngine.load(tiny_config(str(root)))


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
        ({"height": 40}, r"height x width = 40 x 64 must be positive multiples"),
        ({"height": 1 << 20}, r"height x width = 1048576 x 64 is more than max_pixels=1638400"),
        ({"prompt": "   "}, r"prompt is empty"),
        ({"image": np.zeros((64, 64), np.uint8)}, r"image must be UINT8 \[H, W, 3\]"),
        ({"image": np.zeros((64, 64, 3), np.float32)}, r"image must be UINT8"),
        ({"poses": forward_poses(5)}, r"camera_poses must be FP32 \[9, 4, 4\]; got float32 \[5, 4, 4\]"),
        ({"poses": forward_poses(9).astype(np.float64)}, r"camera_poses must be FP32"),
        ({"poses": bad_poses("nan")}, r"NaN or Inf"),
        ({"poses": bad_poses("inf")}, r"NaN or Inf"),
        ({"poses": bad_poses("not_rotation")}, r"camera_poses\[2\]: the 3x3 block is not a rotation"),
        ({"poses": bad_poses("last_row")}, r"last row of every 4x4 pose"),
        ({"intrinsics": np.ones((9, 3), np.float32)}, r"camera_intrinsics must be FP32 \[n, 4\]"),
        ({"intrinsics": -np.ones((9, 4), np.float32)}, r"fx, fy > 0"),
    ],
)
def test_request_errors(engine: WorldModelEngine, overrides: dict, message: str) -> None:
    request = tiny_request(num_frames=9, **{k: v for k, v in overrides.items() if k != "num_frames"})
    if "num_frames" in overrides:
        request.num_frames = overrides["num_frames"]
    with pytest.raises(InputError, match=message):
        ServingConfig().check_limits(request)  # the serving layer's limits first, as the group loop does
        engine.validate(request)
