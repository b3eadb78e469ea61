"""Rank functions for the multi-process tests (importable by spawned processes)."""
from __future__ import annotations

import numpy as np

from backend.engine.settings import EngineSettings
from backend.engine.rollout import WorldModelEngine
from backend.engine.snapshot import sessions as snapshots
from backend.model.vae import StreamingVae
from backend.parallel.group import GroupHandles
from backend.parallel.mesh import Mesh
from backend.parallel.sequence import SequenceParallel
from backend.api.request import SessionRequest


def rollout(groups: GroupHandles, settings: EngineSettings, request: SessionRequest) -> dict:
    """Full rollout on every rank (split tp_degree x sp_degree); returns latents, per-block forwards and exchange
    bytes, the final cache shards, this rank's weight and cache bytes and each camera modulation it made."""
    sp = SequenceParallel(groups.data)
    engine = WorldModelEngine.load(settings, sp, groups.decode, Mesh.build(sp, settings.tp_degree, timeout_s=600))
    calls: list[int] = []  # one entry per transformer forward
    engine.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
    camera_made: list[int] = []  # bytes of each camera modulation made (transformer.CameraModulation)
    make_camera = engine.transformer.camera_modulation

    def recording_camera(*args, **kwargs):
        made = make_camera(*args, **kwargs)
        camera_made.append(sum(t.nbytes for t in (*made.scale, *made.shift)))
        return made

    engine.transformer.camera_modulation = recording_camera
    with engine.session(request) as session:
        outputs, forwards = [], []
        for out, _ in engine.blocks(session, decode=False):
            outputs.append(out)
            forwards.append(len(calls) - sum(forwards))
        n = session.cache.length
        return {
            "latents": np.concatenate([out.latents.numpy() for out in outputs], axis=2),
            "forwards": forwards,  # transformer forwards per block
            "a2a_bytes": [out.all_to_all_bytes for out in outputs],
            "all_reduce_bytes": [out.all_reduce_bytes for out in outputs],
            "all_gather_bytes": [out.all_gather_bytes for out in outputs],
            "weight_bytes": engine.transformer.weight_bytes(),
            "camera_modulation_bytes": camera_made,
            "self_cache_bytes": session.cache.nbytes(),
            "text_cache_bytes": session.text.nbytes(),
            "window_tokens": session.cache.capacity,
            "evicted_tokens": session.cache.evicted_tokens,
            "self_k": [k[:, :n].float().numpy() for k in session.cache.keys],
            "self_v": [v[:, :n].float().numpy() for v in session.cache.values],
            "text_k": [k.float().numpy() for k in session.text.keys],
            "text_v": [v.float().numpy() for v in session.text.values],
            # condition chunks this rank's VAE encoder ran (None: it holds no encoder)
            "condition_chunks": session.condition.stats["encoded"] if session.condition is not None else None,
            "vae_encoder": engine.vae.vae.encoder is not None,
        }


def prompt_states(groups: GroupHandles, settings: EngineSettings, prompts: list[str]) -> dict:
    """Each prompt's states on this rank, whether it holds the text encoder and how many prompts it encoded."""
    engine = WorldModelEngine.load(settings, SequenceParallel(groups.data), groups.decode)
    states = [engine.prompts.states(p).float().numpy() for p in prompts]
    return {"states": states, "has_encoder": engine.prompts.encoder is not None, "encoded": engine.prompts.encoded}


def split_decode(groups: GroupHandles, settings: EngineSettings, request: SessionRequest) -> dict:
    """A session's blocks decoded split across the ranks (frames on rank 0), and on rank 0 the same latents
    decoded whole by a VAE without a decode group."""
    engine = WorldModelEngine.load(settings, SequenceParallel(groups.data), groups.decode)
    whole = StreamingVae(engine.vae.vae, engine.device)  # the same weights; no group: whole frames
    whole_state = whole.new_decode_state()
    with engine.session(request) as session:
        shared = session.decoding.split
        blocks = []
        for out, frames in engine.blocks(session):
            if engine.sp.rank == 0:
                blocks.append((frames, whole.decode_block(out.latents, whole_state)))
            else:
                assert frames is None
    return {"shared": shared, "blocks": blocks}


