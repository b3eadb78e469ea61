"""Snapshots (docs/worlds.md): a steered session saved after block k and resumed makes blocks k+1.. bit for bit,
on any layout; a fork is a world of its own; the store refuses what an attacker or an unlucky disk sends it.

The session (tiny checkpoint: 3-frame blocks, a 9-frame window, a 3-frame sink) plays SCRIPT: a prompt event with
a recache before block 2, the window's first eviction before block 3, the save after block 4."""
from __future__ import annotations

import dataclasses
import secrets
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from backend.api.contract import (INVALID_INPUT, SETTINGS_MISMATCH, SNAPSHOT_EXPIRED, SNAPSHOT_INVALID,
                                  SNAPSHOT_PENDING, SNAPSHOT_STORE_FULL, SNAPSHOT_UNKNOWN)
from backend.api.controls import parse_play_script
from backend.api.request import SessionRequest
from backend.engine.blocks import BlockControls
from backend.engine.rollout import WorldModelEngine
from backend.engine.snapshot import files
from backend.engine.snapshot import sessions as snapshots
from backend.engine.snapshot.manifest import MANIFEST_NAME, Manifest, SnapshotError
from backend.engine.snapshot.restore import read_request
from backend.engine.snapshot.store import PENDING_RETRY_S, SnapshotStore, snapshot_at
from backend.model.feature_caches import vae_decoder_state
from backend.model.tiny_vae import TinyDecodeState
from backend.model.tiny_checkpoint import write_checkpoint
from backend.model.tiny_vae_weights import write_weights
from factories import sample_image, tiny_settings, tiny_request
from sp_workers import play, resume_and_play, save_in_group

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCRIPT = "w,a,@!it starts to snow,w,d,w,s,wa"  # 7 blocks
SAVE_AFTER = 4
QUOTA = 1 << 30
TTL_S = 3600.0


def steered_request(steps: list, size: int = 64) -> SessionRequest:
    base = tiny_request(num_frames=9, height=size, width=size, image=sample_image(size))
    return dataclasses.replace(base, num_frames=None, poses=None, keys=steps[0].keys)


def refused(code: str):
    """pytest.raises for a SnapshotError with this code."""
    return pytest.raises(SnapshotError, match=rf"^\[{code}[ \]]")


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) > 0 and all(np.array_equal(x, y) for x, y in zip(a, b))


def memory_order(state: object) -> list:
    """Each tensor of a decoder state, its shape and strides (a dim of size 1 has no stride that matters)."""
    cache = state.memory.values() if isinstance(state, TinyDecodeState) else state.feature_cache
    return [(t.shape, [s for s, n in zip(t.stride(), t.shape) if n > 1]) for t in cache if isinstance(t, torch.Tensor)]


@dataclasses.dataclass
class Saved:
    store: SnapshotStore
    snapshot_id: str
    whole: dict  # the uninterrupted session: each block's latents and frames
    steps: list
    evicted_tokens: int  # at the save
    decode_strides: list  # the decoder state's memory_order at the save


def save_and_play(engine: WorldModelEngine, store: SnapshotStore, steps: list, request: SessionRequest) -> Saved:
    at_save = {}

    def save(session) -> str:
        at_save["evicted"] = session.cache.evicted_tokens
        at_save["strides"] = memory_order(session.decoding.state)
        return save_in_group(engine, session, store)

    with engine.session(request, keep_commits=True) as session:
        whole = play(engine, session, steps, 0, SAVE_AFTER, save)
    return Saved(store, whole["saved"], whole, steps, at_save["evicted"], at_save["strides"])


@pytest.fixture(scope="module")
def saved(engine: WorldModelEngine, tmp_path_factory: pytest.TempPathFactory) -> Saved:
    steps = parse_play_script(SCRIPT)
    store = SnapshotStore(tmp_path_factory.mktemp("snapshots"), QUOTA, TTL_S)
    return save_and_play(engine, store, steps, steered_request(steps))


