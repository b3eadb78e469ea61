"""Recordings without a server: what a block reports it was made from, the file's checks, the settings check,
and the one engine fact replay rests on (a whole trajectory with pose_scale=running is the steered session)."""
from __future__ import annotations

import dataclasses
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from backend.api.codec import parse_request, request_arrays, BlockResponse, BlockUsed
from backend.api.errors import InputError
from backend.api.provenance import RESULT_SETTINGS, latents_sha256, parse_settings
from backend.api.request import Controls
from backend.engine.blocks import BlockControls
from client import replay
from client.recording import MAX_BYTES, Recorder, Recording, RecordingError
from client.replay import whole_request
from factories import tiny_request

SETTINGS = "block_frames=3;denoise_steps=4;dtype=float32;sink_frames=3;timestep_shift=5.0;window_frames=9"


def steered_request(keys: str = "w", **changes):
    request = tiny_request(num_frames=9, decode=False, return_used=True)
    return dataclasses.replace(request, num_frames=None, poses=None, keys=keys, **changes)


def test_a_steered_session_replays_as_a_whole_trajectory_with_the_running_scale(engine) -> None:
    """Key changes vary the translation per frame (w, then wa: sqrt 2 more), so the clip's largest translation
    is not the first block's: only pose_scale=running gives the steered latents back, bit for bit."""
    steps = [Controls(keys="w"), None, Controls(keys="wa"), Controls(keys="d")]  # None: a held block
    with engine.session(steered_request("w")) as session:
        steered = [engine.run_block([session], {session.id: BlockControls(c)})[0] for c in steps]
    assert steered[1].held and steered[1].camera.dtype == np.float32
    assert [len(o.camera) for o in steered] == [9, 12, 12, 12]
    poses = np.concatenate([o.camera for o in steered])
    base = tiny_request(num_frames=len(poses), decode=False)
    running = [o for o, _ in engine.generate(dataclasses.replace(base, poses=poses, pose_scale="running"), False)]
    clip = [o for o, _ in engine.generate(dataclasses.replace(base, poses=poses), False)]
    for s, r in zip(steered, running):
        assert latents_sha256(s.latents[0].numpy()) == latents_sha256(r.latents[0].numpy())
        assert np.array_equal(s.camera, r.camera) and r.prompt == s.prompt
    assert not bool((steered[0].latents == clip[0].latents).all()), "the reference's clip scale must differ here"


def test_expect_settings_are_checked_before_any_work(engine) -> None:
    ours = parse_settings(engine.settings_used, "settings_used")
    assert list(ours) == list(RESULT_SETTINGS)
    request = tiny_request(num_frames=9, expect_settings=engine.settings_used)
    engine.geometry_of(request)  # its own settings pass
    other = engine.settings_used.replace(f"timestep_shift={ours['timestep_shift']}", "timestep_shift=10.0")
    with pytest.raises(InputError, match=rf"timestep_shift: expected 10.0, this server {ours['timestep_shift']}") as e:
        engine.geometry_of(dataclasses.replace(request, expect_settings=other))
    assert e.value.code == "SETTINGS_MISMATCH"
    engine.geometry_of(dataclasses.replace(request, expect_settings=SETTINGS))  # from before `decoder`: the VAE's
    with pytest.raises(InputError, match="decoder: expected tiny, this server vae"):  # frames of another decoder
        engine.geometry_of(dataclasses.replace(request, expect_settings=SETTINGS + ";decoder=tiny"))
    for bad, why in (("block_frames=3", "lacks"), ("nonsense", "not key=value"), ("tp_degree=2;" + SETTINGS, "unknown"),
                     ("x" * 600, "longer than")):
        with pytest.raises(InputError, match=why):
            engine.geometry_of(dataclasses.replace(request, expect_settings=bad))
    with pytest.raises(InputError, match="pose_scale"):
        parse_request(request_arrays(request).get, json.dumps({"pose_scale": "largest"}))


def block(index: int, prompt: str, frames: int, held: bool = False, settings: str | None = None,
          recached: bool = False) -> BlockResponse:
    camera = np.tile(np.eye(4, dtype=np.float32), (frames, 1, 1))
    camera[:, 2, 3] = np.arange(frames) * 0.05 + index
    return BlockResponse(index, 0, None, np.empty((0, 0, 0, 3), np.uint8), (), 0.0, held,
                         BlockUsed(camera, prompt, f"{index:064x}", settings, recached))


@pytest.fixture
def recording_file(tmp_path: Path) -> Path:
    recorder = Recorder(steered_request(prompt="a castle"))
    recorder.add(block(0, "a castle", 9, settings=SETTINGS))
    recorder.add(block(1, "a castle", 12, held=True))
    recorder.add(block(2, "it snows", 12))
    recorder.add(block(3, "it snows", 12))
    return recorder.save(tmp_path / "world.npz")


