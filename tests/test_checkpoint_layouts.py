"""Both downloads served as they are: the official layout (transformers/, Wan2.1_VAE.pth, umT5 .pth, google/umt5-xxl)
and the diffusers one, detected from the files, with every setting's value and source."""
from __future__ import annotations

import dataclasses
import shutil
import urllib.request
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from backend.api.errors import ConfigError, InputError
from backend.engine.rollout import WorldModelEngine
from backend.engine.validation import checked_spec, describe_settings
from backend.model.config import read_checkpoint_configs
from backend.model.layout_official import OFFICIAL
from backend.model.layouts import resolve_layout
from backend.model.official_checkpoint import official_copy
from backend.model.pth_files import read_pth_index, read_pth_tensors
from backend.model.tiny_checkpoint import write_checkpoint
from backend.serving.settings import ServingSettings
from backend.launch.local_group import LocalGroup
from client.recording import RecordedBlock, Recording
from client.replay import replay_whole
from client.stream import StreamError
from factories import forward_poses, sample_image, tiny_settings, tiny_request
from client.__main__ import main as client_main
from triton_harness import latents_of, running_server, stream

pytestmark = pytest.mark.server  # starts real tritonservers and groups of local processes

UNSET = {"block_frames": 0, "timestep_shift": 0.0, "window_frames": 0, "sink_frames": -1}