def test_a_resumed_session_makes_the_next_blocks_bit_for_bit(engine: WorldModelEngine, saved: Saved) -> None:
    assert saved.steps[2].recache and saved.evicted_tokens > 0  # an event recached before k, k past an eviction
    resumed = resume_and_play(engine, saved.store, saved.snapshot_id, saved.steps)
    assert same(resumed["latents"], saved.whole["latents"][SAVE_AFTER + 1 :])
    assert same(resumed["frames"], saved.whole["frames"][SAVE_AFTER + 1 :])
    snapshot = saved.store.open(saved.snapshot_id)
    session = snapshots.resume(engine, snapshot, engine.geometry_of(read_request(snapshot)))
    try:  # the decoder's caches come back in the memory order they had (channels-last): the same kernels run
        assert memory_order(session.decoding.state) == saved.decode_strides
        assert session.block_index == SAVE_AFTER + 1 and session.prompt == "it starts to snow"
    finally:
        engine.close_session(session)


def test_a_fork_is_a_world_of_its_own(engine: WorldModelEngine, saved: Saved) -> None:
    """Two resumes of one snapshot, played block by block in turn: the one under the same steps is the original
    world; the one under other steps, and a third with a fork seed, diverge from it."""
    snapshot = saved.store.open(saved.snapshot_id)
    geometry = engine.geometry_of(read_request(snapshot))
    other = parse_play_script("w,a,@!it starts to snow,w,d,w,s,d")
    forks = {"same": (saved.steps, None), "other steps": (other, None), "fork seed": (saved.steps, 7)}
    sessions = {name: snapshots.resume(engine, snapshot, geometry, fork_seed=seed) for name, (_, seed) in forks.items()}
    latents: dict[str, list] = {name: [] for name in forks}
    try:
        for index in range(SAVE_AFTER + 1, len(saved.steps)):
            for name, (steps, _) in forks.items():
                latents[name] += play(engine, sessions[name], steps[: index + 1], index)["latents"]
    finally:
        for session in sessions.values():
            engine.close_session(session)
    original = saved.whole["latents"][SAVE_AFTER + 1 :]
    assert same(latents["same"], original)
    assert np.array_equal(latents["other steps"][0], original[0])  # the steps differ from block 6 on
    assert not np.array_equal(latents["other steps"][1], original[1])
    assert all(not np.allclose(a, b) for a, b in zip(latents["fork seed"], original))


def test_kv_reuse_and_the_tiny_decoder_resume_bit_for_bit_and_other_settings_are_refused(
        engine: WorldModelEngine, saved: Saved, tmp_path: Path) -> None:
    checkpoint = write_checkpoint(tmp_path / "tiny16", "tiny16", seed=0)  # the tiny decoder decodes 16 channels
    weights = write_weights(tmp_path / "taew2_1.pth")
    fast = WorldModelEngine.load(tiny_settings(str(checkpoint), kv_reuse=True, decoder="tiny",
                                             tiny_decoder_path=str(weights)))
    store = SnapshotStore(tmp_path / "snapshots", QUOTA, TTL_S)
    run = save_and_play(fast, store, saved.steps, steered_request(saved.steps, size=32))
    resumed = resume_and_play(fast, store, run.snapshot_id, saved.steps)
    assert same(resumed["latents"], run.whole["latents"][SAVE_AFTER + 1 :])
    assert same(resumed["frames"], run.whole["frames"][SAVE_AFTER + 1 :])
    with refused(SETTINGS_MISMATCH) as caught:
        snapshots.resume(engine, store.open(run.snapshot_id), engine.geometry_of(read_request(store.open(run.snapshot_id))))
    for named in ("decoder: expected tiny, this server vae", "kv_reuse: expected True, this server False", "z_dim"):
        assert named in str(caught.value)


def test_the_size_known_before_a_save_bounds_it(engine: WorldModelEngine, saved: Saved) -> None:
    snapshot = saved.store.open(saved.snapshot_id)
    request = read_request(snapshot)
    size = engine.snapshot_facts.snapshot_size(request, engine.geometry_of(request), SAVE_AFTER + 1, keep_commits=True)
    written = {entry.role: 0 for entry in snapshot.manifest.files}
    for entry in snapshot.manifest.files:
        written[entry.role] += entry.bytes
    total = sum(p.stat().st_size for p in snapshot.folder.iterdir())
    print(f"snapshot: {total:,} bytes written, {size.total:,} known before ({written})")
    assert total <= size.total <= total * 1.05  # within the headers' allowance
    assert size.kv < written["kv"] < size.kv + 4096  # the K/V exactly, besides the file's header
    with engine.session(request) as session:  # the dry run's decoder state is what a decode holds
        engine.run_block([session], {session.id: BlockControls(request.first_controls)})
        out = engine.run_block([session], {session.id: BlockControls(None)})[0]
        engine.decode(session.decoding, out)
        held = [t.nbytes for t in session.decoding.state.feature_cache if isinstance(t, torch.Tensor)]
    assert vae_decoder_state(engine.vae_config, 8, 8) == (sum(held), len(held))


