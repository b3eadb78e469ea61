"""Every rank killed, as a stream's owner, as a bystander and in an idle group: how long until the server heals itself.

    python -m bench.kill_matrix [--sp 2 4] [--preset tiny]

For each group size and each rank, three times: while the victim owns a stream (every rank owns one), while it owns
none but others do (a bystander: the streams it drew are cancelled first), and with no stream at all (idle). The
victim's stub gets SIGKILL; nobody calls the admin API: the launcher's healer (launch/heal.py) reloads the model.
Reported per case, from the kill: seconds until the model reads not ready, until it reads ready again, and until a
new stream's first block arrives; the healer's loads; `lingbot_world_streams_open` afterwards (summed over ranks);
seconds for the launcher's stop; `/dev/shm` regions left.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import tritonclient.grpc as grpcclient

from backend.api.contract import MODEL_NAME
from backend.launch.metrics_page import metrics_page, samples
from backend.launch.model_repository import write_model_repository
from backend.launch.polling import wait_for
from backend.launch.server import TritonServer
from backend.launch.wheel import prepare_backends
from bench.common import BUILD_DIR, TINY, engine_settings, ensure_checkpoint, format_table, make_request, server_parameters
from bench.streaming import stream_request
from client.stream import StreamingSession

COLLECTIVE_TIMEOUT_S = 5.0



def metric(server: TritonServer, name: str, rank: int | None = None) -> float:
    page = metrics_page(f"http://127.0.0.1:{server.metrics_port}/metrics", 10)
    return sum(samples(page, name, **({} if rank is None else {"rank": str(rank)})))


class Streams:
    """Long streams on their own threads; each can be cancelled."""

    def __init__(self, url: str, blocks: int) -> None:
        self.url, self.request = url, make_request(dataclasses.replace(TINY, blocks=blocks), decode=False)
        self.sessions: list[StreamingSession] = []

    def open(self) -> StreamingSession:
        import threading

        session = StreamingSession(self.url)
        item = stream_request(self.request, f"kill-{len(self.sessions)}")
        session.send(item.inputs, request_id=item.request_id, parameters=item.parameters)
        threading.Thread(target=lambda: _drain(session), daemon=True).start()
        self.sessions.append(session)
        return session


def _drain(session: StreamingSession) -> None:
    try:
        for _ in session.responses(600):
            pass
    except Exception:  # noqa: BLE001 - the failure is what is measured
        pass


def place_streams(server: TritonServer, streams: Streams, sp: int, victim: int, owner: bool) -> None:
    """Owner: every rank owns a stream. Bystander: some other rank owns one and the victim none (a stream that
    lands on the victim is cancelled)."""
    def open_on(rank_counts: Callable[[list[float]], bool]) -> None:
        for _ in range(4 * sp):
            before = [metric(server, "lingbot_world_streams_open", r) for r in range(sp)]
            session = streams.open()
            wait_for(lambda seen=before: sum(metric(server, "lingbot_world_streams_open", r) for r in range(sp)) > sum(seen),
                     60, "the new stream to open")
            now = [metric(server, "lingbot_world_streams_open", r) for r in range(sp)]
            if not owner and now[victim] > before[victim]:
                session.cancel()
                wait_for(lambda seen=before: metric(server, "lingbot_world_streams_open", victim) == seen[victim], 60,
                         "the victim's stream to close")
            if rank_counts([metric(server, "lingbot_world_streams_open", r) for r in range(sp)]):
                return
        raise RuntimeError("could not place the streams")

    if owner:
        open_on(lambda counts: all(c > 0 for c in counts))
    else:
        open_on(lambda counts: counts[victim] == 0 and sum(counts) > 0)


def first_block_s(url: str, since: float) -> float:
    """Seconds from `since` until a new one-block stream's first response arrives."""
    with StreamingSession(url) as check:
        item = stream_request(make_request(dataclasses.replace(TINY, blocks=1), decode=False), "after-heal")
        check.send(item.inputs, request_id=item.request_id, parameters=item.parameters)
        next(iter(check.responses(120)))
    return time.monotonic() - since


def run_case(checkpoint: Path, sp: int, victim: int, case: str) -> list[str]:
    out = BUILD_DIR / "bench" / f"kill_sp{sp}_r{victim}_{case}"
    params = server_parameters(engine_settings(checkpoint, TINY, sp)) | {
        "collective_timeout_s": str(COLLECTIVE_TIMEOUT_S), "max_batch": "1", "max_frames": "1000"}
    repo = write_model_repository(out / "repo", instances=sp, kind="KIND_CPU", parameters=params)
    server = TritonServer(repo, backends_dir=prepare_backends(), log_path=out / "tritonserver.log", heal=True)
    with server:
        server.wait_ready(MODEL_NAME, timeout=300)
        streams = Streams(server.grpc_url, blocks=80)
        if case != "idle":
            place_streams(server, streams, sp, victim, owner=case == "owner")
        os.kill(server.stub_pids()[victim], signal.SIGKILL)
        killed = time.monotonic()
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            wait_for(lambda: not client.is_model_ready(MODEL_NAME), 60, "not-ready model")
            not_ready = time.monotonic() - killed
            wait_for(lambda: client.is_model_ready(MODEL_NAME), 120, "the healed model")
            ready = time.monotonic() - killed
        for session in streams.sessions:
            session.cancel()
        served = first_block_s(server.grpc_url, killed)
        wait_for(lambda: metric(server, "lingbot_world_streams_open") == 0, 30, "streams_open back to 0")
        gauge = metric(server, "lingbot_world_streams_open")
        loads = ", ".join(str(h.attempts) for h in server.healer.heals)
        start = time.monotonic()
    stop_s = time.monotonic() - start
    left = [f for f in Path("/dev/shm").iterdir() if f.name.startswith(f"lingbot_{server.grpc_port}_")]
    return [f"SP{sp}", str(victim), case, f"{not_ready:.1f}", f"{ready:.1f}", f"{served:.1f}", loads, f"{gauge:g}",
            f"{stop_s:.1f}", str(len(left))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--preset", default="tiny", help="random checkpoint preset (default: %(default)s)")
    p.add_argument("--checkpoint", type=Path, help="a checkpoint instead of the preset's random one")
    args = p.parse_args()
    checkpoint = ensure_checkpoint(args.checkpoint, args.preset)
    rows = []
    for sp in args.sp:
        for victim in range(sp):
            for case in CASES:
                try:
                    rows.append(run_case(checkpoint, sp, victim, case))
                except Exception as exc:  # noqa: BLE001 - one case failing must not hide the others
                    rows.append([f"SP{sp}", str(victim), case, f"FAILED: {exc}"] + [""] * (len(HEADER) - 4))
                print(format_table(HEADER, rows[-1:], left=3).splitlines()[-1], flush=True)
    print(format_table(HEADER, rows, left=3))


CASES = ("owner", "bystander", "idle")
HEADER = ["group", "killed rank", "it was", "not ready s", "ready again s", "next block s", "healer loads",
          "streams_open", "stop s", "/dev/shm left"]

if __name__ == "__main__":
    main()
