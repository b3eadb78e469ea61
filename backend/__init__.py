"""Serving a LingBot-World-style causal AR-diffusion video DiT on Triton with Ulysses sequence parallelism.

Rooms, each importing only from the rooms listed before it:
`api` (torch-free wire contract, request checks, errors, settings parsing; shared with the client),
`parallel` (process group bootstrap, sequence-parallel exchanges), `model` (the DiT, VAE, text encoder,
checkpoint loading), `engine` (the AR rollout), `serving` (sessions, scheduler, intake, group loop, decode sender),
then `adapter` (the Triton Python-backend model) and `launch` (config rendering, tritonserver process).
"""

import os

# MKL's strict Conditional Numerical Reproducibility, read once at MKL's first call (so here, before any module
# of the package imports torch; spawned ranks and the Triton stubs inherit it). Without it MKL's float32 GEMM
# picks its kernel by shape and thread count: on AVX-512 (Sapphire Rapids) a Linear over K >= 320 inputs gives
# other bits for fewer than 16 rows (an SP rank's share of a block's tokens) than for the same rows among more,
# and a 1536-input Linear (the camera embedding) other bits at 1 and 2 threads. STRICT pins one kernel and
# reduction order: a row's result no longer depends on the rows beside it or on the thread count, which float32
# SP1 == SPn and server == direct engine rest on.
# A caller's own MKL_CBWR is kept; `tests/test_engine_parallel.py` checks the mode is in force.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
