"""A tritonserver child process (from the pytriton wheel) with its log, ports and readiness wait."""
from __future__ import annotations

import ctypes
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from ..api.contract import KEY_HEADER
from ..parallel.secret import SECRET_VARIABLE
from ..parallel.ports import free_port
from ..serving.host_signals import HostSignals
from ..serving.parent_watch import SERVER_OWNER_VARIABLE
from ..serving.keys import KeyRing
from .control import ADMIN_HEADER, ModelControl
from .heal import Heal, Healer
from .paths import DEFAULT_BACKENDS_DIR
from .procfs import stub_pids
from .wheel import PytritonWheel, find_pytriton_wheel

_PR_SET_PDEATHSIG = 1
SHM_PREFIX = "lingbot_"
SHM_DIR = Path("/dev/shm")
# On SIGTERM tritonserver waits this long for what is in flight. The model ends every session first (the stop
# signal, serving/host_signals), so only a sequence whose client left without its end flag is still counted: Triton
# holds it until its end flag or max_sequence_idle, never sooner (docs/serving.md, "Stopping").
EXIT_TIMEOUT_S = 3
# After tritonserver's own exit timeout, what stop() waits before it kills the process group.
KILL_GRACE_S = 1.0
WAKE_S = 0.2  # how often wait() wakes (the launcher's SIGTERM and SIGHUP take effect within it)
READY_POLL_S = 0.05  # how often wait_ready() asks (one HTTP request to the server each)

log = logging.getLogger(__name__)
_LOG_ERROR = re.compile(r"E\d{4} |error: ")  # tritonserver's error records and fatal messages

# Thread settings the backend stubs need before they import numpy (the Python backend does, before the model), so in
# the server's environment; a value already set wins. numpy there does 4x4 pose math only, but np.linalg.inv wakes
# OpenBLAS's thread pool, whose worker then spins on sched_yield after each call, on the cores the instance's
# torch threads use (backend/serving/threads.py).
STUB_THREAD_ENVIRONMENT = {"OPENBLAS_NUM_THREADS": "1"}

# On a host without a GPU: no pinned-memory pool (its CUDA warning goes too) and no GPU metrics (NVML, DCGM).
CPU_ONLY_ARGS = ("--pinned-memory-pool-byte-size=0", "--allow-gpu-metrics=false")
# What the GPU build of tritonserver still logs at start on a CPU-only host; harmless there, and no error excerpt
# shows it (it would read as the cause of a failure).
CPU_START_LINES = ('"CUDA memory pool disabled"', '"CudaDriverHelper has not been initialized."')
# The API groups clients must not reach: loading, unloading and indexing models (a load may carry the model's
# files, so Python to run), registering shared memory, and the log and trace settings (file paths). Triton
# refuses them without this header; its value is a per-launch secret (see docs/security.md).
RESTRICTED_APIS = ("model-repository", "shared-memory", "logging", "trace")
# With TLS or keys, inference over the HTTP port (plaintext in Triton 2.51, and it forwards no key) is the
# operator's alone: clients use gRPC, where TLS and the key are. HTTP keeps health and metadata.
HTTP_RESTRICTED_WITH_TLS_OR_KEYS = RESTRICTED_APIS + ("inference",)


@dataclass(frozen=True)
class Tls:
    """The gRPC port's TLS (docs/security.md): the server's certificate chain and private key (PEM); with
    `client_ca`, mutual TLS: only clients with a certificate that CA signed may connect."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    def args(self) -> list[str]:
        for path in (self.cert, self.key, self.client_ca):
            if path is not None and not Path(path).is_file():
                raise FileNotFoundError(f"TLS file {path} does not exist")
        args = ["--grpc-use-ssl=true", f"--grpc-server-cert={Path(self.cert).resolve()}",
                f"--grpc-server-key={Path(self.key).resolve()}"]
        if self.client_ca is not None:
            args += ["--grpc-use-ssl-mutual=true", f"--grpc-root-cert={Path(self.client_ca).resolve()}"]
        return args


def _libpython_dir() -> Path | None:
    """The directory holding this interpreter's shared libpython (None for a static build)."""
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if libdir and soname and (Path(libdir) / soname).is_file():
        return Path(libdir)
    return None


