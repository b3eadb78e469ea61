"""The decoupled model behind a real tritonserver, over real gRPC, on the tiny checkpoint."""
from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient

from backend.api import contract
from backend.engine.rollout import WorldModelEngine
from backend.launch.server import STUB_THREAD_ENVIRONMENT
from backend.serving.threads import CoreSplit, instance_cores
from client.stream import StreamError, StreamingSession, StreamRequest, request_inputs, run_sessions
from factories import forward_poses, tiny_request
from polling import wait_until
from triton_harness import inputs_with, latents_of, metrics, stream

pytestmark = pytest.mark.server  # starts real tritonservers

MODEL = contract.MODEL_NAME


@pytest.fixture(scope="module")
def server(sp1_server):
    return sp1_server


def assert_ready(server) -> None:
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        assert client.is_model_ready(MODEL)


def as_the_server(engine: WorldModelEngine, request) -> list:
    """The engine's rollout on the threads an SP1 server's instance uses: float sums depend on the thread count
    (its DiT's share of the cores; its decode has as many on an even core count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(CoreSplit.of(instance_cores(1)).dit)
    try:
        return engine.generate(request)
    finally:
        torch.set_num_threads(before)


def test_stream_matches_engine_bit_for_bit(server, engine: WorldModelEngine) -> None:
    request = tiny_request()
    blocks = stream(server.grpc_url, request)
    direct = as_the_server(engine, request)
    assert [b.block_index for b in blocks] == list(range(5)) and all(b.num_blocks == 5 for b in blocks)
    for block, (out, frames) in zip(blocks, direct):
        assert np.array_equal(block.frames, frames)
        assert np.array_equal(block.latents, out.latents[0].numpy())
        dit_ms, decode_ms, since_arrival_ms = block.timing_ms
        assert dit_ms > 0 and decode_ms > 0 and since_arrival_ms >= dit_ms


def test_blocks_arrive_as_they_are_ready(server) -> None:
    blocks = stream(server.grpc_url, tiny_request())
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(blocks, blocks[1:])]
    # Streamed, not buffered: every block arrives a block's compute after the one before it.
    assert min(gaps) > 0.01, gaps


def test_concurrent_streams_all_complete_correctly(server, engine: WorldModelEngine) -> None:
    lengths = (21, 9, 33, 21)  # different clip lengths (2, 1, 3, 2 blocks) share forwards
    requests = [tiny_request(num_frames=n, seed=s, poses=forward_poses(n, 0.02 * s)) for s, n in enumerate(lengths)]
    results = run_sessions(server.grpc_url, [StreamRequest(request_inputs(r), request_id=f"c{i}") for i, r in
                                             enumerate(requests)], timeout=180)
    for request, result in zip(requests, results):
        assert result.error is None, result.error
        assert [b.block_index for b in result.blocks] == list(range((1 + (request.num_frames - 1) // 4) // 3))
        direct = engine.generate(request)
        expected = np.concatenate([out.latents[0].numpy() for out, _ in direct], axis=1)
        # Sessions may share a forward (batched): the same arithmetic per sample, up to reduction order.
        assert np.abs(latents_of(result.blocks) - expected).max() < 1e-5
        frames = np.concatenate([b.frames for b in result.blocks]).astype(int)
        assert np.abs(frames - np.concatenate([f for _, f in direct]).astype(int)).max() <= 1
    assert_ready(server)


def test_cancel_mid_stream_frees_the_session(server, engine: WorldModelEngine) -> None:
    log = Path(server.log_path)
    pattern = re.compile(r"session (r0-\d+) cancelled after (\d+) of 11 blocks; freed (\d+) cache bytes \(left: 0\)")
    for attempt in range(3):
        with StreamingSession(server.grpc_url) as session:
            session.send(request_inputs(tiny_request(num_frames=129)))
            blocks = session.responses(timeout=120)
            first = next(blocks)
            assert first.block_index == 0 and first.num_blocks == 11
            blocks.close()  # stops the stream with cancel_requests=True

        def ended(count: int = attempt + 1) -> list | None:
            found = pattern.findall(log.read_text())
            return found if len(found) >= count else None

        found = wait_until(ended, 30, "the cancelled session to end")
        assert len(found) == attempt + 1, "one session per cancelled stream"
        assert int(found[-1][1]) < 11 and int(found[-1][2]) > 0
    # The group still serves, with the same result as before.
    request = tiny_request(num_frames=21)
    assert np.array_equal(latents_of(stream(server.grpc_url, request)),
                          np.concatenate([o.latents[0].numpy() for o, _ in as_the_server(engine, request)], axis=1))


def _raw_stream_error(url: str, inputs: list, parameters: dict | None = None) -> str:
    with StreamingSession(url) as session:
        session.send(inputs, parameters=parameters)
        with pytest.raises(StreamError) as info:
            list(session.responses(timeout=60))
    return str(info.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({contract.PROMPT: None}, r"prompt"),
        ({contract.SEED: np.array([1.5], np.float32)}, r"seed"),
        ({contract.IMAGE: np.zeros((64, 64, 3), np.float32)}, r"image"),
        ({contract.CAMERA_POSES: np.zeros((9, 3, 4), np.float32)}, r"camera_poses"),
        ({contract.NUM_FRAMES: np.array([11], np.int32)}, r"num_frames=11 must be 1 \+ 4 x k"),
        ({contract.NUM_FRAMES: np.array([13], np.int32), contract.CAMERA_POSES: forward_poses(13)},
         r"not a multiple of block_frames=3"),
        ({contract.PROMPT: np.array([b""], dtype=object)}, r"prompt is empty"),
        ({contract.PROMPT: np.array([b"\xff\xfe bad"], dtype=object)}, r"not valid UTF-8"),
        ({contract.CAMERA_POSES: forward_poses(9) * np.float32(np.nan)}, r"NaN or Inf"),
        ({contract.CAMERA_POSES: forward_poses(5)}, r"camera_poses must be FP32 \[9, 4, 4\]"),
        ({contract.HEIGHT: np.array([72], np.int32)}, r"width x height = 64 x 72"),
        ({contract.NUM_FRAMES: np.array([100001], np.int32)}, r"max_frames=129"),
    ],
    ids=["missing", "dtype", "image_dtype", "pose_shape", "frames", "blocks", "empty_prompt", "utf8", "nan",
         "pose_count", "size", "too_long"],
)
def test_bad_inputs_get_clear_errors(server, changes: dict, message: str) -> None:
    assert re.search(message, _raw_stream_error(server.grpc_url, inputs_with(**changes)))
    assert_ready(server)


def test_bad_request_parameter(server) -> None:
    error = _raw_stream_error(server.grpc_url, inputs_with(), {"decode": "maybe"})
    assert "request parameter 'decode' must be a bool" in error


def test_queue_limit_rejects_clearly(server) -> None:
    # max_sessions=3 run, max_queue=4 wait: of 9 long sessions sent at once, 2 are turned away.
    requests = [StreamRequest(request_inputs(tiny_request(num_frames=57, seed=s)), request_id=f"q{s}") for s in range(9)]
    results = run_sessions(server.grpc_url, requests, timeout=300, keep_data=False)
    errors = [str(r.error) for r in results if r.error is not None]
    assert len(errors) == 2, errors
    assert all("server busy" in e and "max_queue=4" in e for e in errors)
    refusals = [r.error.refusal for r in results if r.error is not None]
    assert all(r.code == contract.CAPACITY_EXHAUSTED and 1 <= r.retry_after_s <= 60 for r in refusals), refusals
    assert all(len(r.blocks) == 5 for r in results if r.error is None)
    assert_ready(server)


def test_no_decode_parameter(server) -> None:
    with StreamingSession(server.grpc_url) as session:
        session.send(request_inputs(tiny_request(num_frames=9)), parameters={"decode": False, "return_latents": False})
        (block,) = list(session.responses(timeout=60))
    assert block.frames.shape[0] == 0 and block.latents is None


def test_sp2_through_triton_matches_sp1(server, sp2_server) -> None:
    request = tiny_request()
    single = latents_of(stream(server.grpc_url, request))
    # One session per forward: a batched forward is close to a lone one (1e-5), not bit-identical.
    results: dict[int, np.ndarray] = {}

    def one(i: int) -> None:  # two clients at once: requests reach both instances
        results[i] = latents_of(stream(sp2_server.grpc_url, request))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2
    for latents in results.values():
        assert np.array_equal(latents, single)


def test_cli_against_the_real_server(server, tmp_path: Path, capsys) -> None:
    import imageio.v3 as iio

    from client.__main__ import main

    out, sheet = tmp_path / "session.mp4", tmp_path / "sheet.png"
    # No size or frame flag: the server describes its blocks (3 latent frames) and its default size (64 x 64)
    code = main(["--url", server.grpc_url, "--prompt", "a castle", "--camera", "forward", "--out", str(out),
                 "--contact-sheet", str(sheet), "--timeout", "120"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "81 frames at 64x64" in printed
    assert "time to first block" in printed and "inter-block latency" in printed
    assert len(list(iio.imiter(out, plugin="FFMPEG"))) == 81
    assert sheet.stat().st_size > 0


def test_prometheus_metrics_count_streams(server) -> None:
    before = metrics(server)
    stream(server.grpc_url, tiny_request(num_frames=33))
    with pytest.raises(StreamError):
        stream(server.grpc_url, tiny_request(num_frames=13))  # not a whole number of blocks
    # Triton refreshes the exposition periodically.
    def refreshed() -> dict[str, float] | None:
        now = metrics(server)
        errors = "lingbot_world_stream_errors_total"
        return now if now.get(errors, 0) > before.get(errors, 0) else None

    after = wait_until(refreshed, 30, "the metrics to refresh")

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("lingbot_world_blocks_total") == 3
    assert delta("lingbot_world_time_to_first_block_seconds_count") == 1
    assert delta("lingbot_world_inter_block_seconds_count") == 2
    assert delta("lingbot_world_block_dit_seconds_count") == 3
    assert delta("lingbot_world_stream_errors_total") == 1
    assert after["lingbot_world_streams_open"] == 0
    assert delta("lingbot_world_blocks_run_total") == 3
    assert 0.0 < delta("lingbot_world_loop_cpu_seconds_total") < 3.0  # the control plane's, outside run_block
    for name in ("lingbot_world_parks_total", "lingbot_world_park_seconds_count", "lingbot_world_unpark_seconds_count",
                 "lingbot_world_parked_bytes"):  # the park tier's, made up front
        assert name in after


def test_backend_stub_starts_with_the_thread_environment(server) -> None:
    (pid,) = server.stub_pids().values()
    environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
    assert all(environ.get(key) == value for key, value in STUB_THREAD_ENVIRONMENT.items())
