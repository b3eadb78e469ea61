"""Write a perf_analyzer --input-data JSON holding one lingbot_world request (the benchmarks' request).

    python -m bench.make_perf_inputs                   # bench/perf_inputs/tiny.json: 64x64, 57 frames
    python -m bench.make_perf_inputs --workload gpu    # bench/perf_inputs/gpu_480x832_81f.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from backend.api import contract as p
from backend.api.request import SessionRequest
from bench.common import GPU, TINY, make_request

PERF_INPUTS_DIR = Path(__file__).resolve().parent / "perf_inputs"
WORKLOADS = {"tiny": (TINY, PERF_INPUTS_DIR / "tiny.json"), "gpu": (GPU, PERF_INPUTS_DIR / "gpu_480x832_81f.json")}


def perf_inputs(request: SessionRequest) -> dict:
    """{"data": [one request]}: every input as flat `content` plus `shape` (prompt as a string)."""
    def tensor(array) -> dict:
        return {"content": array.reshape(-1).tolist(), "shape": list(array.shape)}

    step = {
        p.IMAGE: tensor(request.image),
        p.PROMPT: {"content": [request.prompt], "shape": [1]},
        p.CAMERA_POSES: tensor(request.poses),
        p.CAMERA_INTRINSICS: tensor(request.camera_intrinsics()),
        p.NUM_FRAMES: {"content": [request.num_frames], "shape": [1]},
        p.SEED: {"content": [request.seed], "shape": [1]},
        p.HEIGHT: {"content": [request.height], "shape": [1]},
        p.WIDTH: {"content": [request.width], "shape": [1]},
    }
    return {"data": [step]}


def write_perf_inputs(workload: str, out: Path | None = None) -> Path:
    w, default_out = WORKLOADS[workload]
    out = out or default_out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(perf_inputs(make_request(w))))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="tiny",
                        help="tiny: 64x64 57 frames (CPU); gpu: 480x832 81 frames")
    parser.add_argument("--out", type=Path, help="output file (default: bench/perf_inputs/<workload>.json)")
    args = parser.parse_args()
    print(write_perf_inputs(args.workload, args.out))


if __name__ == "__main__":
    main()