def steered_events(groups: GroupHandles, settings: EngineSettings, request: SessionRequest, steps: list) -> dict:
    """A steered session through `steps` (Controls; a step's prompt set as a prompt event before its block) on
    every rank; returns the latents, this rank's text K/V bytes after each block and its final text K/V shards."""
    from backend.engine.blocks import BlockControls

    sp = SequenceParallel(groups.data)
    engine = WorldModelEngine.load(settings, sp, groups.decode, Mesh.build(sp, settings.tp_degree, timeout_s=600))
    with engine.session(request) as session:
        latents, text_bytes = [], []
        for controls in steps:
            if controls.prompt is not None:
                engine.set_prompt(session, controls.prompt)
            (out,) = engine.run_block([session], {session.id: BlockControls(controls)})
            latents.append(out.latents.numpy())
            text_bytes.append(session.text.nbytes())
        return {
            "latents": np.concatenate(latents, axis=2),
            "text_bytes": text_bytes,
            "text_k": [k.float().numpy() for k in session.text.keys],
            "text_v": [v.float().numpy() for v in session.text.values],
        }


def recache_event(groups: GroupHandles, settings: EngineSettings, request: SessionRequest, prompt: str, blocks: int,
                  at: int) -> dict:
    """On every rank: a session whose event `prompt` before block `at` is recached, and its teacher-forced ground
    truth (bench.recache): each with its latents and this rank's cache shards as the event left them."""
    from bench.recache import event_rollout, ground_truth

    sp = SequenceParallel(groups.data)
    engine = WorldModelEngine.load(settings, sp, groups.decode, Mesh.build(sp, settings.tp_degree, timeout_s=600))
    recached = event_rollout(engine, request, blocks, at, prompt, recache=True)
    return {"recached": recached, "truth": ground_truth(engine, request, blocks, at, prompt, recached)}


# -- serving members (launch/local_group): a setup run in each member's process, and calls into a member --

ADMISSIONS = {"request_geometry": 0, "check_request": 0, "open_session": 0}


def count_admissions(rank: int) -> None:
    """Count, in this member's process, the request checks and the session openings it runs."""
    import backend.api.codec as codec
    import backend.engine.rollout as rollout
    import backend.serving.admission as admission

    def counted(owner: object, name: str):
        real = getattr(owner, name)

        def wrapper(*args, **kwargs):
            ADMISSIONS[name] += 1
            return real(*args, **kwargs)

        setattr(owner, name, wrapper)

    counted(admission, "request_geometry")
    counted(rollout.WorldModelEngine, "open_session")
    counted(codec, "check_request")


def admission_counts(member) -> dict[str, int]:
    return dict(ADMISSIONS)


def open_sessions(member) -> int:
    """Sessions whose caches this member holds."""
    return sum(here.engine is not None for here in dict(member.loop.here).values())


def planned_blocks(member) -> dict[str, int]:
    """Blocks planned per session not ended, as this member's scheduler copy has them."""
    return {sid: s.computed for sid, s in list(member.loop.scheduler.table.items())}


def parked_sessions(member) -> int:
    """Worlds parked off their slot, as this member's scheduler copy has them."""
    return sum(s.in_park for s in list(member.loop.scheduler.table.values()))


def weight_bytes(member) -> int:
    """The transformer weights this member holds."""
    return member.loop.engine.transformer.weight_bytes()


# -- snapshots (tests/test_snapshots.py): a steered session saved after a block and resumed, on any layout --


def play(engine: WorldModelEngine, session, steps: list, first: int, save_after: int | None = None,
         save=None) -> dict:
    """`steps[first:]` of a steered session (a step's prompt event set, and recached if it asks, before its block),
    each block decoded; after block `save_after`, `save(session)`. Returns each block's latents and, on the
    session's owner, its frames, and what `save` returned."""
    from backend.engine.blocks import BlockControls

    latents, frames, saved = [], [], None
    for index in range(first, len(steps)):
        controls = steps[index]
        if controls.prompt is not None:
            engine.set_prompt(session, controls.prompt)
            if controls.recache:
                engine.recache(session)
        (out,) = engine.run_block([session], {session.id: BlockControls(controls, recached=controls.recache)})
        latents.append(out.latents.numpy())
        block_frames = engine.decode(session.decoding, out)
        if block_frames is not None:
            frames.append(block_frames)
        if index == save_after:
            saved = save(session)
    return {"latents": latents, "frames": frames, "saved": saved}