def _temp_log_path() -> Path:
    fd, path = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
    os.close(fd)
    return Path(path)


def terminate_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def repository_models(repository: Path) -> list[str]:
    """The models of a model repository (a server loads each at its start)."""
    return sorted(p.name for p in repository.iterdir() if (p / "config.pbtxt").is_file())


class TritonServer:
    """A tritonserver child process in its own process group, logging to `log_path`.

    Ports left as None are picked free; HTTP, gRPC and metrics bind `address` (loopback unless opened on
    purpose). `extra_args` go to tritonserver as they are. With `die_with_parent` the kernel sends the server
    SIGTERM when the process that started it dies (a launcher that mpirun kills). `admin_key` (the restricted
    APIs' header value) and `group_secret` (the ranks' store keys) are fresh secrets unless given. With `heal` the
    model (the repository's one) is reloaded whenever its group fails or one of its stubs dies (launch/heal.py); a
    heal that does not take stops the server (`unhealed` says why), so its launcher ends and is started afresh.
    `tls`: gRPC speaks TLS only. `keys_file`: the model serves the keys of that file only (serving/keys.py; the
    instances read the copy `reload_keys` publishes, at start and on the launcher's SIGHUP).
    Use as a context manager, or start()/stop().
    """

    def __init__(
        self,
        model_repository: Path,
        *,
        backends_dir: Path = DEFAULT_BACKENDS_DIR,
        grpc_port: int | None = None,
        http_port: int | None = None,
        metrics_port: int | None = None,
        address: str = "127.0.0.1",
        admin_key: str | None = None,
        group_secret: str | None = None,
        log_verbose: int = 0,
        exit_timeout_s: int = EXIT_TIMEOUT_S,
        log_path: Path | None = None,
        extra_args: Sequence[str] = (),
        wheel: PytritonWheel | None = None,
        die_with_parent: bool = False,
        heal: bool = False,
        tls: Tls | None = None,
        keys_file: Path | None = None,
    ) -> None:
        self.wheel = wheel or find_pytriton_wheel()
        self.model_repository = Path(model_repository)
        self.backends_dir = Path(backends_dir)
        self.grpc_port = grpc_port or free_port()
        self.http_port = http_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.address = address
        self.admin_key = admin_key or secrets.token_urlsafe(24)
        self.group_secret = group_secret or secrets.token_hex(16)
        self.log_verbose = log_verbose
        self.exit_timeout_s = exit_timeout_s
        self.extra_args = list(extra_args)
        self.log_path = Path(log_path) if log_path else _temp_log_path()
        self._log_start = 0  # where this start's part of the log begins (a restarted launcher appends to it)
        self.die_with_parent = die_with_parent
        self.tls, self.keys_file = tls, keys_file
        self.tls_args = tls.args() if tls else []  # names a missing file now, not in the server's log
        self.signals = HostSignals(Path(tempfile.mkdtemp(prefix="lingbot-signals-")))  # mode 0700
        self.control = ModelControl(f"{self.host}:{self.http_port}", self.admin_key)
        self.healer: Healer | None = None
        self.unhealed: Heal | None = None  # the heal that did not take, which stopped the server
        if heal:
            (model,) = repository_models(self.model_repository)
            self.healer = Healer(self.control, model, self.signals, stubs=self.stub_pids, on_unhealed=self._unhealed)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        """Where a client on this host reaches the server."""
        return "127.0.0.1" if self.address in ("0.0.0.0", "::", "") else self.address

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def admin_headers(self, grpc: bool = True) -> dict[str, str]:
        """The header that opens the restricted APIs (load, unload, index...) to the operator; Triton's gRPC
        server reads it with its own prefix."""
        return {f"triton-grpc-protocol-{ADMIN_HEADER}" if grpc else ADMIN_HEADER: self.admin_key}

    def reload_keys(self) -> KeyRing | None:
        """Read the keys file and publish it to the instances (they apply it within a second: revoked keys' sessions
        end); ConfigError naming the line of a bad file, whose keys are then not published. None without keys."""
        if self.keys_file is None:
            return None
        text = Path(self.keys_file).read_text(encoding="utf-8")
        ring = KeyRing.parse(text, str(self.keys_file))
        self.signals.publish_keys(text)
        return ring

    def command(self) -> list[str]:
        http_restricted = HTTP_RESTRICTED_WITH_TLS_OR_KEYS if self.tls or self.keys_file else RESTRICTED_APIS
        cmd = [
            str(self.wheel.binary),
            f"--model-repository={self.model_repository.resolve()}",
            f"--backend-directory={self.backends_dir.resolve()}",
            f"--grpc-port={self.grpc_port}",
            f"--http-port={self.http_port}",
            f"--metrics-port={self.metrics_port}",
            f"--http-address={self.address}",
            f"--grpc-address={self.address}",
            f"--metrics-address={self.address}",
            f"--http-restricted-api={','.join(http_restricted)}:{ADMIN_HEADER}={self.admin_key}",
            f"--grpc-restricted-protocol={','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={self.admin_key}",
            # On SIGTERM the server waits this long for open requests (a dead stub's never finish).
            f"--exit-timeout-secs={self.exit_timeout_s}",
            # Explicit control, so a model whose group failed can unload itself (in process, not over the
            # restricted APIs) and read not-ready.
            "--model-control-mode=explicit",
            # config.pbtxt is complete (rendered from the contract): without this, the Python backend starts
            # one more stub per load only to ask the model for a config (5 s of imports on 2 cores).
            "--disable-auto-complete-config",
            # Each server's Python-backend shared-memory regions get their own names: servers on one host
            # (tests, multi-host ranks on one machine) otherwise share "triton_python_backend_shm_region_*".
            f"--backend-config=python,shm-region-prefix-name={SHM_PREFIX}{self.grpc_port}_",
            *(f"--load-model={name}" for name in repository_models(self.model_repository)),
            *self.tls_args,
        ]
        if self.keys_file is not None:  # the client's key header reaches the model as a request parameter
            cmd.append(f"--grpc-header-forward-pattern=^{KEY_HEADER}$")
        return cmd + ([f"--log-verbose={self.log_verbose}"] if self.log_verbose else []) + self.extra_args

    def environment(self) -> dict[str, str]:
        # The stub finds the venv's packages through the interpreter first on PATH (not PYTHONPATH),
        # and must embed this interpreter's own libpython: a different 3.11 patch release (the system
        # one) fails on the venv's stdlib extensions (`import ssl`: undefined symbol _PyModule_Add).
        env = STUB_THREAD_ENVIRONMENT | dict(os.environ) | {SECRET_VARIABLE: self.group_secret} \
            | self.signals.environment() | {SERVER_OWNER_VARIABLE: str(os.getpid())}  # for the stubs
        libs = [str(_libpython_dir() or ""), str(self.wheel.libs_dir), env.get("LD_LIBRARY_PATH")]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, libs))
        env["PATH"] = os.pathsep.join(filter(None, [str(Path(sys.executable).parent), env.get("PATH")]))
        return env

    def start(self) -> TritonServer:
        if self.process is not None:
            raise RuntimeError("this TritonServer was already started")
        self.reload_keys()  # before the instances load: they read the keys at start
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:  # the log of the server before a restart stays
            self._log_start = log.tell()
            self.process = subprocess.Popen(
                self.command(),
                env=self.environment(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=terminate_with_parent if self.die_with_parent else None,
            )
        if self.healer is not None:
            self.healer.start()
        return self

    @property
    def pid(self) -> int:
        return self._started().pid

    def stub_pids(self) -> dict[int, int]:
        """rank -> pid of the server's Python-backend stub processes (procfs.stub_pids)."""
        return stub_pids(self.pid)

    def _unhealed(self, heal: Heal) -> None:
        """The healer's loads did not take: the server ends (its `wait` returns), for a fresh start."""
        self.unhealed = heal
        self._signal_group(signal.SIGTERM)

    def _started(self) -> subprocess.Popen[bytes]:
        if self.process is None:
            raise RuntimeError("start() the server first")
        return self.process

    def wait(self) -> int:
        """Block until the server exits; returns its exit code. It wakes every WAKE_S: Python runs a signal's handler
        in the main thread only, between bytecodes, and the kernel may deliver a process's SIGTERM to another thread
        (the healer's, the agent's), which leaves a main thread blocked in waitpid() asleep until the server exits."""
        process = self._started()
        while (rc := process.poll()) is None:
            time.sleep(WAKE_S)
        return rc

    def log_excerpt(self, lines: int = 30) -> str:
        """This start's error lines in the log (`E...` records, `error: ...`), else its last lines."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._log_start)
                text = log.read().decode(errors="replace").splitlines()
        except FileNotFoundError:
            text = []
        errors = [line for line in text if _LOG_ERROR.match(line) and not line.endswith(CPU_START_LINES)]
        return "\n".join((errors or text)[-lines:])

    def wait_ready(self, model: str, timeout: float = 300.0) -> None:
        """Block until `model` is ready; raise with the log's tail if the server dies or time runs out."""
        process = self._started()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (rc := process.poll()) is not None:
                raise RuntimeError(
                    f"tritonserver exited with code {rc} before {model!r} was ready "
                    f"(log {self.log_path}):\n{self.log_excerpt()}"
                )
            if self.control.is_model_ready(model):
                return
            time.sleep(READY_POLL_S)
        raise TimeoutError(f"{model!r} not ready after {timeout:.0f} s (log {self.log_path}):\n{self.log_excerpt()}")

    def stop(self) -> int | None:
        """Ask the model to end every session (the stop signal), SIGTERM the process group (server and stubs),
        SIGKILL if still up `KILL_GRACE_S` after tritonserver's exit timeout, then remove the Python backend's
        shared-memory regions a killed process leaves and the signal directory.

        Triton 2.51 does not finish on SIGTERM while a sequence is left without its end flag or a killed stub's
        streams are open: it waits out its exit timeout and may hang past it. Returns the server's exit code
        (None if it was never started).
        """
        if self.process is None:
            shutil.rmtree(self.signals.directory, ignore_errors=True)
            return None
        if self.healer is not None:
            self.healer.stop()
        if self.process.poll() is None:
            self.signals.ask_stop()
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(self.exit_timeout_s + KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                log.warning("tritonserver (pid %d) did not exit %g s after SIGTERM; killed it (log %s)",
                            self.process.pid, self.exit_timeout_s + KILL_GRACE_S, self.log_path)
                self._signal_group(signal.SIGKILL)
                self.process.wait()
        self._signal_group(signal.SIGKILL)  # stubs that outlived the server
        left = self.shm_regions()
        for region in left:
            region.unlink(missing_ok=True)
        if left:
            log.warning("removed %d shared-memory region(s) tritonserver left: %s", len(left),
                        " ".join(r.name for r in left))
        shutil.rmtree(self.signals.directory, ignore_errors=True)
        return self.process.returncode

    def shm_regions(self) -> list[Path]:
        """This server's Python-backend shared-memory regions (named after its gRPC port)."""
        return sorted(SHM_DIR.glob(f"{SHM_PREFIX}{self.grpc_port}_*"))

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self.process is not None
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
