"""The fleet's parts without a server: the agent's protocol, the balancer's configuration (checked by haproxy
itself), the command line's refusals, the stub watch."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from backend.launch.agent import CapacityAgent, GroupState, agent_reply, free_slots_of
from backend.fleet.balancer import HAPROXY, GroupAddress, check_config, render_haproxy
from backend.launch.drain import streams_open
from backend.fleet.supervisor import balancer_tls, build_parser, main
from backend.fleet.restart import launcher_of
from backend.launch.control import ControlError, ModelControl
from backend.launch import heal
from backend.launch.heal import DEAD_STUB_GRACE_S, Healer, StubWatch
from backend.launch.wheel import PytritonWheel
from backend.serving.parent_watch import alive
from backend.parallel.ports import free_port, port_in_use
from backend.serving.host_signals import HostSignals
from polling import wait_until
from system_tools import requires_tool

ROOT = Path(__file__).resolve().parent.parent
needs_haproxy = requires_tool(Path(HAPROXY).is_file(), f"HAProxy at {HAPROXY} (Debian's haproxy)")


@pytest.mark.parametrize("state, line", [
    (GroupState(True, 2, 4), "ready up 50%\n"),
    (GroupState(True, 4, 4), "ready up 100%\n"),
    (GroupState(True, 6, 4), "ready up 100%\n"),  # more free than the max it read (a reload raised it): 100 at most
    (GroupState(True, 1, 200), "ready up 1%\n"),  # room for one: never weight 0, which takes it out
    (GroupState(True, 0, 4), "ready up 0%\n"),  # full: out of the rotation, its backup line still in (no drain)
    (GroupState(False), "down\n"),
    (GroupState(True, None, 4), "down\n"),  # the model has not published its slots: not a group to send to
])
def test_the_agent_replies_free_slots_as_a_weight_zero_when_full_down_when_not_ready(state, line) -> None:
    assert agent_reply(state) == line


class FlakyProbe:
    """A group that reads full, then not even ready (a probe that timed out on a busy server)."""

    def __init__(self) -> None:
        self.states = [GroupState(True, 0, 2), GroupState(False)]

    def state(self) -> GroupState:
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]


def ask(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        return sock.makefile("rb").read()


def test_a_draining_agent_says_drain_whatever_the_group_reads_and_knows_a_peer_heard_it() -> None:
    """Draining, the group must leave the rotation (drain, which its backup line follows) but never be marked down:
    HAProxy would cut the streams that carry its worlds' MOVED."""
    agent = CapacityAgent(FlakyProbe(), 0).start()  # type: ignore[arg-type]
    try:
        assert ask(agent.port) == b"ready up 0%\n" and not agent.told.is_set()
        agent.drain()
        assert not agent.told.is_set()  # nobody has heard it yet
        assert [ask(agent.port) for _ in range(3)] == [b"drain\n"] * 3  # the probe would read not ready now
        assert agent.told.wait(5)
    finally:
        agent.stop()


def test_the_streams_open_are_every_ranks_gauge_of_the_model() -> None:
    page = "\n".join([
        "# HELP lingbot_world_streams_open streams this instance is answering",
        'lingbot_world_streams_open{model="lingbot_world",rank="0"} 2',
        'lingbot_world_streams_open{model="lingbot_world",rank="1"} 1',
        'lingbot_world_streams_open{model="other",rank="0"} 5',
        'lingbot_world_streams_open_total{model="lingbot_world",rank="0"} 7',
    ])
    assert streams_open(page) == 3 and streams_open("nv_inference_count 1") == 0


def test_free_slots_are_rank_0s_gauge_of_the_model() -> None:
    page = "\n".join([
        "# HELP lingbot_world_free_slots the group's free session slots",
        'lingbot_world_free_slots{model="other",rank="0"} 9',
        'lingbot_world_free_slots{model="lingbot_world",rank="1"} 7',
        'lingbot_world_free_slots{model="lingbot_world",rank="0"} 3',
    ])
    assert free_slots_of(page) == 3 and free_slots_of("nv_inference_count 1") is None


