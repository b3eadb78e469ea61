"""What a snapshot costs (docs/worlds.md): the group's pause at the boundary, the background write and the resume,
each beside a block's time; and a snapshot's bytes per rank at the 14B geometry.

    python -m bench.snapshot [--preset mid] [--save-after 1 3 6] [--repeats 5]

1. On CPU, SP1, `--preset` with random weights made in memory (bench.recache's engine: 64x64, float32, window 18,
   sink 6), one steered session with keep_commits, every block decoded: after each of `--save-after` blocks a save
   (the K/V capture on the group loop's thread: the pause; the decoder state's capture on the decode thread; the
   parts written, hashed and published: the background), then a resume of it (open, read, verify, the text K/V).
   Each row beside the block just run (run_block) and its decode, from the same run; capture times are the median
   of `--repeats` captures (a capture changes nothing).
2. At the 14B geometry (480x832, 3-frame blocks, window 18, sink 6, bf16, the Wan 2.1 VAE): each rank's files,
   from the memory model (model/memory, model/feature_caches, engine/snapshot/size) with a full window.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

from backend.engine.snapshot import sessions as snapshots
from backend.api.request import Controls
from backend.engine.blocks import BlockControls
from backend.engine.rollout import WorldModelEngine
from backend.engine.session import Session
from backend.engine.snapshot.files import write_part
from backend.engine.snapshot.restore import read_request
from backend.engine.snapshot.size import HEADER_BYTES_FIXED, commit_bytes, condition_bytes, shared_bytes
from backend.engine.snapshot.store import SnapshotStore
from backend.model.config import TransformerConfig
from backend.model.feature_caches import condition_encoder_state, vae_decoder_state
from backend.model.memory import self_cache_bytes
from backend.model.random_weights import WAN21_VAE
from backend.model.tiny_checkpoint import PRESETS
from bench.common import GPU, format_table, make_request
from bench.recache import COST, random_engine

STEP = Controls(keys="w")
BF16 = 2
MIB = 2**20
LAYOUTS = [(1, 1), (1, 4), (2, 2)]  # (tp, sp)
KEPT_RECORDS = 6  # a full window's kept commit records (window 18, sink 6, 3-frame blocks: bench.recache table 2)


def ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000.0


def save_row(engine: WorldModelEngine, session: Session, store: SnapshotStore, block_ms: float, decode_ms: float,
             repeats: int) -> list[str]:
    """Capture (pause and decode thread), write and publish, resume: one row."""
    pauses, decode_captures = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        parts = snapshots.session_parts(engine, session)
        pauses.append(ms(start))
        start = time.perf_counter()
        decode = snapshots.decode_part(engine.vae, engine.sp.rank, session.decoding)
        decode_captures.append(ms(start))
    pause = statistics.median(pauses)
    start = time.perf_counter()
    size = engine.snapshot_facts.snapshot_size(session.request, session.geometry, session.block_index, True)
    snapshot_id = store.reserve(size.total)
    folder = store.staging(snapshot_id)
    entries = [write_part(folder, part) for part in [*parts, decode]]
    written = store.publish(snapshot_id, engine.snapshot_facts.manifest(snapshot_id, session.geometry.latent_height, entries))
    write_ms = ms(start)
    start = time.perf_counter()
    snapshot = store.open(snapshot_id)
    resumed = snapshots.resume(engine, snapshot, engine.geometry_of(read_request(snapshot)))
    resume_ms = ms(start)
    engine.close_session(resumed)
    return [str(session.block_index), str(session.cache.length), f"{written / MIB:.1f}", f"{block_ms:.0f}",
            f"{decode_ms:.0f}", f"{pause:.1f}", f"{pause / block_ms:.2%}", f"{statistics.median(decode_captures):.2f}",
            f"{write_ms:.0f}", f"{write_ms / block_ms:.2f}", f"{written / MIB / (write_ms / 1000):.0f}",
            f"{resume_ms:.0f}", f"{resume_ms / block_ms:.2f}"]


def cost_rows(engine: WorldModelEngine, save_after: set[int], repeats: int, folder: Path) -> list[list[str]]:
    request = dataclasses.replace(make_request(COST), num_frames=None, poses=None, keys=STEP.keys)
    store = SnapshotStore(folder, quota_bytes=1 << 40, ttl_s=3600)
    rows = []
    with engine.session(request, keep_commits=True) as session:
        while session.block_index < max(save_after):
            start = time.perf_counter()
            (out,) = engine.run_block([session], {session.id: BlockControls(STEP)})
            block_ms = ms(start)
            start = time.perf_counter()
            engine.decode(session.decoding, out)
            decode_ms = ms(start)
            if session.block_index in save_after:
                rows.append(save_row(engine, session, store, block_ms, decode_ms, repeats))
    return rows


def rank_rows() -> list[list[str]]:
    """Each layout's files at the 14B geometry, full window: rank 0 (owner and encoder) and any other rank."""
    cfg, w = TransformerConfig.lingbot_14b(), GPU
    latent_h, latent_w = w.height // 8, w.width // 8
    tokens = w.window_frames * (latent_h // 2) * (latent_w // 2)
    decoder, _ = vae_decoder_state(WAN21_VAE, latent_h, latent_w)
    encoder, _ = condition_encoder_state(WAN21_VAE, w.height, w.width)
    condition = condition_bytes(encoder, 16, w.height, w.width, latent_h, latent_w)
    settled = condition - encoder  # once the encoder is at its fixed point its cache is gone
    shared = shared_bytes(w.height, w.width, 9) + commit_bytes(KEPT_RECORDS, 16, 3, latent_h, latent_w)
    rows = []
    for tp, sp in LAYOUTS:
        ranks = tp * sp
        kv = self_cache_bytes(cfg, tokens, ranks, BF16)
        band = decoder * (-(-latent_h // ranks)) // latent_h  # the top band: the largest (rows 60 / ranks, rounded up)
        rank0 = kv + band + shared + condition
        cells = [f"{b / MIB:,.0f}" for b in (kv, band, shared, condition, settled, rank0)]
        cells.append(f"{(kv + band) / MIB:,.0f}" if ranks > 1 else "-")
        total = ranks * (kv + band) + shared + condition + HEADER_BYTES_FIXED
        rows.append([f"TP{tp} x SP{sp}", *cells, f"{total / MIB:,.0f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="mid", help="random weights of the cost run")
    parser.add_argument("--save-after", type=int, nargs="+", default=[1, 3, 6], help="saves after these many blocks")
    parser.add_argument("--repeats", type=int, default=5, help="captures timed per save (their median)")
    parser.add_argument("--folder", type=Path, help="the store's folder (default: a temporary one)")
    args = parser.parse_args()

    engine = random_engine(args.preset, COST)
    begin = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        rows = cost_rows(engine, set(args.save_after), args.repeats, Path(folder))
    print(f"1. {args.preset} preset (random weights), {COST.height}x{COST.width}, {COST.dtype}, window "
          f"{COST.window_frames}, sink {COST.sink_frames}, SP1 on CPU, steered, keep_commits, decoded "
          f"({time.perf_counter() - begin:.0f} s)")
    print(format_table(["blocks run", "K/V tokens", "snapshot MiB", "block ms", "decode ms", "pause ms",
                        "pause / block", "decode capture ms", "write ms", "write / block", "write MiB/s",
                        "resume ms", "resume / block"], rows))
    print(f"\n2. 14B, {GPU.height}x{GPU.width}, bf16, window {GPU.window_frames} (full), the Wan 2.1 VAE: MiB each "
          f"rank writes (the owner and ENCODER_RANK taken as rank 0; the condition until the encoder's fixed point, "
          f"then 'settled'; {KEPT_RECORDS} commit records kept)")
    print(format_table(["layout", "K/V", "decoder band", "shared", "condition", "condition settled", "rank 0",
                        "other ranks", "snapshot"], rank_rows()))


if __name__ == "__main__":
    main()