@pytest.fixture(scope="module")
def both_layouts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same random weights (tiny16: Wan's 16 latent channels) in the diffusers and the official layout."""
    root = tmp_path_factory.mktemp("layouts")
    diffusers = write_checkpoint(root / "diffusers", "tiny16", seed=3)
    return diffusers, official_copy(diffusers, root / "official")


def copy_without(source: Path, tmp: Path, part: str) -> Path:
    root = tmp / "partial"
    shutil.copytree(source, root)
    target = root / part
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    return root


def test_each_layout_is_detected_and_a_partial_one_is_refused_naming_what_it_lacks(both_layouts, tmp_path) -> None:
    diffusers, official = both_layouts
    assert resolve_layout(str(diffusers)).kind.name == "diffusers"
    layout = resolve_layout(str(official))
    assert layout.kind.name == "official" and layout.vae.name == "Wan2.1_VAE.pth"
    with pytest.raises(ConfigError, match=r"partial official layout .*missing \['Wan2.1_VAE.pth'\]"):
        resolve_layout(str(copy_without(official, tmp_path / "a", OFFICIAL.parts["vae"])))
    with pytest.raises(ConfigError, match=r"partial official layout .*missing \['google/umt5-xxl'\]"):
        resolve_layout(str(copy_without(official, tmp_path / "b", "google/umt5-xxl")))
    with pytest.raises(ConfigError, match=r"partial diffusers layout .*missing \['text_encoder'\]"):
        resolve_layout(str(copy_without(diffusers, tmp_path / "c", "text_encoder")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds neither layout"):
        resolve_layout(str(tmp_path / "empty"))


def test_pth_reader_gives_every_tensor_exactly_through_one_reused_buffer(tmp_path: Path) -> None:
    state = {"w": torch.randn(3, 4), "t": torch.randn(4, 3).t(), "b": torch.randn(7).bfloat16(),
             "p": torch.nn.Parameter(torch.ones(2)), "i": torch.arange(5)}
    torch.save(state, tmp_path / "x.pth")
    index = read_pth_index(tmp_path / "x.pth")
    storages = set()
    for name, tensor in read_pth_tensors(tmp_path / "x.pth", index, list(index)):
        assert tensor.dtype == state[name].dtype and torch.equal(tensor, state[name].detach())
        storages.add(tensor.untyped_storage().data_ptr())
    assert len(storages) == 1  # one buffer, the size of the largest tensor: never the whole file
    torch.save({"w": torch.ones(1), "x": Fraction(1, 2)}, tmp_path / "code.pth")
    with pytest.raises(ConfigError, match=r"holds fractions.Fraction, not a plain state dict"):
        read_pth_index(tmp_path / "code.pth")


def rewrite_pth(path: Path, change) -> None:
    state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)


@pytest.mark.parametrize(
    ("part", "change", "message"),
    [
        ("vae", lambda s: s.update({"decoder.extra.weight": torch.ones(1)}), r"unknown 1 \[decoder.extra.weight\]"),
        ("vae", lambda s: s.pop("decoder.head.2.bias"), r"missing 1 \[decoder.head.2.bias\]"),
        ("vae", lambda s: s.update({"decoder.head.2.bias": torch.ones(4)}),
         r"decoder.head.2.bias has shape \[4\], decoder.conv_out.bias needs \[3\]"),
        ("text_encoder", lambda s: s.pop("blocks.1.ffn.gate.0.weight"), r"missing 1 \[blocks.1.ffn.gate.0.weight\]"),
        ("text_encoder", lambda s: s.update({"blocks.0.attn.q.bias": torch.ones(32)}),
         r"unknown 1 \[blocks.0.attn.q.bias\]"),
        ("text_encoder", lambda s: s.update({"norm.weight": torch.ones(31)}),
         r"norm.weight has shape \[31\], encoder.final_layer_norm.weight needs \[32\]"),
    ],
)
def test_official_name_maps_are_strict(both_layouts, tmp_path: Path, part: str, change, message: str) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(both_layouts[1], root)
    layout = resolve_layout(str(root))
    rewrite_pth(getattr(layout, part), change)
    load = layout.load_vae if part == "vae" else layout.load_text_encoder
    with pytest.raises(ConfigError, match=message):
        load(torch.float32, torch.device("cpu"))


def test_the_same_weights_in_both_layouts_load_alike_and_give_bit_identical_latents(both_layouts) -> None:
    diffusers, official = (resolve_layout(str(p)) for p in both_layouts)
    cpu = torch.device("cpu")
    vaes = [layout.load_vae(torch.float32, cpu) for layout in (diffusers, official)]
    assert vaes[0].config.latents_mean == vaes[1].config.latents_mean
    for (name, a), b in zip(vaes[0].state_dict().items(), vaes[1].state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    # The official umT5 is published in bfloat16: both layouts agree once served in bfloat16.
    encoders = [layout.load_text_encoder(torch.bfloat16, cpu)[0] for layout in (diffusers, official)]
    for (name, a), b in zip(encoders[0].state_dict().items(), encoders[1].state_dict().values()):
        assert torch.equal(a, b), name
    assert encoders[1].encoder.embed_tokens.weight.data_ptr() == encoders[1].shared.weight.data_ptr()  # tied

    settings = dict(block_frames=4, timestep_shift=10.0, window_frames=12, sink_frames=2, dtype="bfloat16")
    latents = []
    for root in both_layouts:
        engine = WorldModelEngine.load(tiny_settings(str(root), **settings))
        request = tiny_request(num_frames=61, decode=False)  # 4 blocks: the window slides
        session = engine.open_session(request, engine.geometry_of(request))
        blocks = []
        while not session.done:
            blocks += engine.run_block([session])
        assert session.cache.evicted_tokens > 0
        latents.append(torch.cat([b.latents for b in blocks], dim=2))
    assert latents[0].shape == (1, 16, 16, 8, 8) and torch.equal(latents[0], latents[1])


def test_each_layout_defaults_to_its_own_source_and_a_parameter_wins(both_layouts) -> None:
    diffusers, official = (str(p) for p in both_layouts)
    spec = checked_spec(tiny_settings(official, **UNSET), 1)
    assert {k: (s.value, s.source.split(" (")[0]) for k, s in spec.sources.items()} == {
        "block_frames": (4, "official script default"), "timestep_shift": (10.0, "official script default"),
        "window_frames": (18, "official script default"), "sink_frames": (6, "official script default"),
    }
    assert "run_fast.sh --sink_size" in spec.sources["sink_frames"].source
    assert (spec.settings.block_frames, spec.shift, spec.window_frames, spec.sink_frames) == (4, 10.0, 18, 6)
    spec = checked_spec(tiny_settings(diffusers, **UNSET), 1)
    assert {k: s.value for k, s in spec.sources.items()} == {
        "block_frames": 3, "timestep_shift": 5.0, "window_frames": 9, "sink_frames": 3}
    assert spec.sources["window_frames"].source.endswith("transformer/config.json local_attn_size")
    assert spec.sources["timestep_shift"].source.endswith("scheduler/scheduler_config.json shift")
    assert spec.sources["block_frames"].source.startswith("diffusers layout default")
    spec = checked_spec(tiny_settings(official, **{**UNSET, "block_frames": 3, "sink_frames": 3}), 1)
    assert (spec.sources["block_frames"].source, spec.sources["sink_frames"].source) == ("parameter", "parameter")
    assert spec.settings.block_frames == 3 and spec.sources["window_frames"].value == 18
    assert describe_settings(spec)[0] == "block_frames = 3 (parameter)"


def test_a_global_window_in_the_checkpoint_is_served_as_global_attention(tiny_checkpoint: str, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, root)
    config = root / "transformer" / "config.json"
    config.write_text(config.read_text().replace('"local_attn_size": 9', '"local_attn_size": -1'))
    assert read_checkpoint_configs(resolve_layout(str(root))).settings["window_frames"].value == -1
    engine = WorldModelEngine.load(tiny_settings(str(root), window_frames=0, sink_frames=-1))
    assert engine.window_frames == -1 and any("global attention" in line for line in describe_settings(
        checked_spec(engine.settings, 1)))
    request = tiny_request(num_frames=45, decode=False)  # 4 blocks, 12 latent frames
    session = engine.open_session(request, engine.geometry_of(request))
    assert session.cache.capacity == 12 * 16
    while not session.done:
        engine.run_block([session])
    assert session.cache.evicted_tokens == 0  # every frame stayed in view
    with pytest.raises(InputError, match=r"window_frames=-1 \(global attention\).*'max_blocks' > 0"):
        engine.geometry_of(dataclasses.replace(tiny_request(num_frames=9), num_frames=None))  # steered, open-ended


def setting_metrics(server) -> dict[str, tuple[float, str]]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    found = {}
    for line in text.splitlines():
        if line.startswith("lingbot_world_setting{"):
            labels, value = line.rsplit(" ", 1)
            fields = dict(part.split("=", 1) for part in labels[labels.index("{") + 1 : -1].split('",'))
            found[fields["setting"].strip('"')] = (float(value), fields["source"].strip('"'))
    return found


def diffusers_recording() -> Recording:
    """A one-block recording made on the diffusers tiny checkpoint's settings (as the shared servers run it)."""
    settings = "block_frames=3;denoise_steps=4;dtype=float32;sink_frames=3;timestep_shift=5.0;window_frames=9"
    return Recording(sample_image(), "a castle", 42, 64, 64, settings, None, [RecordedBlock(forward_poses(9), "0" * 64)])


@pytest.mark.slow  # the official layout's engine is also tested in this module, on one rank
def test_the_official_download_serves_4_frame_blocks_at_sp1_and_sp2(both_layouts, tmp_path: Path, capsys) -> None:
    """The official layout's own settings (4 latent frames a block, shift 10, window 18, sink 6): through Triton
    at SP1 (its metrics say them, a replay on other settings is refused), and in a group of two at SP2."""
    request = tiny_request(num_frames=77)  # 5 blocks of 4 latent frames: 13 video frames, then 16 each
    with running_server(tmp_path, str(both_layouts[1]), sp=1, window_frames="0", sink_frames="-1") as server:
        blocks = {1: stream(server.grpc_url, request, timeout=240)}
        shown = setting_metrics(server)
        log = server.log_path.read_text(errors="replace")
        with pytest.raises(StreamError, match=r"block_frames: expected 3, this server 4; sink_frames: expected "
                           r"3, this server 6; timestep_shift: expected 5.0, this server 10.0; window_frames"):
            replay_whole(diffusers_recording(), server.grpc_url, "lingbot_world", False, 60)
        # The client needs no flag for this layout: the server describes its 4-frame blocks and its size
        assert client_main(["--url", server.grpc_url, "--prompt", "a castle", "--camera", "forward", "--no-decode",
                            "--out", str(tmp_path / "cli.mp4"), "--timeout", "240"]) == 0
        assert "77 frames at 64x64" in capsys.readouterr().out
    settings = tiny_settings(str(both_layouts[1]), sp_degree=2, window_frames=0, sink_frames=-1)
    with LocalGroup(settings, ServingSettings(max_batch=1), ranks=2) as group:
        blocks[2] = group.stream(request, rank=1, timeout_s=240)
    for sp, served in blocks.items():
        assert [b.frames.shape[0] for b in served] == [13, 16, 16, 16, 16], sp
        assert all(b.latents.shape == (16, 4, 8, 8) for b in served)
    assert np.array_equal(latents_of(blocks[1]), np.concatenate([b.latents for b in blocks[2]], axis=1))
    assert {k: v[0] for k, v in shown.items()} == {
        "block_frames": 4, "timestep_shift": 10.0, "window_frames": 18, "sink_frames": 6}
    assert shown["window_frames"][1] == "official script default (run_fast.sh --local_attn_size)"
    assert "setting block_frames = 4 (official script default (generate.py --chunk_size))" in log
