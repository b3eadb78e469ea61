"""Launch a real `tritonserver` (shipped in the nvidia-pytriton wheel) on the lingbot_world model.

    python -m backend.launcher --sp 2 --kind cpu --param KEY=VALUE --wait
    python -m backend.launcher --install-perf-analyzer

The wheel holds the server, the Python backend and a backend stub per Python version; the server
needs the wheel's bundled libraries on LD_LIBRARY_PATH, and the stub finds this venv's packages
through the venv's bin/ first on PATH. The Python API (`prepare_backends`, `write_model_repository`,
`TritonServer`, `install_perf_analyzer`) serves tests and benchmarks.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

REPO_ROOT = Path(__file__).resolve().parent.parent
TEMPLATE_DIR = REPO_ROOT / "model_repository" / "lingbot_world"
DEFAULT_BACKENDS_DIR = REPO_ROOT / "build" / "triton_backends"
DEFAULT_REPOSITORY_DIR = REPO_ROOT / "build" / "model_repository"
DEFAULT_PERF_ANALYZER_DIR = REPO_ROOT / "tools" / "perf_analyzer"
PERF_ANALYZER_WHEEL = "tritonclient==2.41.0"  # the last wheel that ships the perf_analyzer binary
KINDS = ("KIND_CPU", "KIND_GPU")
_LOG_ERROR = re.compile(r"E\d{4} |error: ")  # tritonserver's error records and fatal messages


# ---------------------------------------------------------------- the pytriton wheel


@dataclass(frozen=True)
class PytritonWheel:
    """Paths inside an installed nvidia-pytriton wheel."""

    site_packages: Path

    @property
    def server_dir(self) -> Path:
        return self.site_packages / "pytriton" / "tritonserver"

    @property
    def binary(self) -> Path:
        return self.server_dir / "bin" / "tritonserver"

    @property
    def libs_dir(self) -> Path:
        return self.site_packages / "nvidia_pytriton.libs"

    @property
    def python_backend_dir(self) -> Path:
        return self.server_dir / "backends" / "python"

    def stub(self, python_version: str) -> Path:
        return self.server_dir / "python_backend_stubs" / python_version / "triton_python_backend_stub"

    def lib(self, pattern: str) -> Path:
        """The one shared library in `libs_dir` matching a glob pattern (the wheel hashes the names)."""
        matches = sorted(self.libs_dir.glob(pattern))
        if len(matches) != 1:
            raise FileNotFoundError(f"expected one {pattern} in {self.libs_dir}, found {len(matches)}")
        return matches[0]


def find_pytriton_wheel() -> PytritonWheel:
    """Locate nvidia-pytriton in the current interpreter's site-packages."""
    candidates = {Path(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")}
    for site_packages in sorted(candidates):
        wheel = PytritonWheel(site_packages)
        if wheel.binary.is_file():
            return wheel
    raise FileNotFoundError(
        f"no tritonserver binary under {sorted(map(str, candidates))}; "
        f"install it with: {sys.executable} -m pip install nvidia-pytriton==0.7.0"
    )


def _python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _copy_if_changed(src: Path, dst: Path) -> None:
    # Skip identical files: overwriting a stub that a running server executes fails (ETXTBSY).
    if not (dst.is_file() and filecmp.cmp(src, dst, shallow=True)):
        shutil.copy2(src, dst)


def prepare_backends(out_dir: Path = DEFAULT_BACKENDS_DIR, wheel: PytritonWheel | None = None) -> Path:
    """Build `out_dir/python/` (python backend + this interpreter's stub); returns `out_dir`."""
    wheel = wheel or find_pytriton_wheel()
    stub = wheel.stub(_python_version())
    if not stub.is_file():
        raise FileNotFoundError(f"nvidia-pytriton has no Python backend stub for Python {_python_version()}")
    python_dir = out_dir / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for src in [p for p in wheel.python_backend_dir.iterdir() if p.is_file()] + [stub]:
        _copy_if_changed(src, python_dir / src.name)
    return out_dir


# ---------------------------------------------------------------- config.pbtxt rendering


# A pbtxt field holding a message or a list: `name {`, `name: {`, `name [` or `name: [`.
_FIELD_HEAD = re.compile(r"([A-Za-z_]\w*)\s*:?\s*([\[{])")
_KEY = re.compile(r"\bkey\s*:\s*\"((?:[^\"\\]|\\.)*)\"")
_STRING_VALUE = re.compile(r"\bstring_value\s*:\s*(\"(?:[^\"\\]|\\.)*\")")


@dataclass(frozen=True)
class _Field:
    """A top-level message or list field of a pbtxt text: text[start:end], brackets included."""

    name: str
    start: int
    end: int
    is_list: bool


def _code_indices(text: str, start: int = 0, end: int | None = None) -> Iterator[int]:
    """Indices of text[start:end] outside string literals and `#` comments."""
    i, end = start, len(text) if end is None else end
    while i < end:
        ch = text[i]
        if ch in "\"'":
            quote, i = ch, i + 1
            while i < len(text) and text[i] != quote:
                i += 2 if text[i] == "\\" else 1
            if i >= len(text):
                raise ValueError("unterminated string in config.pbtxt")
        elif ch == "#":
            newline = text.find("\n", i)
            i = len(text) if newline == -1 else newline
            continue
        else:
            yield i
        i += 1


def _matching_close(text: str, open_at: int) -> int:
    """Index just past the bracket that closes text[open_at]."""
    depth = 0
    for i in _code_indices(text, open_at):
        if text[i] in "[{":
            depth += 1
        elif text[i] in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced bracket at offset {open_at} of config.pbtxt")


def _top_level_fields(text: str) -> list[_Field]:
    fields: list[_Field] = []
    for i in _code_indices(text):
        if fields and i < fields[-1].end:
            continue  # inside the previous field
        if i > 0 and (text[i - 1].isalnum() or text[i - 1] == "_"):
            continue  # not the start of a name
        if match := _FIELD_HEAD.match(text, i):
            fields.append(_Field(match.group(1), i, _matching_close(text, match.start(2)), match.group(2) == "["))
    return fields


def _messages(text: str, field: _Field) -> list[tuple[int, int]]:
    """Spans of the message bodies of a field: one for `name {..}`, each element of `name [{..}, ..]`."""
    open_at = next(i for i in _code_indices(text, field.start) if text[i] in "[{")
    if not field.is_list:
        return [(open_at + 1, field.end - 1)]
    spans: list[tuple[int, int]] = []
    for i in _code_indices(text, open_at + 1, field.end - 1):
        if text[i] == "{" and not (spans and i < spans[-1][1]):
            spans.append((i + 1, _matching_close(text, i) - 1))
    return spans


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_instance_group(*, instances: int, kind: str, device_ids: list[int] | None) -> str:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if instances < 1:
        raise ValueError(f"instances must be >= 1, got {instances}")
    if kind == "KIND_CPU":
        if device_ids is not None:
            raise ValueError("device_ids apply to KIND_GPU only")
        return f"instance_group [{{ count: {instances}, kind: KIND_CPU }}]"
    if device_ids is None or len(device_ids) != instances:
        raise ValueError(f"KIND_GPU takes one device id per instance: {instances} instances, device_ids={device_ids}")
    groups = ",\n".join(f"  {{ count: 1, kind: KIND_GPU, gpus: [{i}] }}" for i in device_ids)
    return f"instance_group [\n{groups}\n]"


def _parameter_edits(text: str, fields: list[_Field], parameters: dict[str, str]) -> list[tuple[int, int, str]]:
    """(start, end, replacement) edits setting the string_value of each named `parameters` entry."""
    edits, found = [], set()
    for field in (f for f in fields if f.name == "parameters"):
        for start, end in _messages(text, field):
            key, value = _KEY.search(text, start, end), _STRING_VALUE.search(text, start, end)
            if key is None or value is None:
                raise ValueError(f"parameters entry without key/string_value: {text[start:end].strip()!r}")
            found.add(key.group(1))
            if key.group(1) in parameters:
                edits.append((value.start(1), value.end(1), _quote(parameters[key.group(1)])))
    if unknown := sorted(set(parameters) - found):
        raise ValueError(f"unknown config parameters {unknown}; the template defines {sorted(found)}")
    return edits


def render_config(
    template_text: str, *, instances: int, kind: str, device_ids: list[int] | None, parameters: dict[str, str]
) -> str:
    """The template config.pbtxt with its instance_group replaced and named parameters' values set.

    Every `parameters` key must exist in the template (a typo would otherwise be silently ignored).
    """
    group = render_instance_group(instances=instances, kind=kind, device_ids=device_ids)
    fields = _top_level_fields(template_text)
    edits = _parameter_edits(template_text, fields, parameters)
    groups = [f for f in fields if f.name == "instance_group"]
    if not groups:
        return template_text.rstrip("\n") + "\n" + group + "\n"
    edits.append((groups[0].start, groups[0].end, group))
    edits.extend((f.start, f.end, "") for f in groups[1:])
    text = template_text
    for start, end, replacement in sorted(edits, reverse=True):
        text = text[:start] + replacement + text[end:]
    return text


def write_model_repository(
    out_dir: Path = DEFAULT_REPOSITORY_DIR,
    *,
    instances: int,
    kind: str,
    device_ids: list[int] | None = None,
    parameters: dict[str, str] | None = None,
    template_dir: Path = TEMPLATE_DIR,
) -> Path:
    """Write `out_dir/<model>/{config.pbtxt,1/model.py}` from the template; returns `out_dir`."""
    template = template_dir / "config.pbtxt"
    if not template.is_file():
        raise FileNotFoundError(f"model template {template} is missing")
    config = render_config(
        template.read_text(), instances=instances, kind=kind, device_ids=device_ids, parameters=parameters or {}
    )
    model_dir = out_dir / template_dir.name
    if model_dir.exists():
        shutil.rmtree(model_dir)
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(config)
    shutil.copy2(template_dir / "1" / "model.py", model_dir / "1" / "model.py")
    return out_dir


# ---------------------------------------------------------------- the server process


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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class TritonServer:
    """A tritonserver child process in its own process group, logging to `log_path`.

    Ports left as None are picked free; `extra_args` go to tritonserver as they are.
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
        log_verbose: int = 0,
        exit_timeout_s: int = 10,
        log_path: Path | None = None,
        extra_args: Sequence[str] = (),
        wheel: PytritonWheel | None = None,
    ) -> None:
        self.wheel = wheel or find_pytriton_wheel()
        self.model_repository = Path(model_repository)
        self.backends_dir = Path(backends_dir)
        self.grpc_port = grpc_port or free_port()
        self.http_port = http_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.log_verbose = log_verbose
        self.exit_timeout_s = exit_timeout_s
        self.extra_args = list(extra_args)
        self.log_path = Path(log_path) if log_path else _temp_log_path()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def command(self) -> list[str]:
        cmd = [
            str(self.wheel.binary),
            f"--model-repository={self.model_repository.resolve()}",
            f"--backend-directory={self.backends_dir.resolve()}",
            f"--grpc-port={self.grpc_port}",
            f"--http-port={self.http_port}",
            f"--metrics-port={self.metrics_port}",
            # On SIGTERM the server waits this long for open requests (a dead stub's never finish).
            f"--exit-timeout-secs={self.exit_timeout_s}",
            # Explicit control, so a model whose group failed can unload itself and read not-ready.
            "--model-control-mode=explicit",
            *(f"--load-model={name}" for name in self.models()),
        ]
        return cmd + ([f"--log-verbose={self.log_verbose}"] if self.log_verbose else []) + self.extra_args

    def models(self) -> list[str]:
        """The models of the repository (each loaded at start)."""
        return sorted(p.name for p in self.model_repository.iterdir() if (p / "config.pbtxt").is_file())

    def environment(self) -> dict[str, str]:
        # The stub finds the venv's packages through the interpreter first on PATH (not PYTHONPATH),
        # and must embed this interpreter's own libpython: a different 3.11 patch release (the system
        # one) fails on the venv's stdlib extensions (`import ssl`: undefined symbol _PyModule_Add).
        env = dict(os.environ)
        libs = [str(_libpython_dir() or ""), str(self.wheel.libs_dir), env.get("LD_LIBRARY_PATH")]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, libs))
        env["PATH"] = os.pathsep.join(filter(None, [str(Path(sys.executable).parent), env.get("PATH")]))
        return env

    def start(self) -> TritonServer:
        if self.process is not None:
            raise RuntimeError("this TritonServer was already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command(), env=self.environment(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self

    @property
    def pid(self) -> int:
        return self._started().pid

    def _started(self) -> subprocess.Popen[bytes]:
        if self.process is None:
            raise RuntimeError("start() the server first")
        return self.process

    def wait(self) -> int:
        """Block until the server exits; returns its exit code."""
        return self._started().wait()

    def log_excerpt(self, lines: int = 30) -> str:
        """The log's error lines (`E...` records, `error: ...`), else its last lines."""
        text = self.log_path.read_text(errors="replace").splitlines() if self.log_path.is_file() else []
        errors = [line for line in text if _LOG_ERROR.match(line)]
        return "\n".join((errors or text)[-lines:])

    def wait_ready(self, model: str, timeout: float = 300.0) -> None:
        """Block until `model` is ready; raise with the log's tail if the server dies or time runs out."""
        process = self._started()
        deadline = time.monotonic() + timeout
        with grpcclient.InferenceServerClient(self.grpc_url) as client:
            while time.monotonic() < deadline:
                if (rc := process.poll()) is not None:
                    raise RuntimeError(
                        f"tritonserver exited with code {rc} before {model!r} was ready "
                        f"(log {self.log_path}):\n{self.log_excerpt()}"
                    )
                try:
                    if client.is_model_ready(model):
                        return
                except InferenceServerException:
                    pass  # server not up yet
                time.sleep(0.5)
        raise TimeoutError(f"{model!r} not ready after {timeout:.0f} s (log {self.log_path}):\n{self.log_excerpt()}")

    def stop(self) -> int | None:
        """SIGTERM the process group (server and stubs), SIGKILL if still up after the exit timeout.

        Returns the server's exit code (None if it was never started).
        """
        if self.process is None:
            return None
        if self.process.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(self.exit_timeout_s + 10)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.process.wait()
        self._signal_group(signal.SIGKILL)  # stubs that outlived the server
        return self.process.returncode

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


# ---------------------------------------------------------------- perf_analyzer


def install_perf_analyzer(dest: Path = DEFAULT_PERF_ANALYZER_DIR, wheel: PytritonWheel | None = None) -> Path:
    """Put the perf_analyzer binary in `dest` beside plain-named links to the libraries it needs.

    Run it with `perf_analyzer_environment(dest)` (LD_LIBRARY_PATH=dest).
    """
    wheel = wheel or find_pytriton_wheel()
    dest.mkdir(parents=True, exist_ok=True)
    binary = dest / "perf_analyzer"
    if not binary.is_file():
        _extract_perf_analyzer(binary)
    for plain, pattern in (("libcudart.so.12", "libcudart-*.so.12*"), ("libb64.so.0d", "libb64-*.so.0d")):
        link = dest / plain
        link.unlink(missing_ok=True)
        link.symlink_to(wheel.lib(pattern))
    return binary


def _extract_perf_analyzer(binary: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        download = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", tmp, PERF_ANALYZER_WHEEL]
        if subprocess.run(download, check=False).returncode != 0:
            raise RuntimeError(f"`{' '.join(download)}` failed; is the package index reachable?")
        (wheel_file,) = Path(tmp).glob("tritonclient-*.whl")
        with zipfile.ZipFile(wheel_file) as archive:
            member = next(n for n in archive.namelist() if n.endswith(".data/data/bin/perf_analyzer"))
            binary.write_bytes(archive.read(member))
    binary.chmod(0o755)


def perf_analyzer_environment(dest: Path = DEFAULT_PERF_ANALYZER_DIR) -> dict[str, str]:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(dest), env.get("LD_LIBRARY_PATH")]))
    return env


