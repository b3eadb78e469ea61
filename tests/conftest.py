from __future__ import annotations

from pathlib import Path

import pytest

import client  # noqa: F401  (first: it sets gRPC's fork handling before tritonclient loads)

from backend.model.tiny_checkpoint import write_checkpoint
from system_tools import MISSING, REQUIRE_TOOLS, tools_required


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Where the whole suite must run (scripts/test.sh), a test skipped for a missing system tool fails."""
    report = (yield).get_result()
    if report.skipped and tools_required() and MISSING in str(report.longrepr):
        report.outcome = "failed"
        report.longrepr = f"{report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr} " \
                          f"and {REQUIRE_TOOLS}=1 says the whole suite must run"


SERVER_FIXTURES = {"sp1_server", "sp2_server", "sp2_group"}


SERVER_STARTERS = ("running_server", "run_group", "LocalGroup")  # a module that imports one starts servers or process groups


def starts_servers(item: pytest.Item) -> bool:
    module = getattr(item, "module", None)
    return bool(SERVER_FIXTURES & set(getattr(item, "fixturenames", ()))) or any(
        hasattr(module, name) for name in SERVER_STARTERS)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", help="run the slow tier too (tests marked slow), as a run of "
                     "named test files does; a run of the whole suite leaves it out (docs/testing.md, Tiers)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test on a real server must carry the `server` marker, or `-m "not server"` would start one. A run of the
    whole suite (no test named) leaves the slow tier out unless --slow says otherwise."""
    unmarked = [i.nodeid for i in items if starts_servers(i) and i.get_closest_marker("server") is None]
    if unmarked:
        raise pytest.UsageError(f"tests on a real server without the `server` marker: {unmarked}")
    if config.getoption("slow") or config.args_source is not pytest.Config.ArgsSource.TESTPATHS:
        return
    slow = [i for i in items if i.get_closest_marker("slow") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [i for i in items if i.get_closest_marker("slow") is None]


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module: on the shared 2-core machine a 2-thread team stalls whenever another process
    runs (one member preempted, the other spinning at its barrier), up to 10x slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random tiny checkpoint in the diffusers directory format, written once per test run."""
    return str(write_checkpoint(Path(tmp_path_factory.mktemp("ckpt")) / "tiny", "tiny", seed=0))


@pytest.fixture(scope="session")
def engine(tiny_checkpoint: str):
    """One SP1 engine on the tiny checkpoint, shared by every test that does not change its settings."""
    from backend.engine.rollout import WorldModelEngine
    from factories import tiny_settings

    return WorldModelEngine.load(tiny_settings(tiny_checkpoint))


@pytest.fixture(scope="session")
def sp1_server(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: str, snapshot_dir: str):
    """One real tritonserver (one CPU instance) on the tiny checkpoint for the whole run, saving worlds into the
    shared snapshot store."""
    from triton_harness import SP1_QUEUE, SP1_SESSIONS, running_server

    with running_server(tmp_path_factory.mktemp("sp1"), tiny_checkpoint, sp=1, max_sessions=str(SP1_SESSIONS),
                        max_queue=str(SP1_QUEUE), snapshot_dir=snapshot_dir) as s:
        yield s


@pytest.fixture(scope="session")
def sp2_server(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: str):
    """One real SP2 tritonserver (two CPU instances) for the whole run: one session per forward (so latents
    compare bit for bit with SP1), no frame decode, a short steered-session idle limit."""
    from triton_harness import SP2_IDLE_S, running_server

    with running_server(tmp_path_factory.mktemp("sp2"), tiny_checkpoint, sp=2, max_batch="1", max_sessions="3",
                        session_idle_timeout_s=str(SP2_IDLE_S), decode_frames="false") as s:
        yield s


GROUP_IDLE_S = 4.0  # session_idle_timeout_s of the shared local SP2 group (sp2_group)


@pytest.fixture(scope="session")
def snapshot_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The snapshot store the shared servers and groups save into and resume from (one world across them)."""
    return str(tmp_path_factory.mktemp("snapshots"))


@pytest.fixture(scope="session")
def sp2_group(tiny_checkpoint: str, snapshot_dir: str):
    """One SP2 serving group of two local processes (launch/local_group, no tritonserver) for the whole run:
    one session per forward (latents compare bit for bit with SP1), no frame decode, a short steered-session
    idle limit; each member counts its request checks and session openings (sp_workers:admission_counts)."""
    from backend.serving.settings import ServingSettings
    from backend.launch.local_group import LocalGroup
    from factories import tiny_settings

    serving = ServingSettings(max_batch=1, max_sessions=3, session_idle_timeout_s=GROUP_IDLE_S, collective_timeout_s=30.0,
                            snapshot_dir=snapshot_dir)
    with LocalGroup(tiny_settings(tiny_checkpoint, sp_degree=2, decode_frames=False), serving, ranks=2,
                    setup="sp_workers:count_admissions") as group:
        yield group