class CountingProbe:
    def __init__(self) -> None:
        self.calls = 0

    def state(self) -> GroupState:
        self.calls += 1
        return GroupState(True, 1, 2)


def test_the_agent_answers_each_connection_once_reads_nothing_and_probes_at_most_4_times_a_second() -> None:
    probe = CountingProbe()
    agent = CapacityAgent(probe, 0).start()  # type: ignore[arg-type]
    try:
        silent = [socket.create_connection(("127.0.0.1", agent.port), timeout=5) for _ in range(10)]

        def ask() -> bytes:
            with socket.create_connection(("127.0.0.1", agent.port), timeout=5) as sock:
                try:
                    sock.sendall(b"\x00garbage\n" * 1000)
                except OSError:
                    pass  # it may have answered and closed already
                return sock.makefile("rb").read()

        replies: list[bytes] = []
        threads = [threading.Thread(target=lambda: replies.append(ask())) for _ in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert replies == [b"ready up 50%\n"] * 20
        assert all(s.makefile("rb").read() == b"ready up 50%\n" for s in silent)  # answered though they sent nothing
        assert probe.calls <= 3  # 30 connections within well under a second share the probes
        for s in silent:
            s.close()
    finally:
        agent.stop()
    with pytest.raises(ValueError, match=r"agent port 127.0.0.1:\d+ cannot be bound"):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            CapacityAgent(probe, taken.getsockname()[1])  # type: ignore[arg-type]


def test_an_agent_left_serving_does_not_keep_its_process_alive() -> None:
    """A launcher that exits without stopping its agent (an error on the way out) still exits."""
    code = ("from backend.launch.agent import CapacityAgent, GroupState\n"
            "class Probe:\n    def state(self): return GroupState(True, 1, 2)\n"
            "print(CapacityAgent(Probe(), 0).start().port, flush=True)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and int(done.stdout) > 0, done.stderr


@needs_haproxy
def test_haproxy_accepts_the_balancers_configuration(tmp_path: Path) -> None:
    groups = [GroupAddress("group0", "127.0.0.1", 9001, 9000, 9003), GroupAddress.parse("10.0.0.2:8001:8000:8003",
                                                                                         "remote0")]
    text = render_haproxy(groups, "127.0.0.1", 8001, 1.0, tmp_path / "haproxy.sock")
    config = tmp_path / "haproxy.cfg"
    config.write_text(text)
    check_config(config)
    assert "bind 127.0.0.1:8001 proto h2" in text and "balance leastconn" in text
    assert re.search(r"server remote0 10\.0\.0\.2:8001 proto h2 check .*port 8000 .*agent-check agent-addr 10\.0\.0\.2 "
                     r"agent-port 8003 agent-inter 1000ms", text)
    # The backup line follows its group's state (a drain included) through `track`, not its weight.
    assert "server remote0-queue 10.0.0.2:8001 proto h2 track remote0 on-marked-down shutdown-sessions backup" in text
    config.write_text(text.replace("balance leastconn", "balance nonsense"))
    with pytest.raises(ValueError, match="haproxy refuses"):
        check_config(config)


def test_the_fleets_tls_flags_reach_the_balancer_and_a_client_ca_makes_it_mutual(tmp_path: Path) -> None:
    pem, ca = tmp_path / "balancer.pem", tmp_path / "clients-ca.pem"
    for path in (pem, ca):
        path.write_text("PEM")

    def bind(*flags: str) -> str:  # the balancer's bind line, as the fleet's flags render it
        tls = balancer_tls(build_parser().parse_args(list(flags)))
        text = render_haproxy([GroupAddress("group0", "127.0.0.1", 9001, 9000, 9003)], "0.0.0.0", 443, 1.0,
                              tmp_path / "haproxy.sock", tls=tls)
        return next(line.strip() for line in text.splitlines() if line.strip().startswith("bind "))

    assert bind("--tls-pem", str(pem), "--tls-client-ca", str(ca)) == \
        f"bind 0.0.0.0:443 ssl crt {pem.resolve()} alpn h2 ca-file {ca.resolve()} verify required"
    assert bind("--tls-pem", str(pem)) == f"bind 0.0.0.0:443 ssl crt {pem.resolve()} alpn h2"
    assert bind() == "bind 0.0.0.0:443 proto h2"
    with pytest.raises(ValueError, match="--tls-client-ca needs --tls-pem"):
        bind("--tls-client-ca", str(ca))


def test_a_group_address_is_host_and_three_ports() -> None:
    assert GroupAddress.parse("h:1:2:3", "g").grpc_url == "h:1"
    for bad in ("h:1:2", "h:1:2:x", ":1:2:3"):
        with pytest.raises(ValueError, match="HOST:GRPC_PORT:HTTP_PORT:AGENT_PORT"):
            GroupAddress.parse(bad, "g")


@needs_haproxy
def test_the_command_line_needs_groups_and_renders_for_groups_started_elsewhere(tmp_path: Path, capsys) -> None:
    assert main(["--out", str(tmp_path)]) == 1
    assert "give --groups N" in capsys.readouterr().err
    assert main(["--groups", "1", "--render-only", "--out", str(tmp_path)]) == 1
    assert "--render-only balances groups started elsewhere" in capsys.readouterr().err
    assert main(["--render-only", "--group", "10.0.0.2:8001:8000:8003", "--address", "0.0.0.0",
                 "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "haproxy.cfg")
    assert "bind 0.0.0.0:8001 proto h2" in (tmp_path / "haproxy.cfg").read_text()


def test_the_stub_watch_names_a_stub_that_died_once() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watch = StubWatch(lambda: {0: child.pid})
    watch.adopt()
    assert alive(child.pid) and watch.dead() == []
    child.kill()
    child.wait()
    assert not alive(child.pid) and watch.dead() == [0]
    assert watch.dead() == []  # told once; the next load's stubs are adopted anew
    assert StubWatch(dict).adopt() is False and watch.adopt() is True  # no stub left to watch / one


class ReadyModel:
    """A server whose model reads ready."""

    def is_model_ready(self, model: str) -> bool:
        return True


@pytest.mark.timeout(20)
def test_a_model_ready_with_no_stub_left_is_healed_even_if_the_watch_never_saw_one(tmp_path: Path) -> None:
    """A stub killed before the watch first adopted it (a fast first block): the model reads ready with no stub
    process on the server, which the healer treats as a death once DEAD_STUB_GRACE_S have passed; stubs that turn up
    meanwhile (a load still under way) are watched instead."""
    stubs: dict[int, int] = {}
    healer = Healer(ModelControl("127.0.0.1:1", ""), "m", HostSignals(tmp_path), stubs=lambda: dict(stubs))
    assert healer._dead_stub(ReadyModel()) is None  # seen, not yet past the grace
    began = time.monotonic()
    why = wait_until(lambda: healer._dead_stub(ReadyModel()), DEAD_STUB_GRACE_S + 5, "the healer to name the death")
    assert "no stub of the model is alive" in why and time.monotonic() - began >= DEAD_STUB_GRACE_S - 0.1

    healer = Healer(ModelControl("127.0.0.1:1", ""), "m", HostSignals(tmp_path), stubs=lambda: dict(stubs))
    assert healer._dead_stub(ReadyModel()) is None
    stubs[0] = os.getpid()  # a live stub after all
    past_grace = time.monotonic() + DEAD_STUB_GRACE_S + 0.5
    while time.monotonic() < past_grace:
        assert healer._dead_stub(ReadyModel()) is None
        time.sleep(0.05)
    assert healer.watch.stubs == {0: os.getpid()}


class ReloadingServer:
    """A model server as the healer's ModelControl reaches it: the failed model reads ready for its first
    `unloading` questions (its unload under way), then not; its first `failing` loads fail (an error, or a load that
    leaves it not ready), later ones make it ready. It keeps when each load came and when it last read ready before
    one."""

    def __init__(self, failing: int, how: str = "error", unloading: int = 0) -> None:
        self.failing, self.how, self.unloading = failing, how, unloading
        self.loads: list[float] = []
        self.ready_until = 0.0  # when the failed model last read ready
        self.ready = False

    def unload_model(self, model: str) -> None:
        pass

    def is_model_ready(self, model: str) -> bool:
        if not self.loads and self.unloading:
            self.unloading -= 1
            self.ready_until = time.monotonic()
            return True
        return self.ready

    def load_model(self, model: str, timeout_s: float) -> None:
        self.loads.append(time.monotonic())
        if len(self.loads) <= self.failing and self.how == "error":
            raise ControlError(f"load {len(self.loads)} failed")
        self.ready = len(self.loads) > self.failing


class Signals(HostSignals):
    """Host signals that count the healer's looks for a request."""

    looks = 0

    def take_heal(self) -> str | None:
        self.looks += 1
        return super().take_heal()


class Waits(threading.Event):
    """The healer's stop event, keeping every wait's timeout: its polls and its backoffs (waited for, or with
    `instant` only counted)."""

    def __init__(self, instant: bool = False) -> None:
        super().__init__()
        self.instant = instant
        self.timeouts: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.timeouts.append(timeout)
        return self.is_set() if self.instant and timeout != heal.POLL_S else super().wait(timeout)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("failing", "how", "healed_at"), [(2, "error", 3), (3, "error", None), (1, "not ready", 2)])
def test_the_healer_tries_every_configured_reload_with_doubling_backoff(tmp_path: Path, failing: int,
                                                                        how: str, healed_at: int | None) -> None:
    """3 loads configured: a model whose loads fail is tried exactly 3 times, 0.03 s then 0.06 s apart, and left
    unloaded; one that loads on the k-th try is healed at k. The heal is asked for while the healer idles (it has
    looked once), and its first load waits until the failed model reads not ready (its unload)."""
    server = ReloadingServer(failing, how, unloading=1)
    signals = Signals(tmp_path)
    healer = Healer(server, "m", signals, attempts=3, first_backoff_s=0.03)
    healer._stop = waits = Waits()
    healer.start()
    try:
        wait_until(lambda: signals.looks >= 1, 10, "the healer to look for requests")
        signals.ask_heal("rank 1 lost its peer")
        wait_until(lambda: healer.heals, 20, "the heal to end")
    finally:
        healer.stop(timeout_s=10)
    assert not healer._thread.is_alive()  # stop() returns once the healer has stopped: no load after it
    (done,) = healer.heals
    assert (done.healed, done.attempts, done.why) == (healed_at is not None, healed_at or 3, "rank 1 lost its peer")
    assert len(server.loads) == (healed_at or 3) and server.unloading == 0 and server.loads[0] > server.ready_until
    assert [t for t in waits.timeouts if t != heal.POLL_S] == [0.03, 0.06][: (healed_at or 3) - 1]


class LoadAfterStubs(ReloadingServer):
    """A server whose load finds whether any of the failed load's stubs (`stubs`) still lived: a survivor holds its
    rank's host claim, so the real load would be refused RELOAD_REFUSED, or wait for it in the rendezvous."""

    def __init__(self, stubs: list[subprocess.Popen]) -> None:
        super().__init__(failing=0)
        self.stubs = stubs
        self.survivors_at_load: list[int] = []

    def load_model(self, model: str, timeout_s: float) -> None:
        self.survivors_at_load = [p.pid for p in self.stubs if p.poll() is None]
        super().load_model(model, timeout_s)


STUB = """import signal, sys, time
from backend.parallel.host_claim import claim_for_this_host, member_claim
signal.signal(signal.SIGTERM, signal.SIG_IGN)
claim = claim_for_this_host(member_claim(1, int(sys.argv[1]))) if sys.argv[2] == "holds" else None
print("up", flush=True)
time.sleep(60)
"""


def fake_stub(rank: int, holds: bool) -> subprocess.Popen:
    """A stub of the failed load that ignores SIGTERM, holding its rank's claim (stuck in the group) or not (it left
    the group and freed the model, its process lingering)."""
    stub = subprocess.Popen([sys.executable, "-c", STUB, str(rank), "holds" if holds else "left"],
                            stdout=subprocess.PIPE, text=True)
    assert stub.stdout.readline() == "up\n"
    return stub


@pytest.mark.timeout(30)
def test_no_stub_of_the_failed_load_is_left_when_the_new_load_starts(tmp_path: Path, monkeypatch) -> None:
    """Rank 1's stub is stuck with its dead peer, its rank's claim held: the healer waits STUBS_GONE_S for it, then
    kills it, so the load is neither refused nor left waiting for it. Rank 0's stub left its group (its claim let go)
    and lingers, its instance never finalised: it costs the heal no wait, and is killed too, so the new load's stubs
    are the server's only ones (an old one beside a new one of the same rank would be watched in its stead)."""
    monkeypatch.setattr(heal, "STUBS_GONE_S", 1.0)
    stuck, lingering = fake_stub(1, holds=True), fake_stub(0, holds=False)
    try:
        server = LoadAfterStubs([stuck, lingering])
        live = {0: lingering, 1: stuck}
        healer = Healer(server, "m", HostSignals(tmp_path),
                        stubs=lambda: {r: p.pid for r, p in live.items() if p.poll() is None})
        began = time.monotonic()
        assert healer._heal("rank 0 died").healed and time.monotonic() - began >= heal.STUBS_GONE_S
        assert server.survivors_at_load == [] and stuck.returncode == lingering.returncode == -9
    finally:
        for p in (stuck, lingering):
            p.kill()
            p.wait()
    lingering = fake_stub(0, holds=False)
    try:
        server = LoadAfterStubs([lingering])
        healer = Healer(server, "m", HostSignals(tmp_path), stubs=lambda: {0: lingering.pid} if lingering.poll() is None
                        else {})
        began = time.monotonic()
        assert healer._heal("rank 1 died").healed and time.monotonic() - began < heal.STUBS_GONE_S  # no wait
        assert server.survivors_at_load == [] and lingering.returncode == -9
    finally:
        lingering.kill()
        lingering.wait()


@pytest.mark.timeout(30)
def test_a_heal_that_does_not_take_ends_the_healer_and_says_so(tmp_path: Path) -> None:
    """Every load fails: after its configured loads the healer calls on_unhealed once, with the heal, and stops (the
    launcher then exits for a fresh start); it asks for no load after that."""
    server = ReloadingServer(failing=10)
    signals = Signals(tmp_path)
    told: list[heal.Heal] = []
    healer = Healer(server, "m", signals, attempts=2, first_backoff_s=0.01, on_unhealed=told.append).start()
    try:
        wait_until(lambda: signals.looks >= 1, 10, "the healer to look for requests")
        signals.ask_heal("rank 1 lost its peer")
        wait_until(lambda: told, 20, "the healer to give up")
        healer._thread.join(5)
        assert not healer._thread.is_alive()
    finally:
        healer.stop(timeout_s=10)
    (unhealed,) = told
    assert (unhealed.healed, unhealed.attempts, unhealed.why) == (False, 2, "rank 1 lost its peer")
    assert len(server.loads) == 2


class NotLoaded:
    """A server whose model is not loaded, as the healer's ModelControl reaches it; it counts the questions."""

    asked = 0

    def is_model_ready(self, model: str) -> bool:
        self.asked += 1
        return False


def test_the_stub_watch_asks_about_a_model_not_loaded_once_a_second(tmp_path: Path) -> None:
    """While nothing is loaded the watch has no stubs to watch: it asks the server whether the model reads ready
    once per ADOPT_EVERY_S (1 s), not at every poll."""
    client = NotLoaded()
    healer = Healer(client, "m", HostSignals(tmp_path), stubs=dict)
    began = time.monotonic()
    for _ in range(20):
        assert healer._dead_stub(client) is None
    assert 1 <= client.asked <= 1 + (time.monotonic() - began) // heal.ADOPT_EVERY_S


@pytest.mark.timeout(30)
def test_by_default_the_healer_loads_4_times_1_2_and_4_s_apart(tmp_path: Path) -> None:
    """What docs/serving.md promises an operator: up to 4 loads, 1, 2 and 4 s between them (the backoffs counted,
    not waited for)."""
    server = ReloadingServer(failing=10)
    healer = Healer(server, "m", HostSignals(tmp_path))
    healer._stop = waits = Waits(instant=True)
    done = healer._heal("rank 0 died")
    assert (done.healed, done.attempts, len(server.loads)) == (False, 4, 4)
    assert [t for t in waits.timeouts if t != heal.POLL_S] == [1.0, 2.0, 4.0]


@pytest.mark.timeout(30)
def test_a_stub_that_dies_while_the_model_reads_ready_is_healed_after_the_grace(tmp_path: Path) -> None:
    """The watch adopts the model's stubs once it reads ready; one of them dies; DEAD_STUB_GRACE_S later (no
    survivor asked for a heal meanwhile) the healer names its rank."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    healer = Healer("127.0.0.1:1", "m", HostSignals(tmp_path), {}, stubs=lambda: {0: child.pid, 1: os.getpid()})
    try:
        assert healer._dead_stub(ReadyModel()) is None and healer.watch.stubs == {0: child.pid, 1: os.getpid()}
        assert healer._dead_stub(ReadyModel()) is None  # both alive
    finally:
        child.kill()
        child.wait()
    died = time.monotonic()
    why = wait_until(lambda: healer._dead_stub(ReadyModel()), DEAD_STUB_GRACE_S + 5, "the healer to name the death")
    assert why == "the stub of rank 0 died and the model still read ready"
    assert time.monotonic() - died >= DEAD_STUB_GRACE_S - 0.1


def test_local_gpu_groups_each_get_their_own_visible_gpus_and_ports(monkeypatch, tmp_path: Path) -> None:
    """Not run on a GPU here: the launchers the fleet would start on an 8-GPU host's last four GPUs."""
    from backend.fleet.supervisor import build_parser, local_groups

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    groups = local_groups(build_parser().parse_args(["--groups", "2", "--sp", "2", "--kind", "gpu", "--out",
                                                     str(tmp_path), "--param", "dtype=bfloat16"]))
    assert [g.env["CUDA_VISIBLE_DEVICES"] for g in groups] == ["4,5", "6,7"]
    for g in groups:
        command = " ".join(g.command)
        assert "--sp 2 --kind gpu --address 127.0.0.1" in command and "--param dtype=bfloat16" in command
        assert f"--agent-port {g.address.agent_port}" in command and "rendezvous_port=" in command
    ports = [p for g in groups for p in (g.address.grpc_port, g.address.http_port, g.address.agent_port, g.metrics_port)]
    assert len(set(ports)) == 8
    with pytest.raises(ValueError, match="needs 6 GPUs; 4 are visible"):
        local_groups(build_parser().parse_args(["--groups", "3", "--sp", "2", "--kind", "gpu"]))


def test_restart_touches_only_a_live_launcher_of_the_running_fleet(tmp_path: Path, capsys) -> None:
    """A stale or forged fleet.json cannot make `restart` signal a process that is not the fleet's own launcher."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    fleet, stranger = subprocess.Popen(sleeper), subprocess.Popen(sleeper)  # the stranger is no child of the fleet
    try:
        manifest = {"fleet_pid": fleet.pid, "stats_socket": str(tmp_path / "haproxy.sock"), "launcher_stop_s": 5,
                    "wait_timeout_s": 5, "groups": [{"name": "group0", "launcher_pid": stranger.pid, "log": "x.log"}]}
        (tmp_path / "fleet.json").write_text(json.dumps(manifest))
        for argv, error in [
            (["restart", "--group", "0"], f"group0's launcher (pid {stranger.pid}) is not running"),
            (["restart", "--group", "1"], "no group group1 in this fleet (groups: group0)"),
            (["restart"], "restart needs --group N"),
            (["rolling-restart", "--group", "0"], "rolling-restart restarts every local group: leave --group out"),
        ]:
            assert main([*argv, "--out", str(tmp_path)]) == 1
            assert error in capsys.readouterr().err
        assert stranger.poll() is None  # never signalled
        fleet.kill()
        fleet.wait()
        with pytest.raises(ValueError, match=f"the fleet \\(pid {fleet.pid}\\) is not running"):
            launcher_of(manifest, "group0")
        assert main(["restart", "--group", "0", "--out", str(tmp_path / "nowhere")]) == 1
        assert "fleet.json does not exist: is a fleet running with --out" in capsys.readouterr().err
    finally:
        for p in (fleet, stranger):
            p.kill()
            p.wait()



@pytest.mark.timeout(30)
def test_a_stub_whose_server_dies_outright_exits_and_lets_its_port_go() -> None:
    """A model instance's stub (here a process that starts the watch and listens on a port, as rank 0's store does)
    whose parent, its tritonserver, is killed: it exits within a second or so and its port is free again (the
    group's launcher, started again, can take its rendezvous port), though a thread of it is stuck in the log
    handler (as one is, sending to the dead server's log) and holds the handler's lock."""
    port = free_port()
    stub_code = ("import logging, socket, threading, time; from backend.serving.parent_watch import watch_parent\n"
                 "class Stuck(logging.Handler):\n    def emit(self, record): time.sleep(600)\n"
                 "logging.getLogger().addHandler(Stuck())\n"
                 "threading.Thread(target=logging.getLogger().error, args=('a line',), daemon=True).start()\n"
                 f"watch_parent(0.1); s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen()\n"
                 "time.sleep(60)")
    server_code = (f"import subprocess, sys, time; stub = subprocess.Popen([sys.executable, '-c', {stub_code!r}]); "
                   "print(stub.pid, flush=True); time.sleep(60)")
    server = subprocess.Popen([sys.executable, "-c", server_code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        stub = int(server.stdout.readline())
        wait_until(lambda: port_in_use(port), 20, "the stub listening")
        server.kill()
        server.wait()
        killed = time.monotonic()
        wait_until(lambda: not alive(stub), 10, "the orphaned stub to exit")
        assert time.monotonic() - killed < 5 and not port_in_use(port)
    finally:
        server.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(stub, signal.SIGKILL)


@pytest.mark.timeout(30)
def test_a_stub_whose_servers_launcher_dies_exits_though_its_parent_lives(tmp_path: Path) -> None:
    """A launcher starts its server (TritonServer.start, here of a stand-in tritonserver that starts one stub) and is
    killed outright: the stub watches the owner its server's environment names, which is that launcher, and exits at
    once, whatever its own parent does (a stub was seen orphaned with its watch of its parent blind: it had no live
    parent to tell from when its watch started)."""
    site, stub_pid = tmp_path / "site", tmp_path / "stub.pid"
    stub_code = "import time; from backend.serving.parent_watch import watch_parent; watch_parent(0.1); time.sleep(60)"
    binary = PytritonWheel(site).binary
    binary.parent.mkdir(parents=True)
    binary.write_text(f"#!{sys.executable}\nimport subprocess, sys, time\n"
                      f"stub = subprocess.Popen([sys.executable, '-c', {stub_code!r}])\n"
                      f"open({str(stub_pid)!r}, 'w').write(str(stub.pid)); time.sleep(60)\n")
    binary.chmod(0o755)
    (tmp_path / "repository").mkdir()
    launcher_code = ("import time; from pathlib import Path; from backend.launch.server import TritonServer; "
                     "from backend.launch.wheel import PytritonWheel; "
                     f"server = TritonServer(Path({str(tmp_path / 'repository')!r}), "
                     f"wheel=PytritonWheel(Path({str(site)!r})), log_path=Path({str(tmp_path / 'server.log')!r})); "
                     "server.start(); print(server.pid, flush=True); time.sleep(60)")
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    server = int(launcher.stdout.readline())
    stub = 0
    try:
        wait_until(lambda: stub_pid.is_file() and stub_pid.read_text(), 20, "the stub started")
        stub = int(stub_pid.read_text())
        launcher.kill()
        launcher.wait()
        wait_until(lambda: not alive(stub), 10, "the stub to exit")
        assert alive(server)  # its parent lives on: the launcher's death alone ended it
    finally:
        launcher.kill()
        for pid in filter(None, (server, stub)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_group_restarts_after_each_crash_of_a_long_life_and_stays_down_after_a_crash_loop() -> None:
    """Exits of a launcher whose group never served count in a row: the fleet backs off, then leaves it down after
    RESTARTS. A group that served STABLE_S clears the count, so the same crashes spread over its life (a soak's
    faults, with drains between) restart it every time."""
    from backend.fleet import supervisor

    class Group(supervisor.SupervisedGroup):
        def __init__(self) -> None:
            super().__init__(GroupAddress("g", "127.0.0.1", 1, 2, 3), 4, [], {}, Path("launcher.log"))
            self.rc: int | None = None
            self.serves = False

        def start(self) -> None:
            self.starts += 1
            self.serving_since, self.rc = None, None

        def exited(self) -> int | None:
            return self.rc

        def ready(self) -> bool:
            return self.serves

    def crash_and_restart(group: Group, now: float) -> float:
        group.rc = 1
        group.supervise(now)
        if group.given_up:
            return now
        assert group.next_start_s is not None and group.next_start_s > now
        group.supervise(group.next_start_s)
        assert group.starts > 0 and group.rc is None
        return group.next_start_s or now

    long_lived = Group()
    long_lived.start()
    now = 0.0
    for _ in range(3 * supervisor.RESTARTS):  # each crash after the group served its stable stretch
        long_lived.serves = True
        long_lived.supervise(now)
        now += supervisor.STABLE_S
        now = crash_and_restart(long_lived, now) + 1.0
    assert not long_lived.given_up and long_lived.starts == 1 + 3 * supervisor.RESTARTS

    looping = Group()
    looping.start()
    now = 0.0
    for _ in range(supervisor.RESTARTS + 1):  # it never serves
        now = crash_and_restart(looping, now) + 1.0
    assert looping.given_up and looping.starts == 1 + supervisor.RESTARTS

    brief = Group()  # serves, but dies within its stable stretch each time: still a loop
    brief.start()
    now = 0.0
    for _ in range(supervisor.RESTARTS + 1):
        brief.serves = True
        brief.supervise(now)
        now = crash_and_restart(brief, now + 1.0) + 1.0
    assert brief.given_up


def test_a_group_that_crash_loops_after_a_long_life_stays_down_after_its_fifth_quick_restart(
        tmp_path: Path, monkeypatch) -> None:
    """A group that served for hours, then whose launcher exits again within seconds of each start (some restarts
    read ready a moment, some never): its long life does not clear the count of the loop, so the fleet restarts it
    RESTARTS times and then leaves it down, however long it waits after."""
    from backend.fleet import supervisor

    class Launcher:  # a launcher child process that exits when the test says
        def __init__(self, *args, **kwargs) -> None:
            self.rc: int | None = None

        def poll(self) -> int | None:
            return self.rc

    class Group(supervisor.SupervisedGroup):
        serves = False

        def ready(self) -> bool:
            return self.serves

    monkeypatch.setattr(supervisor.subprocess, "Popen", Launcher)
    group = Group(GroupAddress("g", "127.0.0.1", 1, 2, 3), 4, [], {}, tmp_path / "launcher.log")
    group.start()
    group.serves = True
    group.supervise(0.0)
    now = 100 * supervisor.STABLE_S  # a long life
    group.supervise(now)
    for restart in range(supervisor.RESTARTS + 1):
        group.serves = restart % 2 == 1
        group.supervise(now + 0.5)
        group.process.rc = 1  # it exits within seconds of its start
        group.supervise(now + 1.0)
        if restart == supervisor.RESTARTS:
            break
        assert not group.given_up and group.next_start_s is not None
        now = group.next_start_s
        group.supervise(now)
        assert group.starts == 2 + restart and group.process.rc is None
    assert group.given_up and group.starts == 1 + supervisor.RESTARTS
    for later in range(1, 4):
        group.supervise(now + later * supervisor.STABLE_S)
    assert group.starts == 1 + supervisor.RESTARTS  # left down
