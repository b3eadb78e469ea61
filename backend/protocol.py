"""The wire contract of the `lingbot_world` Triton model: tensor names, dtypes and request parameters.

Pure Python (no torch) so the client can import it without the server's dependencies.
"""
from __future__ import annotations

MODEL_NAME = "lingbot_world"

# Inputs (all required unless listed in OPTIONAL_INPUTS).
IMAGE = "image"  # UINT8 [H, W, 3]: first frame, resized to (height, width) by the server
PROMPT = "prompt"  # BYTES [1]: UTF-8 text prompt
CAMERA_POSES = "camera_poses"  # FP32 [num_frames, 4, 4]: camera-to-world, OpenCV axes (x right, y down, z fwd)
CAMERA_INTRINSICS = "camera_intrinsics"  # FP32 [num_frames, 4]: fx, fy, cx, cy in pixels of (height, width)
NUM_FRAMES = "num_frames"  # INT32 [1]: video frames, 1 + 4 * (latent frames - 1)
SEED = "seed"  # INT64 [1]
HEIGHT = "height"  # INT32 [1]
WIDTH = "width"  # INT32 [1]

REQUIRED_INPUTS = (IMAGE, PROMPT, CAMERA_POSES, NUM_FRAMES, SEED, HEIGHT, WIDTH)
OPTIONAL_INPUTS = (CAMERA_INTRINSICS,)

# Outputs, one response per AR block; the last block's response carries the final flag.
BLOCK_INDEX = "block_index"  # INT32 [1]
NUM_BLOCKS = "num_blocks"  # INT32 [1]
LATENTS = "latents"  # FP32 [C, block_frames, h, w]: the block's denoised latents (normalised model space)
FRAMES = "frames"  # UINT8 [n, height, width, 3]: decoded RGB frames of this block (n = 0 without a VAE)
TIMING_MS = "timing_ms"  # FP32 [3]: DiT compute of this block, VAE decode of this block, since request arrival

# Optional per-request parameters (Triton request `parameters`).
PARAM_DECODE = "decode"  # bool, default true: decode frames with the VAE
PARAM_RETURN_LATENTS = "return_latents"  # bool, default true: send the latents tensor

# Video geometry shared by server and client.
VAE_TEMPORAL_FACTOR = 4


def video_frames_for(latent_frames: int) -> int:
    return 1 + VAE_TEMPORAL_FACTOR * (latent_frames - 1)
