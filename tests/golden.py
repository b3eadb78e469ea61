"""The golden rollout: latents of the tiny checkpoint (seed 0) stored in tests/data, so a change to what the engine
computes (RoPE positions, noise draws, the schedule, the cache, the camera, a prompt event, a recache) fails a fast
test. Two runs, one torch thread (the condition encode's bits depend on the thread count):

- steered: 6 blocks of held keys through the tiny window (9 frames, 3-frame sink: evictions from block 3 on),
  a prompt event before block 2, a prompt event with a recache before block 4;
- whole: a 3-block trajectory that starts away from the origin, moves and turns, with its own intrinsics.

When the model is meant to change, regenerate (it rewrites the data and its pinned SHA-256):

    .venv/bin/python tests/golden.py --write
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from backend.api.contract import whole_block_frames
from backend.api.request import Controls, SessionRequest
from backend.engine.blocks import BlockControls
from backend.engine.rollout import WorldModelEngine

DATA = Path(__file__).parent / "data" / "golden_rollout.npz"
PINNED = DATA.with_suffix(".sha256")  # the SHA-256 of DATA as --write left it
CHECKPOINT_SEED = 0  # the tests' tiny checkpoint (conftest.tiny_checkpoint)
# Where the CPU or torch differ from the writer's: float32 kernels (MKL's sgemm, ATen's vectorised ops, oneDNN)
# round differently. Measured on this data against its AVX-512 writer: ATen's scalar kernels with MKL on SSE4.2 and
# oneDNN on SSE4.1 (ATEN_CPU_CAPABILITY=default, MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA) differ by 1.5e-6 at
# most, the AVX2 kernels by 7e-7 (latents of scale 1). Blocks that restart their RoPE frame positions at 0 move
# them by 2e-2, another seed's noise by 3 (a shift of every position is no change: RoPE sees relative positions).
ATOL = 1e-4


@dataclass(frozen=True)
class Step:
    keys: str
    event: str | None = None  # a prompt event before the block
    recache: bool = False  # with it, the cache is recomputed under the new prompt


STEERED = (Step("w"), Step("wa"), Step("j", "it starts to snow"), Step("d"), Step("wl", "heavy rain falls", True),
           Step("s"))
WHOLE_BLOCKS = 3


def steered_request(request: SessionRequest) -> SessionRequest:
    return dataclasses.replace(request, num_frames=None, poses=None, keys=STEERED[0].keys, decode=False)


def whole_request(request: SessionRequest) -> SessionRequest:
    """A trajectory that starts away from the world's origin (turned, looking a little down, moved), then moves
    forward and turns left, seen through a longer lens than the default."""
    frames = whole_block_frames(WHOLE_BLOCKS)
    poses = np.tile(np.eye(4), (frames, 1, 1))
    angle = np.linspace(0.7, 1.3, frames)
    poses[:, 0, 0], poses[:, 0, 2], poses[:, 2, 0], poses[:, 2, 2] = (np.cos(angle), np.sin(angle), -np.sin(angle),
                                                                      np.cos(angle))
    pitch = np.array([[1.0, 0.0, 0.0], [0.0, np.cos(0.3), -np.sin(0.3)], [0.0, np.sin(0.3), np.cos(0.3)]])
    poses[:, :3, :3] = poses[:, :3, :3] @ pitch  # looking a little down
    poses[:, :3, 3] = np.array([2.0, -0.5, 1.0]) + np.linspace(0.0, 1.5, frames)[:, None] * poses[:, :3, 2]
    poses = poses.astype(np.float32)
    size = request.height
    intrinsics = np.array([[0.9 * size, 1.1 * size, 0.45 * size, 0.55 * size]], np.float32)
    return dataclasses.replace(request, num_frames=frames, poses=poses, intrinsics=intrinsics, seed=7, decode=False)


def steered_latents(engine: WorldModelEngine, request: SessionRequest, steps: tuple[Step, ...] = STEERED) -> np.ndarray:
    """[blocks, z, block_frames, h, w] of the steered run, events and recache as the serving loop applies them."""
    latents = []
    with engine.session(steered_request(request), keep_commits=True) as session:
        for step in steps:
            if step.event is not None:
                engine.set_prompt(session, step.event)
            if step.recache:
                engine.recache(session)
            (out,) = engine.run_block([session], {session.id: BlockControls(Controls(keys=step.keys), step.recache)})
            latents.append(out.latents[0].numpy())
    return np.stack(latents)


def whole_latents(engine: WorldModelEngine, request: SessionRequest) -> np.ndarray:
    return np.stack([out.latents[0].numpy() for out, _ in engine.generate(whole_request(request), decode=False)])


def rollouts(engine: WorldModelEngine, request: SessionRequest) -> dict[str, np.ndarray]:
    """Both runs on one torch thread; `request`: the tests' tiny_request."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {"steered": steered_latents(engine, request), "whole": whole_latents(engine, request)}
    finally:
        torch.set_num_threads(before)


def machine() -> dict[str, str]:
    """What the latents' bits depend on beyond the code: the CPU's kernel family, its vendor (MKL picks its kernels
    by vendor too: an Intel Xeon's AVX-512 gives other bits than an AMD EPYC's, by 7.7e-7 here) and torch's version."""
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_vendor": cpu_vendor(),
            "torch": torch.__version__}


def cpu_vendor() -> str:
    """The CPU's vendor as /proc/cpuinfo names it (GenuineIntel, AuthenticAMD), "" where it does not."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("vendor_id")), "")


def file_sha256(path: Path = DATA) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load() -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The stored latents and the machine that wrote them."""
    with np.load(DATA, allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    return arrays, json.loads(str(arrays.pop("machine")))


def write(engine: WorldModelEngine, request: SessionRequest) -> None:
    arrays = rollouts(engine, request)
    DATA.parent.mkdir(parents=True, exist_ok=True)
    with DATA.open("wb") as f:
        np.savez_compressed(f, machine=np.array(json.dumps(machine())), **arrays)
    PINNED.write_text(file_sha256() + "\n")
    shapes = {name: list(a.shape) for name, a in arrays.items()}
    print(f"wrote {DATA} ({DATA.stat().st_size} bytes, {shapes}, {machine()}) and {PINNED}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite the stored latents and their pinned SHA-256")
    args = parser.parse_args(argv)
    from backend.model.tiny_checkpoint import write_checkpoint
    from factories import tiny_settings, tiny_request

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = write_checkpoint(Path(tmp) / "tiny", "tiny", seed=CHECKPOINT_SEED)
        engine = WorldModelEngine.load(tiny_settings(str(checkpoint)))
        if args.write:
            write(engine, tiny_request())
            return 0
        stored, writer = load()
        for name, now in rollouts(engine, tiny_request()).items():
            print(f"{name}: max abs diff from the stored latents {np.abs(now - stored[name]).max():.3g} "
                  f"(written on {writer}, run on {machine()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
