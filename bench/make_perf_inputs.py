"""Write a perf_analyzer --input-data JSON: one whole-trajectory request, or one steered session's steps.

    python -m bench.make_perf_inputs                   # bench/perf_inputs/tiny.json: 64x64, 57 frames
    python -m bench.make_perf_inputs --workload gpu    # bench/perf_inputs/gpu_480x832_81f.json
    python -m bench.make_perf_inputs --workload steer  # bench/perf_inputs/steer_tiny.json: a start + 5 steps

A steered workload is one stream of sequence steps (perf_analyzer sends them as one sequence, with the start
flag on the first and the end flag on the last): the first carries the image, prompt, size and the first
block's keys, each later one only the next block's keys.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from backend.api import contract as p
from backend.api.request import SessionRequest
from bench.common import GPU, TINY, make_request

PERF_INPUTS_DIR = Path(__file__).resolve().parent / "perf_inputs"
WORKLOADS = {"tiny": (TINY, PERF_INPUTS_DIR / "tiny.json"), "gpu": (GPU, PERF_INPUTS_DIR / "gpu_480x832_81f.json"),
             "steer": (TINY, PERF_INPUTS_DIR / "steer_tiny.json")}
STEER_KEYS = ("w", "w", "wa", "wa", "j", "j")  # the steered workload: one block per entry


def tensor(array) -> dict:
    return {"content": array.reshape(-1).tolist(), "shape": list(array.shape)}


def text(value: str) -> dict:
    return {"content": [value], "shape": [1]}


def perf_inputs(request: SessionRequest) -> dict:
    """{"data": [one request]}: every input as flat `content` plus `shape` (prompt as a string)."""
    step = {
        p.IMAGE: tensor(request.image),
        p.PROMPT: text(request.prompt),
        p.CAMERA_POSES: tensor(request.poses),
        p.CAMERA_INTRINSICS: tensor(request.camera_intrinsics()[None]),
        p.NUM_FRAMES: {"content": [request.num_frames], "shape": [1]},
        p.SEED: {"content": [request.seed], "shape": [1]},
        p.HEIGHT: {"content": [request.height], "shape": [1]},
        p.WIDTH: {"content": [request.width], "shape": [1]},
    }
    return {"data": [step]}


def steer_inputs(request: SessionRequest, keys: tuple[str, ...] = STEER_KEYS) -> dict:
    """{"data": [[start, step, ...]]}: one stream of a steered session's requests."""
    start = {
        p.IMAGE: tensor(request.image),
        p.PROMPT: text(request.prompt),
        p.ACTION: text(keys[0]),
        p.SEED: {"content": [request.seed], "shape": [1]},
        p.HEIGHT: {"content": [request.height], "shape": [1]},
        p.WIDTH: {"content": [request.width], "shape": [1]},
    }
    return {"data": [[start] + [{p.ACTION: text(k)} for k in keys[1:]]]}


def write_perf_inputs(workload: str, out: Path | None = None) -> Path:
    w, default_out = WORKLOADS[workload]
    out = out or default_out
    out.parent.mkdir(parents=True, exist_ok=True)
    request = make_request(w)
    out.write_text(json.dumps(steer_inputs(request) if workload == "steer" else perf_inputs(request)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="tiny",
                        help="tiny: 64x64 57 frames (CPU); gpu: 480x832 81 frames; steer: a steered session (CPU)")
    parser.add_argument("--out", type=Path, help="output file (default: bench/perf_inputs/<workload>.json)")
    args = parser.parse_args()
    print(write_perf_inputs(args.workload, args.out))


if __name__ == "__main__":
    main()