def test_a_recording_keeps_what_the_server_used(recording_file: Path) -> None:
    loaded = Recording.load(recording_file)
    assert [len(b.camera) for b in loaded.blocks] == [9, 12, 12, 12]
    assert [b.held for b in loaded.blocks] == [False, True, False, False]
    assert loaded.events == {2: "it snows"} and loaded.settings == SETTINGS and loaded.block_frames == 3
    assert loaded.blocks[3].camera[0, 2, 3] == np.float32(3.0) and loaded.blocks[3].latents_sha256 == f"{3:064x}"
    assert loaded.image.dtype == np.uint8 and (loaded.seed, loaded.height, loaded.width) == (42, 64, 64)
    # Small: the image once, 45 poses as float32, compressed.
    assert recording_file.stat().st_size < 64 * 64 * 3 + 45 * 64 + 4096


def test_a_recording_notes_its_snapshots_and_one_written_before_them_loads_with_none(recording_file: Path) -> None:
    recording = Recording.load(recording_file)
    recording.snapshots = {"a" * 32: 1, "b" * 32: 3}
    recording.save(recording_file)
    assert Recording.load(recording_file).snapshots == {"a" * 32: 1, "b" * 32: 3}
    assert Recording.load(Path(__file__).parent / "data" / "recording_stop29.npz").snapshots == {}
    recorder = Recorder(steered_request())
    with pytest.raises(RecordingError, match="block 0, which was not recorded"):
        recorder.note_snapshot("c" * 32, 0)
    # A save that released an older snapshot: the recording no longer offers the released one to replay from.
    recorder.recording = recording
    recorder.note_snapshot("c" * 32, 2, released="a" * 32)
    assert recording.snapshots == {"b" * 32: 3, "c" * 32: 2}


def test_a_recache_under_the_prompt_in_force_is_recorded_as_its_event_and_replays_with_it(tmp_path: Path) -> None:
    """A prompt event that repeats the prompt in force with recache on changes no prompt, yet its block's latents
    (its cache was recomputed): the server reports it (recached, the same prompt_used), the recording keeps it as
    that block's event with its recache, loads, and its step by step replay sends it again."""
    recorder = Recorder(steered_request(prompt="a castle"))
    recorder.add(block(0, "a castle", 9, settings=SETTINGS))
    recorder.add(block(1, "a castle", 12, recached=True))  # "@!a castle"
    recorder.add(block(2, "it snows", 12, recached=True))  # "@!it snows"
    recorder.add(block(3, "it snows", 12, recached=True))  # "@!it snows" again
    recorder.add(block(4, "it snows", 12))
    loaded = Recording.load(recorder.save(tmp_path / "world.npz"))
    assert [(b.event, b.recache) for b in loaded.blocks] == [(None, False), ("a castle", True), ("it snows", True),
                                                             ("it snows", True), (None, False)]
    assert replay_steps_of(loaded) == [Controls(poses=b.camera, prompt=b.event, recache=b.recache)
                                       for b in loaded.blocks[1:]]
    with pytest.raises(RecordingError, match=r"prompt events at block\(s\) \[1, 2, 3\].*--steps"):
        whole_request(loaded, decode=False)  # a recache changes latents: one whole trajectory cannot carry it


def replay_steps_of(recording: Recording) -> list[Controls]:
    """The steps `replay --steps` sends after the first request: what a fake steered session is handed."""
    sent: list[Controls] = []

    class Session:
        def __init__(self, url: str, model_name: str, on_place, connection) -> None:
            pass

        def __enter__(self) -> Session:
            return self

        def __exit__(self, *exc) -> None:
            pass

        def start(self, request) -> None:
            pass

        def step(self, controls: Controls, end: bool = False) -> None:
            sent.append(controls)

        def next_block(self, timeout: float) -> BlockResponse:
            return block(len(sent), recording.prompt, 12)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(replay, "SteeredSession", Session)
        replay.replay_steps(recording, "unused:1", "lingbot_world", False, 1.0)
    return sent


