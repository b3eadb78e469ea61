"""Every rank killed, as a stream's owner and as a bystander: what the survivors free, and whether a reload serves.

    python -m bench.kill_matrix [--sp 2 4] [--preset wide]

For each group size and each rank, twice: once while the victim owns a stream (every rank owns one), once while
it owns none (a bystander: the streams it drew are cancelled first). The victim's stub gets SIGKILL. Reported per
case: seconds until the model reads not ready; whether a survivor still listens on the rendezvous port and how
many TCP connections the survivors still hold; the survivors' RSS before loading (logged), when loaded and once
they released the model after the failure (logged), against the transformer weights each held (the `wide`
preset's 367 MB a rank make their release visible); seconds for the
operator's reload to read ready, whether it then served a request, `lingbot_world_streams_open` afterwards
(summed over ranks, after the request), and seconds for the launcher's stop.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import signal
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import tritonclient.grpc as grpcclient

from backend.api.contract import MODEL_NAME
from backend.launch.model_repository import write_model_repository
from backend.launch.procfs import status_kib, tcp_sockets
from backend.launch.server import TritonServer
from backend.launch.wheel import prepare_backends
from bench.common import BUILD_DIR, TINY, engine_config, ensure_checkpoint, format_table, make_request, server_parameters
from bench.streaming import stream_request
from client.stream import StreamingSession

COLLECTIVE_TIMEOUT_S = 5.0


def wait_for(condition: Callable[[], object], timeout: float, what: str, every: float = 0.1) -> float:
    """Seconds until `condition()` holds; raises naming `what` after `timeout`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"no {what} within {timeout:g} s")
        time.sleep(every)
    return time.monotonic() - start


def metric(server: TritonServer, name: str, rank: int | None = None) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and (rank is None or f'rank="{rank}"' in line))


def logged_rss(log: Path, rank: int, what: str) -> float:
    """The RSS the rank logged (`before` loading, or once its model was `released`), the last such line."""
    pattern = {"before": rf"rank {rank}/\d+ on \S+: loading .* \(RSS before: (\d+) MB\)",
               "released": rf"rank {rank}: model released \(RSS now (\d+) MB\)"}[what]
    found = re.findall(pattern, log.read_text(errors="replace"))
    return float(found[-1]) if found else float("nan")


def weights_mb(log: Path, rank: int) -> float:
    found = re.findall(rf"rank {rank}: transformer weights (\d+) bytes", log.read_text(errors="replace"))
    return int(found[-1]) / 2**20 if found else float("nan")


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
            wait_for(lambda: sum(metric(server, "lingbot_world_streams_open", r) for r in range(sp)) > sum(before),
                     60, "the new stream to open")
            now = [metric(server, "lingbot_world_streams_open", r) for r in range(sp)]
            if not owner and now[victim] > before[victim]:
                session.cancel()
                wait_for(lambda: metric(server, "lingbot_world_streams_open", victim) == before[victim], 60,
                         "the victim's stream to close")
            if rank_counts([metric(server, "lingbot_world_streams_open", r) for r in range(sp)]):
                return
        raise RuntimeError("could not place the streams")

    if owner:
        open_on(lambda counts: all(c > 0 for c in counts))
    else:
        open_on(lambda counts: counts[victim] == 0 and sum(counts) > 0)


