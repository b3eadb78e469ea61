"""Stream one tiny request and save its latents: `python tests/stream_latents.py URL SEED OUT.npy`.

For clients that must run somewhere else than the test process (inside a network namespace).
"""
from __future__ import annotations

import sys

import numpy as np

import client  # noqa: F401  (first: it sets gRPC's fork handling before tritonclient loads)
from factories import tiny_request
from triton_harness import latents_of, stream

if __name__ == "__main__":
    url, seed, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    np.save(out, latents_of(stream(url, tiny_request(seed=seed))))