# -- the store, as an attacker and an unlucky disk meet it


@pytest.fixture
def copy(saved: Saved, tmp_path: Path) -> tuple[SnapshotStore, str]:
    """A store holding a copy of the saved snapshot, free to damage."""
    store = SnapshotStore(tmp_path / "copy", QUOTA, TTL_S)
    shutil.copytree(saved.store.root / saved.snapshot_id, store.root / saved.snapshot_id)
    return store, saved.snapshot_id


@pytest.mark.parametrize("bad", ["../" + "0" * 29, "0" * 31 + "/", "/etc/passwd", "..", "", "A" * 32, "0" * 31,
                                 "0" * 33, "0" * 31 + "\n", "0" * 16 + "\x00" + "0" * 15, "~" * 32])
def test_an_id_not_of_the_exact_form_is_refused_before_any_path(bad: str, tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "store", QUOTA, TTL_S)
    for call in (store.open, store.staging, store.abandon, lambda bad: snapshot_at(store.root, bad, "{}")):
        with refused(INVALID_INPUT):
            call(bad)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["store"]


def test_a_guessed_id_or_a_link_in_the_store_finds_nothing(copy: tuple[SnapshotStore, str], tmp_path: Path) -> None:
    store, snapshot_id = copy
    with refused(SNAPSHOT_UNKNOWN):
        store.open(secrets.token_hex(16))
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(store.root / snapshot_id, elsewhere)
    linked = secrets.token_hex(16)
    (store.root / linked).symlink_to(elsewhere)  # a folder outside the store, behind a valid id
    with refused(SNAPSHOT_UNKNOWN):
        store.open(linked)


