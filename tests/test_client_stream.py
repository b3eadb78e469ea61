"""client/stream.py and the CLI against an in-process fake of Triton's gRPC streaming service."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import imageio.v3 as iio
import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from backend.api import contract
from backend.api.description import ServerDescription
from client.__main__ import main
from backend.api.request import default_intrinsics
from client.camera import camera_preset
from client.stream import (
    CAPACITY_RETRIES,
    StreamRequest,
    StreamCancelledError,
    StreamError,
    StreamingSession,
    StreamTimeoutError,
    build_inputs,
    run_sessions,
)

H, W, FRAMES = 32, 48, 9  # 9 frames -> 3 latent frames -> blocks of 1 + 4 + 4 frames here
Script = Callable[[service_pb2.ModelInferRequest, grpc.ServicerContext], Iterator[service_pb2.ModelStreamInferResponse]]


def _tensor(response: service_pb2.ModelInferResponse, name: str, array: np.ndarray, datatype: str) -> None:
    response.outputs.add(name=name, datatype=datatype, shape=list(array.shape))
    response.raw_output_contents.append(np.ascontiguousarray(array).tobytes())


def block_response(request: service_pb2.ModelInferRequest, index: int, num_blocks: int, n_frames: int,
                   final: bool = False) -> service_pb2.ModelStreamInferResponse:
    response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
    _tensor(response, contract.BLOCK_INDEX, np.array([index], np.int32), "INT32")
    _tensor(response, contract.NUM_BLOCKS, np.array([num_blocks], np.int32), "INT32")
    _tensor(response, contract.LATENTS, np.full((16, 1, H // 8, W // 8), index, np.float32), "FP32")
    _tensor(response, contract.FRAMES, np.full((n_frames, H, W, 3), 60 * index, np.uint8), "UINT8")
    _tensor(response, contract.TIMING_MS, np.array([100.0 + index, 20.0, 5.0], np.float32), "FP32")
    response.parameters["triton_final_response"].bool_param = final
    return service_pb2.ModelStreamInferResponse(infer_response=response)


def empty_final(request: service_pb2.ModelInferRequest) -> service_pb2.ModelStreamInferResponse:
    response = service_pb2.ModelInferResponse(model_name=request.model_name, id=request.id)
    response.parameters["triton_final_response"].bool_param = True
    return service_pb2.ModelStreamInferResponse(infer_response=response)


def three_blocks_then_empty_final(request, context):
    for index, n in enumerate([1, 4, 4]):
        yield block_response(request, index, 3, n)
    yield empty_final(request)


class FakeTriton(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self) -> None:
        self.script: Script = three_blocks_then_empty_final
        self.requests: list[service_pb2.ModelInferRequest] = []
        self.cancelled = threading.Event()
        self.description: ServerDescription | None = None  # what its model config says of it

    def ModelConfig(self, request, context):
        config = model_config_pb2.ModelConfig(name=request.name)
        for key, value in (self.description.parameters() if self.description else {}).items():
            config.parameters[key].string_value = value
        return service_pb2.ModelConfigResponse(config=config)

    def ModelStreamInfer(self, request_iterator, context):
        context.add_callback(self.cancelled.set)  # runs when the RPC ends, cancelled or not
        for request in request_iterator:
            self.requests.append(request)
            yield from self.script(request, context)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[FakeTriton, str]]:
    fake = FakeTriton()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(fake, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    yield fake, f"127.0.0.1:{port}"
    grpc_server.stop(grace=None)


@pytest.fixture
def fake(server):
    fake, url = server
    fake.script = three_blocks_then_empty_final
    fake.requests.clear()
    fake.cancelled.clear()
    return fake, url


def _inputs(seed: int = 7):
    return build_inputs(np.zeros((H, W, 3), np.uint8), "a street", camera_preset("forward", FRAMES),
                        default_intrinsics(FRAMES, H, W), num_frames=FRAMES, seed=seed, height=H, width=W)


def test_blocks_arrive_in_order_and_the_request_follows_the_protocol(fake) -> None:
    fake, url = fake
    with StreamingSession(url) as session:
        session.send(_inputs(), request_id="r1", parameters={contract.PARAM_DECODE: True})
        blocks = list(session.responses(timeout=10))
    assert [b.block_index for b in blocks] == [0, 1, 2] and {b.num_blocks for b in blocks} == {3}
    assert [b.frames.shape for b in blocks] == [(1, H, W, 3), (4, H, W, 3), (4, H, W, 3)]
    assert blocks[2].frames.dtype == np.uint8 and blocks[2].frames.max() == 120
    assert blocks[1].latents.shape == (16, 1, H // 8, W // 8) and blocks[1].timing_ms == (101.0, 20.0, 5.0)
    assert blocks[0].arrival_s >= session.sent_s and blocks[0].arrival_s <= blocks[2].arrival_s

    (request,) = fake.requests
    assert request.model_name == contract.MODEL_NAME and request.id == "r1"
    assert request.parameters["triton_enable_empty_final_response"].bool_param
    assert request.parameters[contract.PARAM_DECODE].bool_param
    got = {t.name: (t.datatype, list(t.shape)) for t in request.inputs}
    assert got == {
        contract.IMAGE: ("UINT8", [H, W, 3]), contract.PROMPT: ("BYTES", [1]),
        contract.CAMERA_POSES: ("FP32", [FRAMES, 4, 4]), contract.CAMERA_INTRINSICS: ("FP32", [FRAMES, 4]),
        contract.NUM_FRAMES: ("INT32", [1]), contract.SEED: ("INT64", [1]),
        contract.HEIGHT: ("INT32", [1]), contract.WIDTH: ("INT32", [1]),
    }
    raw = dict(zip((t.name for t in request.inputs), request.raw_input_contents))
    assert np.frombuffer(raw[contract.SEED], np.int64)[0] == 7
    assert raw[contract.PROMPT][4:] == b"a street"  # 4-byte length prefix, then UTF-8


def test_final_flag_on_a_data_response_ends_the_stream(fake) -> None:
    fake, url = fake
    fake.script = lambda request, context: iter([block_response(request, 0, 2, 1), block_response(request, 1, 2, 4, final=True)])
    with StreamingSession(url) as session:
        session.send(_inputs())
        assert [b.block_index for b in session.responses(timeout=10)] == [0, 1]
        session.send(_inputs())  # the session can carry another request afterwards
        assert len(list(session.responses(timeout=10))) == 2


def test_error_response_raises_the_server_message(fake) -> None:
    fake, url = fake

    def fail_after_one(request, context):
        yield block_response(request, 0, 3, 1)
        yield service_pb2.ModelStreamInferResponse(error_message="camera_poses must be [9, 4, 4]")

    fake.script = fail_after_one
    with StreamingSession(url) as session:
        session.send(_inputs(), request_id="bad")
        received = []
        with pytest.raises(StreamError, match=r"'lingbot_world' failed request 'bad': camera_poses must be \[9, 4, 4\]") \
                as info:
            for block in session.responses(timeout=10):
                received.append(block)
    assert len(received) == 1
    assert info.value.sentence == "camera_poses must be [9, 4, 4]"  # what a page shows: the server's words


def _hang(request, context):
    yield block_response(request, 0, 3, 1)
    deadline = time.monotonic() + 60  # the client's cancellation ends it long before
    while context.is_active() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_timeout_cancels_the_request(fake) -> None:
    fake, url = fake
    fake.script = _hang
    with StreamingSession(url) as session:
        session.send(_inputs())
        start = time.perf_counter()
        with pytest.raises(StreamTimeoutError, match="within 0.5 s"):
            list(session.responses(timeout=0.5))
        assert time.perf_counter() - start < 3
    assert fake.cancelled.wait(5)


def test_cancel_from_another_thread(fake) -> None:
    fake, url = fake
    fake.script = _hang
    with StreamingSession(url) as session:
        session.send(_inputs(), request_id="c")
        responses = session.responses()
        assert next(responses).block_index == 0
        threading.Timer(0.2, session.cancel).start()
        with pytest.raises(StreamCancelledError, match="'c' cancelled"):
            next(responses)
    assert fake.cancelled.wait(5)


def test_unreachable_server_names_the_url() -> None:
    # Depending on how fast the connection fails, send() or the first response raises.
    with StreamingSession("127.0.0.1:1") as session:
        with pytest.raises(StreamError, match=r"UNAVAILABLE.*is Triton serving gRPC at 127.0.0.1:1\?") as info:
            session.send(_inputs())
            list(session.responses(timeout=20))
    assert info.value.sentence == str(info.value)  # no model sentence: the whole description


def test_run_sessions_concurrently(fake) -> None:
    fake, url = fake
    requests = [StreamRequest(_inputs(seed), request_id=f"s{seed}") for seed in range(3)]
    results = run_sessions(url, requests, timeout=10, keep_data=False)
    assert [r.request_id for r in results] == ["s0", "s1", "s2"]
    for result in results:
        assert result.error is None and len(result.blocks) == 3
        assert result.blocks[1].frames.shape == (0, H, W, 3) and result.blocks[1].latents is None
        assert result.time_to_first_block_s > 0 and len(result.inter_block_s) == 2
    assert sorted(r.id for r in fake.requests) == ["s0", "s1", "s2"]


def test_build_inputs_rejects_bad_requests() -> None:
    image, poses = np.zeros((H, W, 3), np.uint8), camera_preset("static", FRAMES)
    with pytest.raises(ValueError, match=r"num_frames must be 9 \+ 12 x k, whole AR blocks \(e.g. 9, 21, 45 or 81\), got 8"):
        build_inputs(image, "p", camera_preset("static", 8), None, num_frames=8, seed=0, height=H, width=W)
    with pytest.raises(ValueError, match=r"num_frames must be 13 \+ 16 x k, whole AR blocks \(e.g. 13, 29, 61 or 109\), got 81"):
        build_inputs(image, "p", camera_preset("static", 81), None, num_frames=81, seed=0, height=H, width=W,
                     block_frames=4)
    assert len(build_inputs(image, "p", camera_preset("static", 77), None, num_frames=77, seed=0, height=H, width=W,
                            block_frames=4)) > 0  # the official download's 4-frame blocks: 13 + 16 x 4
    with pytest.raises(ValueError, match=r"camera_poses must be FP32 \[9, 4, 4\]; got float32 \[5, 4, 4\]"):
        build_inputs(image, "p", poses[:5], None, num_frames=FRAMES, seed=0, height=H, width=W)
    with pytest.raises(ValueError, match=r"camera_intrinsics must be FP32 \[n, 4\]"):
        build_inputs(image, "p", poses, np.zeros((9, 3)), num_frames=FRAMES, seed=0, height=H, width=W)
    with pytest.raises(ValueError, match=r"image must be UINT8 \[H, W, 3\]"):
        build_inputs(image[..., 0], "p", poses, None, num_frames=FRAMES, seed=0, height=H, width=W)
    names = [i.name() for i in build_inputs(image, "p", poses, None, num_frames=FRAMES, seed=0, height=H, width=W)]
    assert contract.CAMERA_INTRINSICS not in names and set(names) == set(contract.WHOLE_TRAJECTORY_INPUTS)


def test_cli_writes_video_sheet_and_latents(fake, tmp_path: Path, capsys) -> None:
    fake, url = fake
    out, sheet, latents = tmp_path / "s.mp4", tmp_path / "sheet.png", tmp_path / "lat.npy"
    code = main(["--url", url, "--prompt", "a street", "--camera", "left", "--num-frames", str(FRAMES),
                 "--height", str(H), "--width", str(W), "--out", str(out), "--contact-sheet", str(sheet),
                 "--sheet-every", "4", "--save-latents", str(latents), "--timeout", "10"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "block   3/3" in printed and "time to first block" in printed and "inter-block latency" in printed
    assert np.stack(list(iio.imiter(out, plugin="FFMPEG"))).shape == (FRAMES, H, W, 3)
    assert iio.imread(sheet).shape[0] > 0 and np.load(latents).shape == (16, 3, H // 8, W // 8)
    (request,) = fake.requests
    assert request.parameters[contract.PARAM_RETURN_LATENTS].bool_param


def test_cli_takes_the_block_size_and_the_size_from_the_server_and_prints_its_place(fake, tmp_path: Path,
                                                                                   capsys) -> None:
    """Neither layout needs a flag: a server of 4 latent frames a block gets 77 frames (its most whole blocks up
    to 81), at its own default size; a place in the queue is printed, not counted as a block."""
    fake, url = fake
    fake.description = ServerDescription("official", 4, "block_frames=4", 321, 1 << 20, 1 << 24, 4, 16, H, W)

    def queued_then_blocks(request, context):
        place = service_pb2.ModelInferResponse(id=request.id)
        for name, value, dtype in ((contract.QUEUE_POSITION, [2], np.int32), (contract.WAIT_S, [40.0], np.float32)):
            tensor = place.outputs.add(name=name, datatype=contract.OUTPUT_SPECS[name].triton_dtype, shape=[1])
            place.raw_output_contents.append(np.asarray(value, dtype).tobytes())
            del tensor
        yield service_pb2.ModelStreamInferResponse(infer_response=place)
        yield from three_blocks_then_empty_final(request, context)

    fake.script = queued_then_blocks
    try:
        code = main(["--url", url, "--prompt", "a street", "--out", str(tmp_path / "s.mp4"), "--no-decode"])
    finally:
        fake.description = None
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "waiting: 2nd in the queue, about 40 s" in printed and "block   3/3" in printed
    (request,) = fake.requests
    inputs = {i.name: i for i in request.inputs}
    assert list(inputs[contract.CAMERA_POSES].shape) == [77, 4, 4]
    assert list(inputs[contract.IMAGE].shape) == [H, W, 3]


def test_cli_reports_server_errors(fake, tmp_path: Path, capsys) -> None:
    fake, url = fake
    fake.script = lambda request, context: iter([service_pb2.ModelStreamInferResponse(error_message="out of memory")])
    code = main(["--url", url, "--prompt", "x", "--num-frames", str(FRAMES), "--height", str(H),
                 "--width", str(W), "--out", str(tmp_path / "s.mp4")])
    assert code == 1 and "out of memory" in capsys.readouterr().err
    (request,) = fake.requests
    assert not request.parameters[contract.PARAM_RETURN_LATENTS].bool_param


def test_cli_rejects_bad_input_before_connecting(tmp_path: Path, capsys) -> None:
    assert main(["--url", "127.0.0.1:1", "--prompt", "x", "--num-frames", "77", "--block-frames", "3", "--height",
                 "32", "--width", "32"]) == 2
    assert "num_frames must be 9 + 12 x k, whole AR blocks (e.g. 9, 21, 45 or 81), got 77" in capsys.readouterr().err
    assert main(["--prompt", "x", "--action-dir", str(tmp_path / "none"), "--num-frames", "9", "--block-frames", "3",
                 "--height", "32", "--width", "32"]) == 2
    assert "action directory not found" in capsys.readouterr().err


def test_cli_help_lists_the_commands_and_play_shows_its_defaults(capsys) -> None:
    for argv in (["--help"], ["play", "--help"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 0
    main_help, play_help = capsys.readouterr().out.split("usage: python -m client play", 1)
    assert "python -m client play" in main_help and "python -m client serve" in main_help
    for default in ("default_height, else 480)", "default_width, else 832)", "(default: 42)", "(default: w*6)",
                    "(default: out/play.mp4)",
                    "(default: localhost:8001)", "(default: wait)", "(default: 1)", "(default: 600.0)"):
        assert default in play_help


BUSY = "[CAPACITY_EXHAUSTED retry_after_s=1] server busy: 1 sessions already wait for a slot"


def test_a_full_server_is_retried_after_its_retry_time_on_a_new_stream(fake) -> None:
    """Every slot and the line full: the request is sent again after retry_after_s, on a new stream (behind a
    balancer it may reach another group), and its blocks arrive; the time to first block counts from the first
    send. Refused every time, it gives up after its bounded retries with the code."""
    fake, url = fake
    refusals = [1]

    def busy_once(request, context):
        if refusals[0]:
            refusals[0] -= 1
            yield service_pb2.ModelStreamInferResponse(error_message=BUSY)
            return
        yield from three_blocks_then_empty_final(request, context)

    fake.script = busy_once
    with StreamingSession(url, capacity_retries=CAPACITY_RETRIES) as session:
        sent = session.send(_inputs(), request_id="busy")
        blocks = list(session.responses(timeout=20))
        waited = time.perf_counter() - sent
    assert [b.block_index for b in blocks] == [0, 1, 2] and len(fake.requests) == 2
    assert 1.0 <= waited < 5 and session.sent_s == sent
    assert fake.requests[0].parameters["sequence_id"] != fake.requests[1].parameters["sequence_id"]

    fake.requests.clear()
    fake.script = lambda request, context: iter([service_pb2.ModelStreamInferResponse(error_message=BUSY)])
    with StreamingSession(url, capacity_retries=1) as session:
        session.send(_inputs())
        with pytest.raises(StreamError) as info:
            list(session.responses(timeout=20))
    assert info.value.code == contract.CAPACITY_EXHAUSTED and len(fake.requests) == 2
