"""Command line: render the model repository and run a real `tritonserver` on the lingbot_world model.

    python -m backend.launch --sp 2 --kind cpu --param KEY=VALUE --wait
    python -m backend.launch --render-only --kind gpu --sp 4 --param checkpoint=...
    mpirun -np 2 --hostfile hosts python -m backend.launch --mpi --sp 4 --param checkpoint=... --wait
    python -m backend.launch --install-perf-analyzer

The pieces live beside it: `wheel` (server and Python backend from the nvidia-pytriton wheel),
`model_repository` (config.pbtxt rendering), `server` (the server process), `mpi` (`--mpi`: this host's
server among all hosts' servers), `perf_analyzer`.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from ..api.contract import GROUP_FAILED, MODEL_NAME
from ..api.errors import ConfigError
from ..api.settings import from_parameters, to_parameters
from ..parallel.ports import free_port, port_in_use
from ..engine.validation import checked_spec
from ..serving.books import BooksAddress
from ..serving.settings import ServingSettings, split_parameters
from ..serving.description import describe
from .agent import CapacityAgent, GroupProbe
from .books_keys import KeysFromBooks
from .drain import DRAIN_TIMEOUT_S, drain
from .model_repository import DEFAULT_CHECKPOINT, write_model_repository
from .mpi import SET_BY_MPI, host_parameters
from .paths import BUILD_DIR, DEFAULT_BACKENDS_DIR, DEFAULT_PERF_ANALYZER_DIR, DEFAULT_REPOSITORY_DIR
from .perf_analyzer import install_perf_analyzer
from .wheel import prepare_backends
from .server import ADMIN_HEADER, CPU_ONLY_ARGS, CPU_START_LINES, SHM_DIR, TritonServer, Tls

# The launcher's exit when its group failed and its healer's loads did not take (launch/heal.py): EX_TEMPFAIL, a fresh
# start is the cure (the fleet restarts it with backoff, as a crash; a lone launcher's supervisor should too).
EXIT_UNHEALED = 75


def gpu_count() -> int:
    """GPUs that `nvidia-smi -L` lists (0 without the tool or a driver)."""
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], check=False, capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in listing.stdout.splitlines()) if listing.returncode == 0 else 0


def resolve_placement(kind: str, instances: int) -> tuple[str, list[int] | None]:
    """(KIND_*, device ids) for a `--kind` of cpu, gpu or auto."""
    gpus = gpu_count() if kind in ("gpu", "auto") else 0
    if kind == "cpu" or (kind == "auto" and gpus == 0):
        return "KIND_CPU", None
    if gpus < instances:
        raise ValueError(f"--kind {kind} --sp {instances} needs {instances} GPUs; nvidia-smi -L lists {gpus}")
    return "KIND_GPU", list(range(instances))


def parse_param(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def instance_count(text: str) -> int:
    """--sp: a whole number of instances, at least one."""
    count = int(text)
    if count < 1:
        raise argparse.ArgumentTypeError(f"instances must be >= 1, got {count}")
    return count


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m backend.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sp",
        type=instance_count,
        default=1,
        help="model instances of this server (one per GPU with KIND_GPU); the SP degree is this x host_count "
        "/ tp_degree",
    )
    parser.add_argument(
        "--mpi",
        action="store_true",
        help="under mpirun: one server per rank, all in one group (host_rank, host_count and rendezvous_host "
        "from MPI)",
    )
    parser.add_argument(
        "--kind",
        choices=("cpu", "gpu", "auto"),
        default="auto",
        help="auto (default): gpu if nvidia-smi lists GPUs, else cpu",
    )
    parser.add_argument(
        "--param",
        type=parse_param,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a config.pbtxt parameter (repeatable)",
    )
    parser.add_argument(
        "--address",
        default="127.0.0.1",
        help="address tritonserver's HTTP, gRPC and metrics ports bind (default: %(default)s, this host only; "
        "0.0.0.0 opens them to every network: see docs/security.md)",
    )
    parser.add_argument(
        "--admin-key-file",
        type=Path,
        help="write the header value that opens the restricted APIs (model load/unload) here, readable by "
        "its owner only; without it nobody can load or unload models over the network",
    )
    parser.add_argument("--tls-cert", type=Path, help="gRPC speaks TLS only, with this PEM certificate chain "
                        "(docs/security.md); with --tls-key")
    parser.add_argument("--tls-key", type=Path, help="the PEM private key of --tls-cert")
    parser.add_argument("--tls-client-ca", type=Path, help="mutual TLS: only clients with a certificate this PEM CA "
                        "signed may connect")
    parser.add_argument("--keys-file", type=Path, help="serve these users' keys only (python -m backend.launch.keys "
                        "makes them); SIGHUP reloads it: removed keys' sessions end, new keys open")
    parser.add_argument("--books-url", help="the fleet's shared books (redis:// or rediss:// for TLS; Redis or Valkey, "
                        "no password in it): its keys' quotas count across every group on them, and its keys are the "
                        "books' (python -m backend.fleet --keys-file pushes them; docs/security.md)")
    parser.add_argument("--books-password-file", type=Path, help="the books' password, in a file readable by its "
                        "owner only")
    parser.add_argument("--books-ca", type=Path, help="the PEM CA that signed a rediss:// store's certificate "
                        "(default: the system's)")
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument(
        "--agent-port",
        type=int,
        help="serve HAProxy's agent-check here (on --address): the group's free session slots as a weight (0 when "
        "full), drain while it drains, down when not ready (backend/launch/agent.py; the fleet's balancer reads it)",
    )
    parser.add_argument(
        "--drain-timeout-s",
        type=float,
        default=DRAIN_TIMEOUT_S,
        help="SIGTERM, where the server keeps snapshots (snapshot_dir), first drains the group: it leaves the "
        "balancer's rotation, saves every steered session and ends it MOVED with its snapshot's id, and the stop waits "
        "until no stream is open, at most this long (default %(default)g s: a full group's snapshots of the 14B model, "
        "4 x 27 GiB, written at 2 GB/s, twice over; backend/launch/drain.py). A second SIGTERM stops at once",
    )
    parser.add_argument("--repository-out", type=Path, default=DEFAULT_REPOSITORY_DIR)
    parser.add_argument("--backends-out", type=Path, default=DEFAULT_BACKENDS_DIR)
    parser.add_argument("--log-file", type=Path, default=BUILD_DIR / "tritonserver.log")
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument("--wait", action="store_true", help="block until the model is ready, then keep serving")
    parser.add_argument("--wait-timeout", type=float, default=600.0, help="seconds --wait allows (default 600)")
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="write the model repository, print its path and exit (for a server started elsewhere, e.g. NGC)",
    )
    parser.add_argument(
        "--install-perf-analyzer",
        action="store_true",
        help=f"install perf_analyzer into {DEFAULT_PERF_ANALYZER_DIR}, print its path and exit",
    )
    return parser


def check_rendezvous_port(parameters: dict[str, str], hosts: int) -> None:
    """On one host pick a free rendezvous port unless one is given: with a fixed default a second server
    would join (or wait on) the first one's store. The server hosting global rank 0 refuses a busy port."""
    if hosts == 1 and "rendezvous_port" not in parameters:
        parameters["rendezvous_port"] = str(free_port())
    keys = (*SET_BY_MPI, "rendezvous_port")
    settings = from_parameters(ServingSettings, {k: v for k, v in parameters.items() if k in keys})
    if settings.host_rank == 0 and port_in_use(settings.rendezvous_port):
        leave_out = ", or leave it out to have a free one picked" if hosts == 1 else ""
        raise ValueError(
            f"rendezvous_port={settings.rendezvous_port} is in use on this host (another server's group?): "
            f"pass --param rendezvous_port=PORT with a free port{leave_out}"
        )


