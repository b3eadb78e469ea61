"""The wire contract of the `lingbot_world` Triton model, as one table.

config.pbtxt's inputs and outputs, the server's dtype checks and the client's tensor packing are all
derived from `INPUTS` and `OUTPUTS`. Pure Python and numpy (no torch), so the client imports it alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MODEL_NAME = "lingbot_world"

# numpy dtype -> Triton's wire name (config.pbtxt writes it as TYPE_<name>, STRING for BYTES).
TRITON_DTYPES: dict[np.dtype, str] = {
    np.dtype(np.uint8): "UINT8",
    np.dtype(np.int32): "INT32",
    np.dtype(np.int64): "INT64",
    np.dtype(np.float32): "FP32",
    np.dtype(np.object_): "BYTES",
    np.dtype(np.bool_): "BOOL",
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: np.dtype
    dims: tuple[int, ...]  # -1: any size
    doc: str
    optional: bool = False
    minimum: int | None = None  # a one-value integer input's smallest value
    positive_columns: int = 0  # a float input's leading columns, each above 0 in every row

    @property
    def triton_dtype(self) -> str:
        return TRITON_DTYPES[self.dtype]


def _spec(name: str, dtype: type, dims: tuple[int, ...], doc: str, optional: bool = False,
          minimum: int | None = None, positive_columns: int = 0) -> TensorSpec:
    return TensorSpec(name, np.dtype(dtype), dims, doc, optional, minimum, positive_columns)


IMAGE = "image"
PROMPT = "prompt"
CAMERA_POSES = "camera_poses"
CAMERA_INTRINSICS = "camera_intrinsics"
ACTION = "action"
NUM_FRAMES = "num_frames"
SEED = "seed"
HEIGHT = "height"
WIDTH = "width"
# The first frame's largest size as sent (height x width): the server's default `max_input_pixels`, and the
# browser bridge's limit on an uploaded picture, read from its header before it is decoded.
MAX_INPUT_PIXELS = 4096 * 4096

# A prompt's largest size in UTF-8 bytes (umT5 reads at most text_len = 512 tokens of it anyway).
MAX_PROMPT_BYTES = 4096

# Every input is optional to Triton: which ones a request needs depends on its kind, checked by the model.
# A whole trajectory: image, prompt, camera_poses (every frame), num_frames, seed, height, width.
# A steered session's first request: the same without num_frames, with the first block's camera (camera_poses
# for its 9 frames, or action). Each later step: the next block's camera (12 frames' poses, or action), and
# optionally a new prompt (a prompt event).
INPUTS: tuple[TensorSpec, ...] = (
    _spec(IMAGE, np.uint8, (-1, -1, 3), "first frame, resized to height x width by the server", optional=True),
    _spec(PROMPT, np.object_, (1,), f"UTF-8 text prompt (at most {MAX_PROMPT_BYTES} bytes). On a steered step: a "
          "prompt event, the session's prompt from that step's block on (its response is the first block under "
          "it; the history, camera and noise go on)", optional=True),
    _spec(CAMERA_POSES, np.float32, (-1, 4, 4), "camera-to-world poses, OpenCV axes: every frame of a whole "
          "trajectory, or a steered block's new frames", optional=True),
    _spec(CAMERA_INTRINSICS, np.float32, (-1, 4), "fx, fy, cx, cy in output pixels (first row used); default 60 "
          "degree FOV", optional=True, positive_columns=2),
    _spec(ACTION, np.object_, (1,), "keys held during a steered block, e.g. \"wa\" (see backend/api/controls.py)",
          optional=True),
    _spec(NUM_FRAMES, np.int32, (1,), "video frames of a whole trajectory: 1 + 4k, a whole number of AR blocks",
          optional=True, minimum=1),
    _spec(SEED, np.int64, (1,), "noise seed", optional=True),
    _spec(HEIGHT, np.int32, (1,), "output height in pixels", optional=True, minimum=1),
    _spec(WIDTH, np.int32, (1,), "output width in pixels", optional=True, minimum=1),
)

BLOCK_INDEX = "block_index"
NUM_BLOCKS = "num_blocks"
LATENTS = "latents"
FRAMES = "frames"
TIMING_MS = "timing_ms"
HELD = "held"
CAMERA_USED = "camera_used"
PROMPT_USED = "prompt_used"
LATENTS_SHA256 = "latents_sha256"
SETTINGS_USED = "settings_used"
RECACHED = "recached"
QUEUE_POSITION = "queue_position"
WAIT_S = "wait_s"
SNAPSHOT_ID = "snapshot_id"
SNAPSHOT_ERROR = "snapshot_error"
SAVES = "saves"

# One response per AR block; the last block's response carries the final flag.
OUTPUTS: tuple[TensorSpec, ...] = (
    _spec(BLOCK_INDEX, np.int32, (1,), "index of this AR block"),
    _spec(NUM_BLOCKS, np.int32, (1,), "AR blocks of the session"),
    _spec(LATENTS, np.float32, (-1, -1, -1, -1), "[z, block_frames, h, w] denoised latents (when requested)"),
    _spec(FRAMES, np.uint8, (-1, -1, -1, 3), "[n, height, width, 3] decoded RGB frames of this block (n = 0 without decode)"),
    _spec(TIMING_MS, np.float32, (3,), "DiT compute, VAE decode, time since the request arrived (ms)"),
    _spec(HELD, np.bool_, (1,), "the block ran on held controls: its step came late (on_starve=hold)"),
    # What the block was made from (request parameter return_used): what a recording keeps, a replay checks.
    _spec(CAMERA_USED, np.float32, (-1, 4, 4), "camera-to-world poses of the block's new video frames as the server "
          "ran them (a held block's included); with return_used"),
    _spec(PROMPT_USED, np.object_, (1,), "the prompt in force for this block (after any prompt event); with "
          "return_used"),
    _spec(LATENTS_SHA256, np.object_, (1,), "hex SHA-256 of the block's latents (float32 [z, block_frames, h, w], "
          "C order); with return_used"),
    _spec(SETTINGS_USED, np.object_, (1,), "the server settings the latents depend on, key=value;... (a session's "
          "first block only; with return_used)"),
    _spec(RECACHED, np.bool_, (1,), "the cached frames' self-attention K/V were recomputed under this block's prompt "
          "before it (a prompt event with request parameter recache); with return_used"),
    # A session waiting for a slot is told its place in the queue, at once and whenever it changes, by a response of
    # these two alone (no block_index: not a block); 0 when it leaves the queue for a slot.
    _spec(QUEUE_POSITION, np.int32, (1,), "a waiting session's place in the queue (1: next), in a response without a "
          "block; 0: it has a slot now and its first block is being computed"),
    _spec(WAIT_S, np.float32, (1,), "with queue_position: the estimated seconds until a slot, from measured block "
          "times (sessions without a set length are counted at their lifetime limit, so it is an upper bound)"),
    # A save asked for with request parameter `save` is told in a response of its own (no block), on the session's
    # open request, once its snapshot is durable: its id, or why it failed.
    _spec(SNAPSHOT_ID, np.object_, (1,), "a saved snapshot of this steered session, durable now (in a response "
          "without a block): resume or fork the world from it with request parameter resume"),
    _spec(SNAPSHOT_ERROR, np.object_, (1,), "with snapshot_id: the save failed, and why (a refusal's text: [CODE] "
          "sentence); nothing of it can be resumed"),
    # The answer to request parameter `saves`: the key's own snapshots, in the one final response of that request.
    _spec(SAVES, np.object_, (1,), "the request's key's snapshots, UTF-8 JSON: {\"key\": its name, \"bytes\": what its "
          "snapshots and saves under way hold, \"quota_bytes\": its snapshot_bytes or null, \"snapshots\": [{\"id\", "
          "\"bytes\", \"created_unix_s\", \"shared\"}, ...] oldest first} (request parameter saves)"),
)

QUEUE_OUTPUTS = (QUEUE_POSITION, WAIT_S)
SNAPSHOT_OUTPUTS = (SNAPSHOT_ID, SNAPSHOT_ERROR)
BLOCK_OUTPUTS = tuple(s.name for s in OUTPUTS if s.name not in QUEUE_OUTPUTS + SNAPSHOT_OUTPUTS + (SAVES,))
INPUT_SPECS: dict[str, TensorSpec] = {s.name: s for s in INPUTS}
OUTPUT_SPECS: dict[str, TensorSpec] = {s.name: s for s in OUTPUTS}
WHOLE_TRAJECTORY_INPUTS = (IMAGE, PROMPT, CAMERA_POSES, NUM_FRAMES, SEED, HEIGHT, WIDTH)
SESSION_START_INPUTS = (IMAGE, PROMPT, SEED, HEIGHT, WIDTH)  # plus camera_poses or action


@dataclass(frozen=True)
class ParameterSpec:
    name: str
    default: bool | int | str
    doc: str
    choices: tuple[str, ...] = ()  # a string parameter's allowed values (empty: any)
    minimum: int | None = None  # an integer parameter's smallest value


PARAM_DECODE = "decode"
PARAM_RETURN_LATENTS = "return_latents"
PARAM_ON_STARVE = "on_starve"
PARAM_MAX_BLOCKS = "max_blocks"
PARAM_RETURN_USED = "return_used"
PARAM_EXPECT_SETTINGS = "expect_settings"
PARAM_POSE_SCALE = "pose_scale"
PARAM_PAUSE = "pause"
PARAM_RECACHE = "recache"
PARAM_SAVE = "save"
PARAM_RESUME = "resume"
PARAM_FORK_SEED = "fork_seed"
PARAM_RELEASE = "release"
PARAM_SHARE = "share"
PARAM_SAVES = "saves"
PARAM_SNAPSHOT = "snapshot"
NO_FORK = -1  # fork_seed's default: the saved noise goes on
SNAPSHOT_ID_PATTERN = "[0-9a-f]{32}"  # a snapshot id: 128 random bits, a capability (docs/worlds.md)
ON_STARVE = ("wait", "hold")  # a steered session whose next step is late: wait for it, or repeat the last motion
SAVES_ACTIONS = ("", "list", "share", "unshare")  # request parameter saves: none, or what to do with the key's saves
POSE_SCALES = ("clip", "running")  # a whole trajectory's translation scale: the clip's largest, or the largest so far

# Per-request parameters (Triton request `parameters`); a steered session takes its settings from its first request.
REQUEST_PARAMETERS: tuple[ParameterSpec, ...] = (
    ParameterSpec(PARAM_DECODE, True, "decode the block's frames with the VAE"),
    ParameterSpec(PARAM_RETURN_LATENTS, True, "send the latents tensor"),
    ParameterSpec(PARAM_ON_STARVE, ON_STARVE[0], "steered: when the next step is late, 'wait' for it or 'hold' the "
                  "last motion", choices=ON_STARVE),
    ParameterSpec(PARAM_MAX_BLOCKS, 0, "steered: end the session after this many blocks (0: when the client ends it)",
                  minimum=0),
    ParameterSpec(PARAM_RETURN_USED, False, "send what each block was made from: camera_used, prompt_used, "
                  "latents_sha256 (and settings_used on the first block)"),
    ParameterSpec(PARAM_EXPECT_SETTINGS, "", "refuse the request unless this server's settings_used equal these "
                  "key=value pairs (a replay's check; empty: no check)"),
    ParameterSpec(PARAM_POSE_SCALE, POSE_SCALES[0], "whole trajectory: divide camera translations by the clip's "
                  "largest ('clip', as the reference) or by the largest so far ('running', as a steered session "
                  "does: a steered recording replays bit for bit)", choices=POSE_SCALES),
    ParameterSpec(PARAM_RECACHE, False, "steered: on a step with a prompt event ('prompt'), recompute the "
                  "self-attention K/V of every cached frame (sink and window) under the new prompt before its block, "
                  "so the old prompt does not linger in the window; one forward per cached block, run as a block "
                  "boundary of its own (the group's other sessions wait for it once)"),
    ParameterSpec(PARAM_PAUSE, False, "steered: a pause, a step without a camera that keeps the session open while "
                  "the client sends nothing: held without a block until the sequence's next request (then answered "
                  "empty, first) or the session's end; the idle limit does not run meanwhile, and a client that "
                  "disconnects ends the session at once. No camera, prompt, start or end flag"),
    ParameterSpec(PARAM_SAVE, False, "steered: save the world after this request's block, a snapshot in the "
                  "server's snapshot_dir (refused at once, the block not run, when the store has no room); its id "
                  "comes in a later response of its own (snapshot_id) once it is durable (docs/worlds.md)"),
    ParameterSpec(PARAM_RESUME, "", "a steered session's start: open the world of this snapshot id where it was "
                  "saved, on any group with the same settings (its image, prompt, seed, size and session "
                  "parameters are the snapshot's: send none of them, only the next block's camera_poses (12 new "
                  "frames at 3 latent frames a block) or action, and a prompt event's prompt and recache as a step "
                  "would); its first response is the block after the snapshot's"),
    ParameterSpec(PARAM_RELEASE, "", "with save: the id of an older snapshot of this world that it no longer needs "
                  "(a periodic save's predecessor): deleted once this save is durable, its bytes freed (nothing is "
                  "deleted when this save fails); empty: none"),
    ParameterSpec(PARAM_SHARE, False, "with save: any key that holds the snapshot's id may resume and fork it (without "
                  "it only the key that saved it may; a release is its key's alone); saves=share shares it later"),
    ParameterSpec(PARAM_SAVES, "", "a request without inputs about its key's own snapshots (a server with keys): "
                  "'list' answers with them in output saves; 'share' and 'unshare' change the one request parameter "
                  "snapshot names (its key's own), then answer the same; send it with the start and end flags of a "
                  "new sequence", choices=SAVES_ACTIONS),
    ParameterSpec(PARAM_SNAPSHOT, "", "with saves=share or saves=unshare: the snapshot id"),
    ParameterSpec(PARAM_FORK_SEED, NO_FORK, "with resume: draw the noise from this seed from the resumed block "
                  f"on, so the same steps make another world ({NO_FORK}: the saved noise goes on)", minimum=NO_FORK),
)

# A client's key (docs/security.md) travels in this gRPC header; tritonserver forwards it to the model as a request
# parameter of the same name (--grpc-header-forward-pattern), which the owner checks before any work and strips.
KEY_HEADER = "lingbot-key"

# Triton sequence flags on a request (python backend `request.flags()`).
SEQUENCE_START = 1
SEQUENCE_END = 2

# Video geometry shared by server and client.
VAE_TEMPORAL_FACTOR = 4
BLOCK_FRAMES = 3  # latent frames per AR block (the engine's default block_frames)


def video_frames_for(latent_frames: int) -> int:
    return 1 + VAE_TEMPORAL_FACTOR * (latent_frames - 1)


def block_video_frames(block_frames: int, first: bool) -> int:
    """New video frames of one AR block of `block_frames` latent frames: 1 + 4 (n - 1) for the first (9 at 3,
    13 at 4), 4 n for every later one (12 at 3, 16 at 4)."""
    return video_frames_for(block_frames) if first else VAE_TEMPORAL_FACTOR * block_frames


def whole_block_frames(blocks: int, block_frames: int = BLOCK_FRAMES) -> int:
    """Video frames of `blocks` whole AR blocks: 9, 21, 33, ... 81 (7 blocks) at 3 latent frames a block."""
    return video_frames_for(blocks * block_frames)


def frames_rule(block_frames: int = BLOCK_FRAMES) -> str:
    """The valid num_frames in words, with examples."""
    step = VAE_TEMPORAL_FACTOR * block_frames
    examples = ", ".join(str(whole_block_frames(b, block_frames)) for b in (1, 2, 4))
    examples += f" or {whole_block_frames(7, block_frames)}"
    return f"{whole_block_frames(1, block_frames)} + {step} x k, whole AR blocks (e.g. {examples})"


@dataclass(frozen=True)
class ErrorCode:
    """A refusal's or an ending's machine-readable code: its error text starts `[CODE] ` (see api/refusal)."""

    name: str
    doc: str  # when a client gets it
    action: str  # what the client does
    retry_after: bool = False  # its text carries retry_after_s
    snapshot: bool = False  # its text carries snapshot_id (where the session's world was saved)


CAPACITY_EXHAUSTED = "CAPACITY_EXHAUSTED"
INVALID_INPUT = "INVALID_INPUT"
SETTINGS_MISMATCH = "SETTINGS_MISMATCH"
SESSION_EXISTS = "SESSION_EXISTS"
SESSION_UNKNOWN = "SESSION_UNKNOWN"
EXPIRED = "EXPIRED"
CANCELLED = "CANCELLED"
OUT_OF_MEMORY = "OUT_OF_MEMORY"
OPEN_FAILED = "OPEN_FAILED"
DECODE_FAILED = "DECODE_FAILED"
GROUP_FAILED = "GROUP_FAILED"
SERVER_STOPPING = "SERVER_STOPPING"
RELOAD_REFUSED = "RELOAD_REFUSED"
AUTH_REQUIRED = "AUTH_REQUIRED"
AUTH_INVALID = "AUTH_INVALID"
USER_SESSION_LIMIT = "USER_SESSION_LIMIT"
QUOTA_EXHAUSTED = "QUOTA_EXHAUSTED"
SNAPSHOT_UNKNOWN = "SNAPSHOT_UNKNOWN"
SNAPSHOT_PENDING = "SNAPSHOT_PENDING"
SNAPSHOT_EXPIRED = "SNAPSHOT_EXPIRED"
SNAPSHOT_INVALID = "SNAPSHOT_INVALID"
SNAPSHOT_STORE_FULL = "SNAPSHOT_STORE_FULL"
SNAPSHOT_SAVE_FAILED = "SNAPSHOT_SAVE_FAILED"
MOVED = "MOVED"
BOOKS_UNAVAILABLE = "BOOKS_UNAVAILABLE"
SNAPSHOT_NOT_YOURS = "SNAPSHOT_NOT_YOURS"
SNAPSHOT_KEY_FULL = "SNAPSHOT_KEY_FULL"

ERROR_CODES: tuple[ErrorCode, ...] = (
    ErrorCode(CAPACITY_EXHAUSTED, "every slot is taken and the queue is full (max_queue sessions wait)",
              "retry after retry_after_s (the estimated wait of the queue's last place)", retry_after=True),
    ErrorCode(INVALID_INPUT, "an input or a request parameter is wrong (the sentence names it and what is "
              "expected), or the request does not fit this server's limits", "fix the request"),
    ErrorCode(SETTINGS_MISMATCH, "request parameter expect_settings differs from this server's settings_used (a "
              "replay against another checkpoint or settings), or a snapshot to resume was saved on other settings "
              "or another model (the sentence names each difference)", "replay or resume on a server with those "
              "settings"),
    ErrorCode(SESSION_EXISTS, "a start flag on a sequence whose session still runs", "end it first, or use a new "
              "sequence id"),
    ErrorCode(SESSION_UNKNOWN, "a step of a sequence with no running session: it never started here, or it ended "
              "(the sentence says how)", "start a new session"),
    ErrorCode(EXPIRED, "a steered session reached session_idle_timeout_s without a step, or max_session_s",
              "start a new session"),
    ErrorCode(CANCELLED, "its client went away (logged and counted; nobody is left to tell)", "none"),
    ErrorCode(OUT_OF_MEMORY, "the server had no memory to open this session", "retry later, or ask for fewer "
              "frames or a smaller height x width", retry_after=True),
    ErrorCode(OPEN_FAILED, "the session could not be opened for another reason (in the server log)",
              "retry; if it fails again, tell the operator"),
    ErrorCode(DECODE_FAILED, "a block could not be decoded into frames", "retry; if it fails again, tell the "
              "operator"),
    ErrorCode(GROUP_FAILED, "the group lost a model instance: the stream cannot go on; the server reloads the "
              "model by itself", "retry after retry_after_s (the model is reloading)", retry_after=True),
    ErrorCode(SERVER_STOPPING, "the model is being unloaded (a stop, or an operator's unload)",
              "retry after retry_after_s, on this server once it is back or on another", retry_after=True),
    ErrorCode(RELOAD_REFUSED, "a load of the model while it serves (the operator's API)", "unload it first"),
    ErrorCode(AUTH_REQUIRED, "this server serves keys only (it was started with a keys file) and the request "
              "carried none", f"send your key in the gRPC header '{KEY_HEADER}'"),
    ErrorCode(AUTH_INVALID, "the request's key is not one of this server's keys; a session whose key the operator "
              "revoked ends with it too", "ask the operator for a key"),
    ErrorCode(USER_SESSION_LIMIT, "the key already has its limit of sessions: its `sessions` hold a slot and its "
              "`queue` wait for one (the keys file)", "end one of the key's sessions first"),
    ErrorCode(QUOTA_EXHAUSTED, "the key has used its `blocks_per_hour` (the keys file); a session of the key that "
              "meets it ends with it", "retry after retry_after_s, when enough of the hour's blocks have aged out",
              retry_after=True),
    ErrorCode(SNAPSHOT_UNKNOWN, "no snapshot with this id in the server's snapshot store: it was never saved there, "
              "its save failed, or it expired so long ago that the store forgot it", "check the id and the server; "
              "else start a new session"),
    ErrorCode(SNAPSHOT_PENDING, "the snapshot's save is still under way (its files are being written, on this "
              "group or another that shares the store): it is not durable yet", "resume it again after retry_after_s",
              retry_after=True),
    ErrorCode(SNAPSHOT_EXPIRED, "the snapshot outlived the store's time to live and was deleted",
              "start a new session (resume snapshots within the time to live)"),
    ErrorCode(SNAPSHOT_INVALID, "a file of the snapshot is missing, truncated, corrupted or altered (its size or "
              "SHA-256 differs from its manifest's), or its manifest is malformed: nothing was served from it",
              "resume another snapshot, or start a new session; tell the operator"),
    ErrorCode(SNAPSHOT_STORE_FULL, "saving this snapshot would exceed the store's size quota (nothing was written)",
              "save again after retry_after_s, when older snapshots have expired; the session goes on meanwhile",
              retry_after=True),
    ErrorCode(SNAPSHOT_KEY_FULL, "saving this snapshot would pass its key's snapshot_bytes (the keys file): the key's "
              "own snapshots and saves under way hold too much (nothing was written)", "release or let expire some of "
              "the key's snapshots (request parameter saves=list lists them), or save again after retry_after_s; the "
              "session goes on meanwhile", retry_after=True),
    ErrorCode(SNAPSHOT_NOT_YOURS, "the snapshot was saved by another key: resuming or forking it needs its owner to "
              "share it, and releasing it is its owner's alone", "ask its owner to share it (saves=share), or use "
              "your own snapshots"),
    ErrorCode(BOOKS_UNAVAILABLE, "the fleet's books (the store that holds every key's quotas across its groups) did "
              "not answer in time, so no new session of a key with limits is admitted; running sessions go on",
              "retry after retry_after_s", retry_after=True),
    ErrorCode(SNAPSHOT_SAVE_FAILED, "writing a snapshot failed after its block ran (snapshot_error; the server log "
              "says why): nothing of it can be resumed", "save again; the session goes on"),
    ErrorCode(MOVED, "the group is draining (an operator's restart or move): the session was saved and ended here; "
              "its text carries snapshot_id", "resume it with request parameter resume=snapshot_id on the same address "
              "(another group takes it), then send again the steps sent after its last block", snapshot=True),
)
ERROR_CODE_SPECS: dict[str, ErrorCode] = {c.name: c for c in ERROR_CODES}