def save_in_group(engine: WorldModelEngine, session, store) -> str:
    """Every rank writes its parts into the owner's reservation; the owner publishes them (the entries gathered
    here by torch.distributed; the serving loop brings them to the owner in its own messages)."""
    import torch.distributed as dist

    from backend.engine.snapshot.files import write_part

    rank, group = engine.sp.rank, engine.sp.group
    size = engine.snapshot_facts.snapshot_size(session.request, session.geometry, session.block_index,
                                               session.commits is not None)
    snapshot_id = [store.reserve(size.total) if rank == session.owner else None]
    if group is not None:
        dist.broadcast_object_list(snapshot_id, group_src=session.owner, group=group)
    folder = store.staging(snapshot_id[0])
    parts = snapshots.session_parts(engine, session)
    if (decode := snapshots.decode_part(engine.vae, engine.sp.rank, session.decoding)) is not None:
        parts.append(decode)
    entries = [write_part(folder, part) for part in parts]
    every = [entries]
    if group is not None:
        every = [None] * engine.sp.degree
        dist.all_gather_object(every, entries, group=group)
    if rank == session.owner:
        files = [entry for rank_entries in every for entry in rank_entries]
        store.publish(snapshot_id[0], engine.snapshot_facts.manifest(snapshot_id[0], session.geometry.latent_height, files))
    if group is not None:
        dist.barrier(group=group)
    return snapshot_id[0]


def resume_and_play(engine: WorldModelEngine, store, snapshot_id: str, steps: list, fork_seed: int | None = None,
                    owner: int = 0) -> dict:
    """The rest of `steps` from a snapshot (resumed on this engine's layout): the owner opens it, the others
    build it from its manifest's text (as the serving loop shares it)."""
    import torch.distributed as dist

    from backend.engine.snapshot.restore import read_request

    text = [store.open(snapshot_id).manifest.to_text() if engine.sp.rank == owner else None]
    if engine.sp.group is not None:
        dist.broadcast_object_list(text, group_src=owner, group=engine.sp.group)
    from backend.engine.snapshot.store import snapshot_at

    snapshot = snapshot_at(store.root, snapshot_id, text[0])
    geometry = engine.geometry_of(read_request(snapshot))
    session = snapshots.resume(engine, snapshot, geometry, owner=owner, fork_seed=fork_seed)
    try:
        return play(engine, session, steps, session.block_index)
    finally:
        engine.close_session(session)


def snapshot_roundtrip(groups: GroupHandles, settings: EngineSettings, request: SessionRequest, steps: list,
                       save_after: int, store_root: str, resume_ids: list[str]) -> dict:
    """On every rank of a tp_degree x sp_degree group: the steered session through `steps`, saved after block
    `save_after`; then its own snapshot and each of `resume_ids` resumed and played to the end."""
    from backend.engine.snapshot.store import SnapshotStore

    sp = SequenceParallel(groups.data)
    engine = WorldModelEngine.load(settings, sp, groups.decode, Mesh.build(sp, settings.tp_degree, timeout_s=600))
    store = SnapshotStore(store_root, quota_bytes=1 << 30, ttl_s=3600)
    with engine.session(request, keep_commits=True) as session:
        whole = play(engine, session, steps, 0, save_after, lambda s: save_in_group(engine, s, store))
    resumed = {sid: resume_and_play(engine, store, sid, steps) for sid in [whole["saved"], *resume_ids]}
    return {"whole": whole, "resumed": resumed, "snapshot_id": whole["saved"],
            "damaged": damaged_resume(engine, store, whole["saved"], steps)}


def damaged_resume(engine: WorldModelEngine, store, snapshot_id: str, steps: list) -> str:
    """A byte of the last rank's kv file flipped: the code every rank's resume raises (only that rank reads the
    file), then the file mended and the resume run again (the group goes on)."""
    import torch.distributed as dist

    from backend.engine.snapshot.manifest import SnapshotError

    path = store.root / snapshot_id / f"kv-{engine.sp.degree - 1}.safetensors"
    pristine = path.read_bytes()
    if engine.sp.rank == 0:
        damaged = bytearray(pristine)
        damaged[len(damaged) // 2] ^= 1
        path.write_bytes(bytes(damaged))
    dist.barrier(group=engine.sp.group)
    try:
        resume_and_play(engine, store, snapshot_id, steps)
        code = "none"
    except SnapshotError as exc:
        code = exc.refusal.code
    dist.barrier(group=engine.sp.group)
    if engine.sp.rank == 0:
        path.write_bytes(pristine)
    dist.barrier(group=engine.sp.group)
    resume_and_play(engine, store, snapshot_id, steps)
    return code


def loop_sleeps(member) -> bool:
    """Whether the member's group loop sleeps on the doorbell now (idle: in ControlPlane.wait_idle)."""
    import sys

    frame = sys._current_frames().get(member.loop._thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "wait_idle":
            return True
        frame = frame.f_back
    return False