def default_snapshot_dir(repository: Path) -> Path:
    """Where a served group saves worlds unless `--param snapshot_dir=...` says (docs/worlds.md)."""
    return repository.resolve().parent / "snapshots"


def default_park_dir(args: argparse.Namespace) -> Path | None:
    """Where a served group on one host parks worlds in host memory unless `--param park_memory_dir=...` says: its own
    folder on the host's tmpfs, named after its model repository (a fleet's groups each have their own), the same
    across the healer's reloads, removed when the launcher stops (docs/serving.md, "Parking"). None: the launcher
    sets none (render only, several hosts, a folder given, no /dev/shm)."""
    parameters = dict(args.param)
    if args.render_only or args.mpi or "park_memory_dir" in parameters or not SHM_DIR.is_dir():
        return None
    digest = hashlib.sha256(str(args.repository_out.resolve()).encode()).hexdigest()[:12]
    return SHM_DIR / f"lingbot-park-{digest}"


def render(args: argparse.Namespace) -> tuple[Path, str, str | None]:
    """The model repository, the instance kind, and the group secret MPI shared (None: this server makes one)."""
    kind, device_ids = resolve_placement(args.kind, args.sp)
    parameters = dict(args.param)
    if not args.render_only:  # saving works out of the box on one host: a folder beside the model repository
        parameters.setdefault("snapshot_dir", str(default_snapshot_dir(args.repository_out)))
    if (park := default_park_dir(args)) is not None:
        parameters["park_memory_dir"] = str(park)
    secret = None
    if args.mpi:
        shared = {"sp": str(args.sp), "kind": kind, **parameters}
        ports_and_paths = {
            "grpc_port": str(args.grpc_port),
            "http_port": str(args.http_port),
            "metrics_port": str(args.metrics_port),
            "repository_out": str(args.repository_out.resolve()),
            "log_file": str(args.log_file.resolve()),
        }
        placement, secret = host_parameters(shared, ports_and_paths)
        parameters.update(placement)
    hosts = from_parameters(ServingSettings, {k: v for k, v in parameters.items() if k in SET_BY_MPI}).host_count
    if args.sp * hosts > 1 and not args.render_only:
        check_rendezvous_port(parameters, hosts)
    engine, serving = split_parameters({"checkpoint": DEFAULT_CHECKPOINT} | parameters)  # names a bad key or value
    if (args.sp * hosts) % engine.tp_degree:
        raise ValueError(f"tp_degree={engine.tp_degree} does not divide the {args.sp * hosts} instances "
                         f"(--sp {args.sp} x {hosts})")
    # every instance of every server is one rank of tp x sp
    engine = dataclasses.replace(engine, sp_degree=args.sp * hosts // engine.tp_degree)
    parameters = to_parameters(engine) | to_parameters(serving)
    # What a client reads of this server (api/description); every instance checks it at load. Resolving reads
    # the checkpoint's JSON configs only, and names a setting the checkpoint cannot serve now. Without the
    # checkpoint (the committed rendering's default path) there is none: the load names the missing checkpoint.
    description = describe(checked_spec(engine, args.sp * hosts), serving) if Path(engine.checkpoint).exists() \
        else None
    repository = write_model_repository(
        args.repository_out,
        instances=args.sp,
        kind=kind,
        device_ids=device_ids,
        parameters=parameters,
        description=description,
    )
    return repository, kind, secret


def write_admin_key(path: Path, key: str) -> None:
    """The admin header's value in a file only its owner can read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(f"{ADMIN_HEADER}: {key}\n")


def tls_of(args: argparse.Namespace) -> Tls | None:
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_client_ca is not None and args.tls_cert is None:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
    return None if args.tls_cert is None else Tls(args.tls_cert, args.tls_key, args.tls_client_ca)


def reload_keys(server: TritonServer, why: str = "SIGHUP") -> None:
    """SIGHUP (or a new version of the books' keys): the keys file again; a bad one is refused by line and the keys
    in force stay."""
    try:
        ring = server.reload_keys()
    except (ConfigError, OSError) as exc:
        print(f"{why}: the keys file was not reloaded, the keys in force stay: {exc}", file=sys.stderr, flush=True)
        return
    if ring is not None:
        print(f"{why}: keys reloaded from {server.keys_file}: {len(ring.entries)} key(s)", flush=True)


def drains_on_sigterm(args: argparse.Namespace) -> bool:
    """Whether SIGTERM drains the group before the stop: its server keeps snapshots and is the whole group (a
    server of a group of several hosts sees only its own streams: it stops at once, as before)."""
    parameters = dict(args.param)
    hosts = from_parameters(ServingSettings, {k: v for k, v in parameters.items() if k == "host_count"}).host_count
    return parameters.get("snapshot_dir") != "" and not args.mpi and hosts == 1


class Termination:
    """The launcher's SIGTERM: the first unwinds it (exit 143) through its drain, if any, and its stop; a second one
    during the drain cuts the drain short (the stop goes on); any later one is ignored, the stop being under way."""

    def __init__(self) -> None:
        self.asked = False
        self.draining = False

    def __call__(self, *_: object) -> None:
        if self.asked and not self.draining:
            return
        self.draining = False
        self.asked = True
        raise SystemExit(143)

    def drain(self, server: TritonServer, agent: CapacityAgent | None, timeout_s: float) -> None:
        """After the first SIGTERM only: the group moves its worlds elsewhere, then the stop follows."""
        if not self.asked:
            return
        print(f"SIGTERM: draining (at most {timeout_s:g} s; SIGTERM again to stop at once)", flush=True)
        self.draining = True
        try:
            drained = drain(server, agent, timeout_s)
        finally:
            self.draining = False
        left = f"{drained.streams_left} still open: the stop ends them" if drained.streams_left else "none left"
        print(f"SIGTERM: drained in {drained.seconds:.1f} s ({drained.streams_at_start} stream(s) open at the start, "
              f"{left}); stopping", flush=True)


def books_of(args: argparse.Namespace) -> BooksAddress | None:
    """The fleet's books this launcher's group shares (None: its books are in process)."""
    if args.books_url is None:
        if args.books_password_file is not None or args.books_ca is not None:
            raise ValueError("--books-password-file and --books-ca go with --books-url")
        return None
    if args.keys_file is not None:
        raise ValueError("--books-url takes its keys from the books (the fleet's --keys-file pushes them): leave out "
                         "--keys-file")
    return BooksAddress(args.books_url, args.books_password_file, args.books_ca)


def serve(args: argparse.Namespace) -> int:
    tls = tls_of(args)
    books = books_of(args)
    repository, kind, secret = render(args)
    backends = prepare_backends(args.backends_out)
    keys_file, books_keys = args.keys_file, None
    if books is not None:  # its instances reach the books too (file paths in their environment, never a password)
        os.environ.update(books.environment())
        books_keys = KeysFromBooks(books.connect())
        print(f"waiting for the fleet's keys in the books at {books.url}", flush=True)
        try:
            keys_file = books_keys.wait(args.wait_timeout)
        except BaseException:
            books_keys.close()
            raise
    server = TritonServer(
        repository,
        backends_dir=backends,
        grpc_port=args.grpc_port,
        http_port=args.http_port,
        metrics_port=args.metrics_port,
        address=args.address,
        group_secret=secret,
        log_verbose=args.log_verbose,
        log_path=args.log_file,
        die_with_parent=True,  # a launcher killed outright (mpirun's teardown) takes its server along
        heal=True,  # a failed group's model is reloaded (launch/heal.py)
        extra_args=CPU_ONLY_ARGS if kind == "KIND_CPU" else (),
        tls=tls,
        keys_file=keys_file,
    )
    if args.admin_key_file:
        write_admin_key(args.admin_key_file, server.admin_key)
    termination = Termination()
    signal.signal(signal.SIGTERM, termination)  # unwind through `with` so the group is drained and stopped
    signal.signal(signal.SIGHUP, lambda *_: reload_keys(server))
    park = default_park_dir(args)
    try:
        return run(args, server, termination, kind, books_keys)
    finally:  # the parked worlds' copies in host memory (the server has stopped: none is written any more)
        if park is not None:
            shutil.rmtree(park, ignore_errors=True)


def run(args: argparse.Namespace, server: TritonServer, termination: Termination, kind: str,
        books_keys: KeysFromBooks | None) -> int:
    """The server until it stops (a SIGTERM drains the group first, where it keeps snapshots): the launcher's exit
    code. books_keys: the keys this group takes from the fleet's books (None: its own keys file)."""
    with server, contextlib.ExitStack() as stack:
        if books_keys is not None:  # a change in the books' keys reaches the instances as the file's SIGHUP would
            stack.callback(books_keys.close)
            books_keys.start(lambda: reload_keys(server, "the books' keys changed"))
        agent = None
        if args.agent_port is not None:  # where a balancer reads the group's capacity (the fleet: backend/fleet/)
            agent = CapacityAgent(GroupProbe(server.host, server.http_port, server.metrics_port), args.agent_port,
                                  args.address).start()
            stack.callback(agent.stop)
        if drains_on_sigterm(args):  # runs first on the way out (last in, first out), while the server serves
            stack.callback(termination.drain, server, agent, args.drain_timeout_s)
        print(f"tritonserver pid {server.pid} grpc {server.grpc_url} log {server.log_path}", flush=True)
        if kind == "KIND_CPU":
            print(f"(without a GPU its log starts with {' and '.join(CPU_START_LINES)}: harmless)", flush=True)
        try:
            if args.wait:
                server.wait_ready(MODEL_NAME, args.wait_timeout)
                print(f"model {MODEL_NAME} ready ({args.sp} x {kind}) on {server.grpc_url}", flush=True)
            rc = server.wait()
        except KeyboardInterrupt:
            return 130
    if server.unhealed is not None:
        heal = server.unhealed
        print(f"[{GROUP_FAILED}] the group could not heal ({heal.why}; {heal.attempts} loads in {heal.seconds:.0f} s): "
              f"exiting {EXIT_UNHEALED} for a fresh start", file=sys.stderr, flush=True)
        return EXIT_UNHEALED
    if rc == 0:
        return 0
    print(f"tritonserver exited with code {rc}; from its log:\n{server.log_excerpt()}", file=sys.stderr)
    return rc if rc > 0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.render_only:
            print(render(args)[0])
            return 0
        if not args.install_perf_analyzer:
            return serve(args)
        path = install_perf_analyzer()
        print(f"run it with LD_LIBRARY_PATH={path.parent}", file=sys.stderr)
        print(path)
        return 0
    except (FileNotFoundError, ValueError, RuntimeError, TimeoutError) as exc:  # ConfigError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
