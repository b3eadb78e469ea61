"""Start a real tritonserver on the tiny checkpoint and talk to it over gRPC (shared by tests)."""
from __future__ import annotations

import contextlib
from pathlib import Path
from collections.abc import Iterator

import numpy as np
import tritonclient.grpc as grpcclient

from backend.launch.model_repository import write_model_repository
from backend.launch.wheel import prepare_backends
from backend.launch.server import TritonServer, Tls
from backend.parallel.local import free_port
from backend.api.request import SessionRequest
from backend.api.settings import to_parameters
from backend.api.description import ServerDescription
from backend.engine.validation import checked_spec
from backend.serving.settings import ServingSettings, split_parameters
from backend.serving.description import describe
from client.stream import StreamingSession, request_inputs
from factories import tiny_settings, tiny_request

SP2_IDLE_S = 4.0  # session_idle_timeout_s of the shared SP2 server (conftest.sp2_server)
SP1_SESSIONS, SP1_QUEUE = 3, 4  # max_sessions and max_queue of the shared SP1 server (conftest.sp1_server)


def tiny_parameters(checkpoint: str, sp: int, **overrides: str) -> dict[str, str]:
    """config.pbtxt parameters of a server on the tiny checkpoint (the engine settings of the engine tests)."""
    serving = ServingSettings(rendezvous_port=free_port(), collective_timeout_s=20.0, max_frames=129)
    return to_parameters(tiny_settings(checkpoint, sp_degree=sp)) | to_parameters(serving) | overrides


def description_of(parameters: dict[str, str], sp: int) -> ServerDescription:
    """What the launcher writes beside these parameters (api/description)."""
    engine, serving = split_parameters(parameters)
    return describe(checked_spec(engine, sp), serving)


@contextlib.contextmanager
def running_server(tmp: Path, checkpoint: str, sp: int = 1, heal: bool = False, tls: Tls | None = None,
                   keys_file: Path | None = None, **overrides: str) -> Iterator[TritonServer]:
    """heal: as the launcher runs it, reloading its model when the group fails (launch/heal.py); tls and
    keys_file: the launcher's --tls-* and --keys-file."""
    parameters = tiny_parameters(checkpoint, sp, **overrides)
    repo = write_model_repository(tmp / f"repo_sp{sp}", instances=sp, kind="KIND_CPU", parameters=parameters,
                                  description=description_of(parameters, sp))
    server = TritonServer(repo, backends_dir=prepare_backends(), log_path=tmp / f"tritonserver_sp{sp}.log",
                          heal=heal, tls=tls, keys_file=keys_file)
    with server:
        server.wait_ready("lingbot_world", timeout=240)
        yield server


def stream(url: str, request: SessionRequest, timeout: float = 120) -> list:
    with StreamingSession(url) as session:
        session.send(request_inputs(request), parameters={"decode": request.decode, "return_latents": True})
        return list(session.responses(timeout))


def latents_of(blocks: list) -> np.ndarray:
    return np.concatenate([b.latents for b in blocks], axis=1)


def inputs_with(**changes) -> list:
    """Valid inputs with some replaced (value None drops the input)."""
    request = tiny_request(num_frames=9)
    inputs = {i.name(): i for i in request_inputs(request)}
    for name, value in changes.items():
        if value is None:
            inputs.pop(name)
        else:
            array = np.asarray(value)
            dtype = "BYTES" if array.dtype == object else grpcclient.np_to_triton_dtype(array.dtype)
            inputs[name] = grpcclient.InferInput(name, list(array.shape), dtype).set_data_from_numpy(array)
    return list(inputs.values())


def metrics(server: TritonServer, rank: int | None = None) -> dict[str, float]:
    """The model's Prometheus values by name (histograms by bucket), summed over ranks or for one rank."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("lingbot_world_") and (rank is None or f'rank="{rank}"' in line):
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0] + ("" if "le=" not in name else name[name.index("le="):])
            values[key] = values.get(key, 0.0) + float(value)
    return values


def stream_in_background(url: str, seeds: range, timeout: float, num_frames: int = 129) -> tuple[list, list[str]]:
    """Start one long stream per seed on its own thread; returns (threads, the errors they end with)."""
    import threading

    from client.stream import StreamError

    errors: list[str] = []

    def one(seed: int) -> None:
        try:
            stream(url, tiny_request(num_frames=num_frames, seed=seed), timeout=timeout)
        except StreamError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=one, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    return threads, errors