def flip_byte(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_byte_is_refused_on_every_file_and_nothing_is_served(
        engine: WorldModelEngine, copy: tuple[SnapshotStore, str], saved: Saved) -> None:
    store, snapshot_id = copy
    geometry = engine.geometry_of(read_request(store.open(snapshot_id)))
    for name in ("kv-0", "decode-0", "condition", "shared"):
        path = store.root / snapshot_id / f"{name}.safetensors"
        pristine = path.read_bytes()
        flip_byte(path)
        snapshot = store.open(snapshot_id)  # the sizes still match: only the reader's SHA-256 sees it
        with refused(SNAPSHOT_INVALID) as caught:
            snapshots.resume(engine, snapshot, geometry)
        assert f"{name}.safetensors" in str(caught.value)
        path.write_bytes(pristine)
    # The engine serves on: the intact snapshot resumes bit for bit.
    resumed = resume_and_play(engine, store, snapshot_id, saved.steps)
    assert same(resumed["latents"], saved.whole["latents"][SAVE_AFTER + 1 :])


def test_a_truncated_file_or_an_altered_manifest_is_refused_at_open(copy: tuple[SnapshotStore, str]) -> None:
    store, snapshot_id = copy
    folder = store.root / snapshot_id
    manifest = (folder / MANIFEST_NAME).read_text()
    # A version 1 manifest (its grid named "layout") still opens, to the same grid.
    (folder / MANIFEST_NAME).write_text(manifest.replace('"grid"', '"layout"').replace('"version": 2', '"version": 1'))
    assert store.open(snapshot_id).manifest.grid == Manifest.parse(manifest.encode(), snapshot_id).grid
    (folder / MANIFEST_NAME).write_text(manifest)
    kv = folder / "kv-0.safetensors"
    kv.write_bytes(kv.read_bytes()[:-100])
    with refused(SNAPSHOT_INVALID) as caught:
        store.open(snapshot_id)
    assert "kv-0.safetensors" in str(caught.value)
    alterations = {
        "a path outside its folder": manifest.replace('"kv-0.safetensors"', '"../kv-0.safetensors"'),
        "heads that do not tile": manifest.replace('"heads": [\n    0,', '"heads": [\n    1,'),
        "not JSON": manifest[:-2],
        "another id": manifest.replace(snapshot_id, secrets.token_hex(16)),
        "a newer format": manifest.replace('"version": 2', '"version": 3'),
        "a version's grid under the other's name": manifest.replace('"version": 2', '"version": 1'),
        "a version that is not an integer": manifest.replace('"version": 2', '"version": 2.0'),
    }
    for why, text in alterations.items():
        assert text != manifest, why
        (folder / MANIFEST_NAME).write_text(text)
        with refused(SNAPSHOT_INVALID):
            store.open(snapshot_id)
    (folder / MANIFEST_NAME).unlink()
    with refused(SNAPSHOT_INVALID):
        store.open(snapshot_id)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def publish_small(store: SnapshotStore, snapshot_id: str, nbytes: int) -> None:
    """A snapshot of the manifest's form with `nbytes` of K/V (the store checks form and sizes, not meaning)."""
    from backend.engine.snapshot.manifest import Manifest

    folder = store.staging(snapshot_id)
    parts = [files.Part("shared", 0, {"x": torch.zeros(1)}), files.Part("condition", 0, {"x": torch.zeros(1)}),
             files.Part("kv", 0, {"k.0": torch.zeros(nbytes // 4, dtype=torch.float32)}, heads=(0, 4))]
    entries = [files.write_part(folder, part) for part in parts]
    model = {"num_layers": 1, "num_heads": 4, "head_dim": 1, "z_dim": 4}
    grid = {"tp_degree": 1, "sp_degree": 1, "latent_rows": 8}
    store.publish(snapshot_id, Manifest(snapshot_id, 0.0, "", model, grid, tuple(entries)))


def test_saves_past_the_quota_are_refused_before_writing_and_expired_ones_make_room(tmp_path: Path) -> None:
    clock = Clock()
    store = SnapshotStore(tmp_path / "store", quota_bytes=100_000, ttl_s=60.0, clock=clock)
    first = store.reserve(60_000)
    publish_small(store, first, 50_000)
    clock.now += 30.0
    before = sorted(p.name for p in store.root.iterdir())
    with refused(SNAPSHOT_STORE_FULL) as caught:
        store.reserve(60_000)
    assert caught.value.refusal.retry_after_s == pytest.approx(30.0)  # when the first expires
    assert sorted(p.name for p in store.root.iterdir()) == before  # nothing written
    with refused(INVALID_INPUT):
        store.reserve(100_001)  # larger than the whole quota: no wait helps
    clock.now += 30.0
    second = store.reserve(60_000)  # the first expired and was swept
    with refused(SNAPSHOT_EXPIRED):
        store.open(first)
    clock.now += 61.0
    store.sweep()  # the marker is forgotten after another time to live; the second's abandoned save is removed
    with refused(SNAPSHOT_UNKNOWN):
        store.open(first)
    with refused(SNAPSHOT_UNKNOWN):
        store.staging(second)
    assert store.usage() == 0


def test_the_quota_and_the_time_to_live_hold_at_their_edges(tmp_path: Path) -> None:
    """Saves that fill the quota exactly fit and one byte more does not; a snapshot expires at its time to live
    exactly; a full store's retry waits for its oldest snapshot, whose expiry makes the room."""
    clock = Clock()
    store = SnapshotStore(tmp_path / "store", quota_bytes=100_000, ttl_s=60.0, clock=clock)
    store.abandon(store.reserve(100_000))  # the whole quota
    saves = [store.reserve(60_000), store.reserve(40_000)]
    with refused(SNAPSHOT_STORE_FULL):
        store.reserve(1)
    for snapshot_id in saves:
        store.abandon(snapshot_id)
    older = store.reserve(30_000)
    publish_small(store, older, 30_000)
    clock.now += 10.0
    publish_small(store, newer := store.reserve(30_000), 30_000)
    clock.now += 10.0
    with refused(SNAPSHOT_STORE_FULL) as caught:
        store.reserve(50_000)
    assert caught.value.refusal.retry_after_s == pytest.approx(40.0)  # the older one's expiry frees enough
    clock.now += 39.0
    store.open(older)  # 59 s old
    clock.now += 1.0
    with refused(SNAPSHOT_EXPIRED):
        store.open(older)  # 60 s old
    store.open(newer)


def test_saves_under_way_hold_their_reservation_so_two_at_once_never_pass_the_quota(tmp_path: Path) -> None:
    """A reserved save counts at its reservation while its ranks write (or at what they wrote, when more), so a
    second save reserved meanwhile is refused; the store's folder is made with its parents."""
    store = SnapshotStore(tmp_path / "not" / "made" / "yet", quota_bytes=100_000, ttl_s=60.0)
    first = store.reserve(60_000)
    assert 60_000 <= store.usage() < 61_000  # nothing written yet: the reservation counts
    with refused(SNAPSHOT_STORE_FULL):
        store.reserve(60_000)
    (store.staging(first) / "part.safetensors").write_bytes(bytes(70_000))  # a rank wrote past the estimate
    assert store.usage() >= 70_000
    with refused(SNAPSHOT_STORE_FULL):
        store.reserve(35_000)


def test_a_failed_write_leaves_no_snapshot_visible(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = SnapshotStore(tmp_path / "store", QUOTA, TTL_S)
    snapshot_id = store.reserve(10_000)
    folder = store.staging(snapshot_id)

    def disk_full(tensors: dict, path: str) -> None:
        Path(path).write_bytes(b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        files.write_part(folder, files.Part("kv", 0, {"k.0": torch.zeros(8)}, heads=(0, 4)))
    assert list(folder.iterdir()) == [folder / ".reservation"]  # neither the file nor its temporary name
    monkeypatch.undo()
    with refused(SNAPSHOT_INVALID):  # a rank's file missing: the owner does not publish
        from backend.engine.snapshot.manifest import FileEntry, Manifest
        ghost = FileEntry("kv-0.safetensors", "kv", 0, 100, "0" * 64, (0, 4), None, {})
        shared = FileEntry("shared.safetensors", "shared", 0, 100, "0" * 64, None, None, {})
        condition = FileEntry("condition.safetensors", "condition", 0, 100, "0" * 64, None, None, {})
        model = {"num_layers": 1, "num_heads": 4, "head_dim": 1, "z_dim": 4}
        store.publish(snapshot_id, Manifest(snapshot_id, 0.0, "", model,
                                            {"tp_degree": 1, "sp_degree": 1, "latent_rows": 8},
                                            (ghost, shared, condition)))
    with refused(SNAPSHOT_PENDING):  # not published, not abandoned yet
        store.open(snapshot_id)
    store.abandon(snapshot_id)
    with refused(SNAPSHOT_UNKNOWN):
        store.open(snapshot_id)
    assert store.usage() == 0 and list(store.root.iterdir()) == [store.root / ".lock"]


def test_a_resume_of_a_save_under_way_is_told_to_come_back_and_then_opens(tmp_path: Path) -> None:
    """An id whose save is reserved and not published yet (its files being written, on this group or another that
    shares the store) is SNAPSHOT_PENDING with a retry time, not SNAPSHOT_UNKNOWN: a client that resumes it is not
    told its world is gone. Once published it opens."""
    store = SnapshotStore(tmp_path / "store", QUOTA, TTL_S)
    snapshot_id = store.reserve(60_000)
    with refused(SNAPSHOT_PENDING) as caught:
        store.open(snapshot_id)
    assert caught.value.refusal.retry_after_s == PENDING_RETRY_S > 0
    publish_small(store, snapshot_id, 50_000)
    assert store.open(snapshot_id).manifest.snapshot_id == snapshot_id


# -- other layouts: SP2 and TP2 x SP2 groups of local processes (one run each)


@pytest.fixture(scope="module")
def layouts(saved: Saved, tiny_checkpoint: str) -> dict[str, dict]:
    """Rank 0's view of an SP2 group that saves its own snapshot and resumes it and the SP1 one, and of a
    TP2 x SP2 group that saves its own and resumes it and the SP2 one."""
    from backend.parallel.local import run_group
    from sp_workers import snapshot_roundtrip

    settings, request, root = tiny_settings(tiny_checkpoint), steered_request(saved.steps), str(saved.store.root)
    sp2 = run_group(2, snapshot_roundtrip, (dataclasses.replace(settings, sp_degree=2), request, saved.steps,
                                           SAVE_AFTER, root, [saved.snapshot_id]))[0]
    tp2_sp2 = run_group(4, snapshot_roundtrip, (dataclasses.replace(settings, tp_degree=2, sp_degree=2), request,
                                               saved.steps, SAVE_AFTER, root, [sp2["snapshot_id"]]))[0]
    return {"sp2": sp2, "tp2_sp2": tp2_sp2}


def frames_distance(a: list[np.ndarray], b: list[np.ndarray], label: str) -> int:
    """The largest difference of two runs' frames in 8-bit levels (printed with how many values differ)."""
    diff = np.abs(np.concatenate(a).astype(int) - np.concatenate(b))
    print(f"{label}: frames differ by at most {diff.max()} of 255 levels, in {np.count_nonzero(diff)} of "
          f"{diff.size:,} values")
    return int(diff.max())


@pytest.mark.server
def test_sp1_and_sp2_resume_each_others_snapshots_bit_for_bit(engine: WorldModelEngine, saved: Saved,
                                                              layouts: dict[str, dict]) -> None:
    sp2, rest = layouts["sp2"], slice(SAVE_AFTER + 1, None)
    assert same(sp2["whole"]["latents"], saved.whole["latents"])  # SP2 = SP1: what a resume across them rests on
    own = sp2["resumed"][sp2["snapshot_id"]]
    assert same(own["latents"], sp2["whole"]["latents"][rest])
    assert same(own["frames"], sp2["whole"]["frames"][rest])  # the same two bands: the same frames
    from_sp1 = sp2["resumed"][saved.snapshot_id]
    assert same(from_sp1["latents"], saved.whole["latents"][rest])
    # A whole-frame decoder state split into bands decodes as the split decoder does: to its rounding.
    assert frames_distance(from_sp1["frames"], sp2["whole"]["frames"][rest], "SP1 -> SP2") <= 1
    assert sp2["damaged"] == SNAPSHOT_INVALID  # a byte only rank 1 reads: every rank refuses, none hangs
    at_sp1 = resume_and_play(engine, saved.store, sp2["snapshot_id"], saved.steps)
    assert same(at_sp1["latents"], saved.whole["latents"][rest])
    assert frames_distance(at_sp1["frames"], saved.whole["frames"][rest], "SP2 -> SP1") <= 1


@pytest.mark.server
def test_tp2_x_sp2_resumes_its_own_bit_for_bit_and_sp2s_to_float_rounding(layouts: dict[str, dict]) -> None:
    """Each rank reads the 1 of 4 heads it holds from the file that has it (SP2's files hold 2 each)."""
    tp, rest = layouts["tp2_sp2"], slice(SAVE_AFTER + 1, None)
    assert tp["damaged"] == SNAPSHOT_INVALID
    own = tp["resumed"][tp["snapshot_id"]]
    assert same(own["latents"], tp["whole"]["latents"][rest])
    assert same(own["frames"], tp["whole"]["frames"][rest])
    from_sp2 = tp["resumed"][layouts["sp2"]["snapshot_id"]]
    distance = max(float(np.abs(a - b).max()) for a, b in zip(from_sp2["latents"], tp["whole"]["latents"][rest]))
    print(f"SP2 -> TP2 x SP2: latents differ by at most {distance:.3g} (TP's all-reduces round differently)")
    assert distance < 1e-5
    assert frames_distance(from_sp2["frames"], tp["whole"]["frames"][rest], "SP2 -> TP2 x SP2") <= 1


WEIRD = [None, -1, 0, 2**70, 1.5, True, "", "x" * 300, [], [0], [1, 0], {}, {"a": 1}]


def replaced(tree: object, path: tuple, value: object) -> object:
    """A copy of a JSON tree with the value at `path` replaced."""
    if not path:
        return value
    copy = list(tree) if isinstance(tree, list) else dict(tree)
    copy[path[0]] = replaced(tree[path[0]], path[1:], value)
    return copy


def paths(tree: object, prefix: tuple = ()) -> list[tuple]:
    found = [prefix]
    items = enumerate(tree) if isinstance(tree, list) else tree.items() if isinstance(tree, dict) else []
    for key, child in items:
        found += paths(child, (*prefix, key))
    return found


def test_a_manifest_of_any_other_form_is_refused_with_its_code_and_nothing_else(saved: Saved) -> None:
    """Every value of a real manifest (the entries' meta besides, which the readers check) replaced in turn by
    values of other types and ranges: parsing gives the manifest or SNAPSHOT_INVALID, never another error."""
    import json

    from backend.engine.snapshot.manifest import Manifest

    raw = json.loads((saved.store.root / saved.snapshot_id / MANIFEST_NAME).read_text())
    tried = refused_count = 0
    for path in paths(raw):
        if "meta" in path[2:3]:
            continue
        for value in WEIRD:
            text = json.dumps(replaced(raw, path, value)).encode()
            tried += 1
            try:
                Manifest.parse(text, saved.snapshot_id)
            except SnapshotError as exc:
                assert exc.refusal.code == SNAPSHOT_INVALID
                refused_count += 1
    print(f"{tried} altered manifests, {refused_count} refused")
    assert refused_count > 0.9 * tried