def run_case(checkpoint: Path, sp: int, victim: int, owner: bool) -> list[str]:
    out = BUILD_DIR / "bench" / f"kill_sp{sp}_r{victim}_{'owner' if owner else 'bystander'}"
    params = server_parameters(engine_config(checkpoint, TINY, sp)) | {
        "collective_timeout_s": str(COLLECTIVE_TIMEOUT_S), "max_batch": "1", "max_frames": "1000"}
    repo = write_model_repository(out / "repo", instances=sp, kind="KIND_CPU", parameters=params)
    port = int(params["rendezvous_port"])
    server = TritonServer(repo, backends_dir=prepare_backends(), log_path=out / "tritonserver.log")
    with server:
        server.wait_ready(MODEL_NAME, timeout=300)
        pids = server.stub_pids()
        survivors = [pids[r] for r in range(sp) if r != victim]
        loaded = statistics.fmean(status_kib(p, "VmRSS") / 1024 for p in survivors)
        weights = statistics.fmean(weights_mb(server.log_path, r) for r in range(sp) if r != victim)
        streams = Streams(server.grpc_url, blocks=80)
        place_streams(server, streams, sp, victim, owner)
        os.kill(pids[victim], signal.SIGKILL)
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            not_ready = wait_for(lambda: not client.is_model_ready(MODEL_NAME), 60, "not-ready model")
            wait_for(lambda: not any(s.port == port and s.listening for s in tcp_sockets(survivors)), 30,
                     "free rendezvous port")
            ranks = [r for r in range(sp) if r != victim]
            wait_for(lambda: all(logged_rss(server.log_path, r, "released") > 0 for r in ranks), 30,
                     "the survivors' release")
            held = tcp_sockets([p for p in survivors if Path(f"/proc/{p}").exists()])
            print(f"SP{sp} rank {victim} killed: the survivors hold {held}", flush=True)
            sockets = len(held)
            before = statistics.fmean(logged_rss(server.log_path, r, "before") for r in ranks)
            released = statistics.fmean(logged_rss(server.log_path, r, "released") for r in ranks)
            start = time.monotonic()
            client.load_model(MODEL_NAME, headers=server.admin_headers())
            reload_s = time.monotonic() - start
            ready = client.is_model_ready(MODEL_NAME)
        for session in streams.sessions:
            session.cancel()
        served = False
        try:
            with StreamingSession(server.grpc_url) as check:
                item = stream_request(make_request(TINY, decode=False), "after-reload")
                check.send(item.inputs, request_id=item.request_id, parameters=item.parameters)
                served = len(list(check.responses(120))) == TINY.blocks
        except Exception as exc:  # noqa: BLE001 - reported in the table
            print(f"SP{sp} rank {victim}: request after the reload failed: {exc}")
        wait_for(lambda: metric(server, "lingbot_world_streams_open") == 0, 30, "streams_open back to 0")
        gauge = metric(server, "lingbot_world_streams_open")
        start = time.monotonic()
    stop_s = time.monotonic() - start
    left = [f for f in Path("/dev/shm").iterdir() if f.name.startswith(f"lingbot_{server.grpc_port}_")]
    return [f"SP{sp}", str(victim), "owner" if owner else "bystander", f"{not_ready:.1f}", "no",
            str(sockets), f"{before:.0f} / {loaded:.0f} / {released:.0f}", f"{weights:.0f}",
            f"{reload_s:.1f}" if ready else "not ready", "yes" if served else "NO", f"{gauge:g}", f"{stop_s:.1f}",
            str(len(left))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--preset", default="wide", help="random checkpoint preset (default: %(default)s)")
    p.add_argument("--checkpoint", type=Path, help="a checkpoint instead of the preset's random one")
    args = p.parse_args()
    checkpoint = ensure_checkpoint(args.checkpoint, args.preset)
    rows = []
    for sp in args.sp:
        for victim in range(sp):
            for owner in (True, False):
                try:
                    rows.append(run_case(checkpoint, sp, victim, owner))
                except Exception as exc:  # noqa: BLE001 - one case failing must not hide the others
                    rows.append([f"SP{sp}", str(victim), "owner" if owner else "bystander", f"FAILED: {exc}"]
                                + [""] * 9)
                print(format_table(HEADER, rows[-1:], left=3).splitlines()[-1], flush=True)
    print(format_table(HEADER, rows, left=3))


HEADER = ["group", "killed rank", "it owned", "not ready s", "port held", "survivor TCP sockets",
          "survivor RSS MB before load / loaded / released", "weights MB/rank", "reload s", "served after", "streams_open",
          "stop s", "/dev/shm left"]

if __name__ == "__main__":
    main()
