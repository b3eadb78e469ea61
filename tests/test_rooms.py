"""The package's rooms import only downward; the client and the api run without torch."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

BACKEND = Path(__file__).resolve().parent.parent / "backend"
# Each room may import the rooms before it; adapter and launch stand side by side and do not import each other; the
# fleet (many groups) stands on launch (one group's server).
ROOMS = ["api", "parallel", "model", "engine", "serving", "adapter", "launch", "fleet"]
LEVEL = {"api": 0, "parallel": 1, "model": 2, "engine": 3, "serving": 4, "adapter": 5, "launch": 5, "fleet": 6}


def backend_imports(path: Path) -> set[str]:
    """The backend modules a file imports, as dotted names (relative imports resolved)."""
    package = ".".join(path.relative_to(BACKEND.parent).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            names.add(module)
            names |= {f"{module}.{a.name}" for a in node.names}
    return {n for n in names if n.startswith("backend.")}


def room_of(path: Path) -> str:
    return path.relative_to(BACKEND).parts[0]


def test_backend_is_only_rooms() -> None:
    entries = sorted(p.name for p in BACKEND.iterdir() if not p.name.startswith("__"))
    assert entries == sorted(ROOMS)


@pytest.mark.parametrize("room", ROOMS)
def test_rooms_import_only_downward(room: str) -> None:
    bad = []
    for path in sorted((BACKEND / room).rglob("*.py")):
        for name in backend_imports(path):
            target = name.split(".")[1]
            if target in LEVEL and target != room and LEVEL[target] >= LEVEL[room]:
                bad.append(f"{path.relative_to(BACKEND)} imports {name}")
    assert not bad, bad


def test_only_the_adapter_imports_the_triton_backend_utils() -> None:
    importers = {
        str(p.relative_to(BACKEND))
        for p in BACKEND.rglob("*.py")
        if "triton_python_backend_utils" in p.read_text() and "import triton_python_backend_utils" in p.read_text()
    }
    assert importers and all(p.startswith("adapter/") for p in importers), importers


def test_client_and_api_import_without_torch() -> None:
    """The client runs on machines with only tritonclient and numpy: import it with torch made unimportable."""
    code = """
import sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "diffusers", "transformers", "safetensors"):
            raise ImportError(f"{name} is not installed here")
sys.meta_path.insert(0, Refuse())
import client, client.stream, client.camera, client.video, client.action, client.images
import client.web.app, client.web.bridge, client.web.frames, client.web.serve
import client.__main__ as cli
import backend.api.contract, backend.api.codec, backend.api.request, backend.api.settings
print("ok", "torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=BACKEND.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", "False"]


def test_the_launcher_and_the_fleet_import_without_torch() -> None:
    """`python -m backend.launch` and `python -m backend.fleet` check settings and run servers: they start without
    torch, diffusers or transformers, made unimportable here (local_group, a test harness, runs engines in-process)."""
    modules = [".".join(p.relative_to(BACKEND.parent).with_suffix("").parts)
               for room in ("launch", "fleet") for p in sorted((BACKEND / room).glob("*.py"))
               if p.stem not in ("__main__", "local_group")]
    code = f"""
import importlib, sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "diffusers", "transformers", "safetensors"):
            raise ImportError(f"{{name}} is not installed here")
sys.meta_path.insert(0, Refuse())
for module in {modules!r}:
    importlib.import_module(module)
print("ok", len({modules!r}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=BACKEND.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok", str(len(modules))]
    assert "backend.launch.launcher" in modules and "backend.fleet.supervisor" in modules


def test_the_engine_imports_without_diffusers() -> None:
    """A stub imports the serving group and its engine at start; diffusers (and torch._dynamo, which it imports:
    about 2 s of a stub's CPU) and transformers are imported where a model is loaded, not before."""
    code = """
import sys
import backend.serving.bootstrap, backend.engine.rollout
print(*sorted(m for m in ("diffusers", "transformers", "torch._dynamo", "sympy") if m in sys.modules) or ["none"])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=BACKEND.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["none"]