# ---------------------------------------------------------------- command line


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m backend.launcher", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sp", type=int, default=1, help="model instances (one per GPU with KIND_GPU)")
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
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--template", type=Path, default=TEMPLATE_DIR, help="model template directory")
    parser.add_argument("--repository-out", type=Path, default=DEFAULT_REPOSITORY_DIR)
    parser.add_argument("--backends-out", type=Path, default=DEFAULT_BACKENDS_DIR)
    parser.add_argument("--log-file", type=Path, default=REPO_ROOT / "build" / "tritonserver.log")
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


def render(args: argparse.Namespace) -> tuple[Path, str]:
    kind, device_ids = resolve_placement(args.kind, args.sp)
    parameters = {"sp_degree": str(args.sp), **dict(args.param)}  # one SP rank per instance
    repository = write_model_repository(
        args.repository_out,
        instances=args.sp,
        kind=kind,
        device_ids=device_ids,
        parameters=parameters,
        template_dir=args.template,
    )
    return repository, kind


def serve(args: argparse.Namespace) -> int:
    repository, kind = render(args)
    backends = prepare_backends(args.backends_out)
    server = TritonServer(
        repository,
        backends_dir=backends,
        grpc_port=args.grpc_port,
        http_port=args.http_port,
        metrics_port=args.metrics_port,
        log_verbose=args.log_verbose,
        log_path=args.log_file,
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind through `with` so the group is stopped
    with server:
        print(f"tritonserver pid {server.pid} grpc {server.grpc_url} log {server.log_path}", flush=True)
        try:
            if args.wait:
                server.wait_ready(args.template.name, args.wait_timeout)
                print(f"model {args.template.name} ready ({args.sp} x {kind})", flush=True)
            rc = server.wait()
        except KeyboardInterrupt:
            return 130
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
    except (FileNotFoundError, ValueError, RuntimeError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