def rewrite(path: Path, **changes) -> Path:
    """The recording with arrays replaced (None drops one); meta changes as a dict merged into its JSON."""
    with np.load(path, allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    if "meta" in changes and isinstance(changes["meta"], dict):
        changes["meta"] = np.array(json.dumps(json.loads(str(arrays["meta"])) | changes["meta"]))
    arrays |= changes
    out = path.with_name("changed.npz")
    np.savez(out, **{k: v for k, v in arrays.items() if v is not None})
    return out


def truncated(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def meta_blocks(path: Path) -> list[dict]:
    with np.load(path, allow_pickle=False) as npz:
        return json.loads(str(npz["meta"]))["blocks"]


@pytest.mark.parametrize("corrupt, message", [
    (lambda p: truncated(p), "not a readable recording"),
    (lambda p: rewrite(p, meta={"version": 2}), "recording version 2; this client reads version 1"),
    (lambda p: rewrite(p, meta={"format": "mp4"}), "not a LingBot-World recording"),
    (lambda p: rewrite(p, camera=None), r"missing array\(s\) \['camera'\]"),
    (lambda p: rewrite(p, meta={"seed": "42"}), "meta.seed must be int"),
    (lambda p: rewrite(p, camera=np.full((45, 4, 4), np.nan, np.float32)), "camera poses of block 0 holds NaN or Inf"),
    (lambda p: rewrite(p, camera=np.tile(np.eye(4, dtype=np.float32), (44, 1, 1))), "count 45 frames but camera holds 44"),
    (lambda p: rewrite(p, meta={"blocks": meta_blocks(p)[:3]}), "count 33 frames but camera holds 45"),
    (lambda p: rewrite(p, meta={"settings": SETTINGS.replace("block_frames=3", "block_frames=4")}),
     r"meta.blocks\[0\].frames is 9; block 0 has 13 at block_frames=4"),
    (lambda p: rewrite(p, meta={"blocks": [b | {"latents_sha256": "zz"} for b in meta_blocks(p)]}), "64 lowercase hex"),
    (lambda p: rewrite(p, image=np.zeros((4, 4), np.uint8)), r"image must be uint8 \[H, W, 3\]"),
    (lambda p: rewrite(p, meta=np.array(b"\x00".decode())), "meta is not JSON"),
    (lambda p: rewrite(p, meta={"snapshots": [{"id": "../" * 10 + "aa", "block": 1}]}), r"snapshots\[0\].id must be"),
    (lambda p: rewrite(p, meta={"snapshots": [{"id": "a" * 32, "block": 4}]}), "holds blocks 0 to 3"),
    (lambda p: rewrite(p, meta={"snapshots": [{"id": "a" * 32, "block": 1}] * 2}), "each once"),
    (lambda p: rewrite(p, meta={"snapshots": {"a" * 32: 1}}), "meta.snapshots must be a list"),
    (lambda p: rewrite(p, meta={"blocks": [b | {"event": " "} if i == 2 else b for i, b in enumerate(meta_blocks(p))]}),
     "prompt is empty"),
])
def test_a_damaged_recording_is_refused_naming_what_is_wrong(recording_file: Path, corrupt, message: str) -> None:
    with pytest.raises(RecordingError, match=message):
        Recording.load(corrupt(recording_file))


def test_a_file_that_is_no_recording_is_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "one.npy", np.zeros(3))
    (tmp_path / "text.npz").write_text("hello")
    with zipfile.ZipFile(tmp_path / "objects.npz", "w") as z:  # a pickled array inside: never unpickled
        with z.open("meta.npy", "w") as f:
            np.lib.format.write_array(f, np.array([{"format": "x"}], dtype=object), allow_pickle=True)
    for name in ("one.npy", "text.npz", "objects.npz", "absent.npz"):
        with pytest.raises(RecordingError, match=name):
            Recording.load(tmp_path / name)


def crafted(path: Path, member: str, data: bytes) -> Path:
    """The recording with one zip member added or replaced by raw bytes."""
    with zipfile.ZipFile(path) as z:
        kept = {i.filename: z.read(i) for i in z.infolist() if i.filename != member}
    out = path.with_name("crafted.npz")
    with zipfile.ZipFile(out, "w") as z:
        for name, content in (kept | {member: data}).items():
            z.writestr(name, content)
    return out


def npy_header(shape: tuple, dtype: str = "<f4") -> bytes:
    import io

    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": dtype, "fortran_order": False, "shape": shape})
    return buffer.getvalue()


@pytest.mark.parametrize("member, data, message", [
    ("junk.npy", b"\0" * (1 << 20), r"unexpected member\(s\) \['junk.npy'\]"),
    ("image", b"raw bytes", r"unexpected member\(s\) \['image'\]"),
    ("camera.npy", npy_header((2**40, 4, 4)), "camera declares 70368744177664 bytes; at most 67108864"),
    ("image.npy", npy_header((64, 64, 3), "|u1") + b"\0" * 100, r"image is truncated \(100 of 12288 bytes\)"),
])
def test_a_crafted_recording_is_refused_before_anything_large_is_read(recording_file: Path, member: str, data: bytes,
                                                                       message: str) -> None:
    with pytest.raises(RecordingError, match=message):
        Recording.load(crafted(recording_file, member, data))


@pytest.mark.parametrize("name", sorted(MAX_BYTES))
def test_each_array_may_declare_its_most_bytes_and_not_one_more(recording_file: Path, name: str) -> None:
    """At its limit a member passes the size check (and is then found truncated); one byte over, it is refused from
    its header alone."""
    limit = MAX_BYTES[name]
    with pytest.raises(RecordingError, match=f"{name} is truncated"):
        Recording.load(crafted(recording_file, f"{name}.npy", npy_header((limit,), "|u1")))
    with pytest.raises(RecordingError, match=f"{name} declares {limit + 1} bytes; at most {limit}"):
        Recording.load(crafted(recording_file, f"{name}.npy", npy_header((limit + 1,), "|u1")))


@pytest.mark.parametrize("camera", [np.tile(np.eye(4), (45, 1, 1)), np.zeros((45, 3, 4), np.float32),
                                    np.zeros((45, 16), np.float32)], ids=["float64", "3x4", "flat"])
def test_a_camera_of_another_type_or_shape_is_refused(recording_file: Path, camera: np.ndarray) -> None:
    with pytest.raises(RecordingError, match=r"camera must be float32 \[n, 4, 4\]"):
        Recording.load(rewrite(recording_file, camera=camera))


@pytest.mark.parametrize("meta, message", [
    ({"seed": 2**70}, "does not fit in 64 bits"),
    ({"height": 10**9}, "must be 1 to 65536"),
    ({"settings": SETTINGS.replace("block_frames=3", "block_frames=x")}, "invalid literal"),
    ({"settings": SETTINGS.replace("block_frames=3", "block_frames=0")}, "block_frames must be at least 1"),
])
def test_out_of_range_start_inputs_are_refused(recording_file: Path, meta: dict, message: str) -> None:
    with pytest.raises(RecordingError, match=message):
        Recording.load(rewrite(recording_file, meta=meta))


@pytest.mark.parametrize(("meta", "loads"), [
    ({"seed": 2**63 - 1}, True), ({"seed": 2**63}, False), ({"seed": -(2**63)}, True), ({"seed": -(2**63) - 1}, False),
    ({"height": 1, "width": 65536}, True), ({"height": 0}, False), ({"width": 65537}, False),
])
def test_start_inputs_at_their_bounds(recording_file: Path, meta: dict, loads: bool) -> None:
    """The seed is int64 (as the wire's), each side 1 to MAX_SIDE."""
    path = rewrite(recording_file, meta=meta)
    if loads:
        assert [getattr(Recording.load(path), k) for k in meta] == list(meta.values())
    else:
        with pytest.raises(RecordingError, match=r"64 bits|1 to 65536"):
            Recording.load(path)


def test_block_frames_of_one_is_a_recording_s_smallest_block(tmp_path: Path) -> None:
    """1 latent frame a block: 1 video frame first, then 4 each (contract.block_video_frames)."""
    recorder = Recorder(steered_request(prompt="a castle"))
    recorder.add(block(0, "a castle", 1, settings=SETTINGS.replace("block_frames=3", "block_frames=1")))
    recorder.add(block(1, "a castle", 4))
    loaded = Recording.load(recorder.save(tmp_path / "one.npz"))
    assert loaded.block_frames == 1 and [len(b.camera) for b in loaded.blocks] == [1, 4]


def test_the_intrinsics_sent_and_a_column_major_image_come_back_as_they_were(tmp_path: Path) -> None:
    """A session's own intrinsics are kept; an image numpy stores column-major (a transposed array) reads back
    as the same picture."""
    image = np.asfortranarray(np.random.default_rng(3).integers(0, 256, (64, 48, 3), dtype=np.uint8))
    intrinsics = np.array([[50.0, 60.0, 24.0, 32.0]], np.float32)
    recorder = Recorder(steered_request(prompt="a castle", image=image, intrinsics=intrinsics))
    recorder.add(block(0, "a castle", 9, settings=SETTINGS))
    loaded = Recording.load(recorder.save(tmp_path / "world.npz"))
    assert np.array_equal(loaded.image, image) and np.array_equal(loaded.intrinsics, intrinsics)
    with pytest.raises(RecordingError, match=r"intrinsics must be finite float32 \[k, 4\]"):
        Recording.load(rewrite(tmp_path / "world.npz", intrinsics=np.ones((1, 5), np.float32)))


def test_deeply_nested_meta_is_refused(recording_file: Path) -> None:
    with pytest.raises(RecordingError, match="recursion"):
        Recording.load(rewrite(recording_file, meta=np.array("[" * 100_000 + "]" * 100_000)))


def test_a_recorder_needs_what_each_block_was_made_from() -> None:
    with pytest.raises(ValueError, match="return_used"):
        Recorder(steered_request(return_used=False))
    recorder = Recorder(steered_request())
    with pytest.raises(RecordingError, match="settings_used"):
        recorder.add(block(0, "a", 9))
    with pytest.raises(RecordingError, match="block 1 came without"):
        recorder.add(dataclasses.replace(block(1, "a", 12), used=None))
