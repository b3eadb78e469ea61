"""The fleet's Kubernetes manifests (deploy/kubernetes/): each one valid against the Kubernetes schemas
(kubernetes-validate ships them: no network), the balancer's ConfigMap the render of backend/fleet/kubernetes.py, and
the names and ports the render uses those the manifests give the group pods."""
from __future__ import annotations

import contextlib
import dataclasses
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from backend.fleet import kubernetes as k8s
from backend.fleet.balancer import HAPROXY, check_config, server_states, start_haproxy
from backend.parallel.ports import free_port
from polling import wait_until
from system_tools import requires_tool
from triton_harness import tiny_parameters

ROOT = Path(__file__).resolve().parent.parent

MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
VERSION = kubernetes_validate.latest_version()


def documents() -> list[dict]:
    return [d for path in MANIFESTS for d in yaml.safe_load_all(path.read_text()) if d]


def by_kind(kind: str, name: str) -> dict:
    (found,) = [d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_every_manifest_is_valid_against_the_kubernetes_schemas(path: Path) -> None:
    for document in yaml.safe_load_all(path.read_text()):
        kubernetes_validate.validate(document, VERSION, strict=True)  # raises, naming the field


def test_a_manifest_with_a_mistake_is_refused() -> None:
    broken = by_kind("StatefulSet", k8s.GROUP)
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSION, strict=True)


def test_the_balancer_s_config_map_is_the_render() -> None:
    assert k8s.CONFIG_MANIFEST.read_text() == k8s.config_map(), "run python -m backend.fleet.kubernetes"


def test_the_render_finds_the_pods_the_manifests_make() -> None:
    service, pods = by_kind("Service", k8s.GROUP), by_kind("StatefulSet", k8s.GROUP)
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert pods["spec"]["serviceName"] == k8s.GROUP and pods["metadata"]["namespace"] == k8s.NAMESPACE
    assert pods["spec"]["replicas"] <= k8s.SLOTS
    (launcher,) = pods["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in launcher["ports"]}
    assert (ports["grpc"], ports["http"], ports["agent"]) == (k8s.GRPC_PORT, k8s.HTTP_PORT, k8s.AGENT_PORT)
    assert {f"--grpc-port={k8s.GRPC_PORT}", f"--http-port={k8s.HTTP_PORT}", f"--agent-port={k8s.AGENT_PORT}",
            "--address=0.0.0.0"} <= set(launcher["command"])
    assert launcher["readinessProbe"]["httpGet"]["path"] == "/v2/models/lingbot_world/ready"
    config = k8s.haproxy_config()
    for i in range(k8s.SLOTS):
        assert f"server group{i} {k8s.GROUP}-{i}.{k8s.GROUP}.{k8s.NAMESPACE}.svc.cluster.local:{k8s.GRPC_PORT}" in config
        assert f"track group{i}" in config


def test_the_grace_period_outlasts_the_drain_and_the_stop() -> None:
    from backend.fleet.supervisor import STOP_S

    spec = by_kind("StatefulSet", k8s.GROUP)["spec"]["template"]["spec"]
    (launcher,) = spec["containers"]
    drain = float(next(a for a in launcher["command"] if a.startswith("--drain-timeout-s=")).split("=")[1])
    assert spec["terminationGracePeriodSeconds"] >= drain + STOP_S
    assert "lifecycle" not in launcher  # SIGTERM itself drains: a preStop would eat into the grace period


DNSMASQ = "/usr/sbin/dnsmasq"  # Debian's dnsmasq


@requires_tool(Path(HAPROXY).is_file(), f"HAProxy at {HAPROXY} (Debian's haproxy)")
def test_haproxy_accepts_the_render_with_the_pods_resolver_and_with_a_nameserver_given(tmp_path: Path) -> None:
    for i, groups in enumerate((None, k8s.dns_groups(nameservers=("127.0.0.1:53",)))):
        config = tmp_path / f"haproxy{i}.cfg"
        config.write_text(k8s.haproxy_config(groups))
        check_config(config)


def balancer_states(sock: Path) -> dict[str, str]:
    """server name -> HAProxy's state of it; {} while haproxy is starting (no stats socket yet)."""
    try:
        return server_states(sock)
    except OSError:
        return {}


@dataclass
class Dns:
    """dnsmasq on 127.0.0.1:port answering for cluster.local from its hosts file alone."""

    port: int
    hosts: Path
    process: subprocess.Popen[bytes]

    def publish(self, records: dict[str, str]) -> None:
        """These names (name -> address) and no other, from now on (SIGHUP rereads the hosts file)."""
        self.hosts.write_text("".join(f"{address} {name}\n" for name, address in records.items()))
        self.process.send_signal(signal.SIGHUP)


@contextlib.contextmanager
def running_dns(folder: Path) -> Iterator[Dns]:
    hosts, port = folder / "hosts", free_port()
    hosts.write_text("")
    process = subprocess.Popen([DNSMASQ, "--keep-in-foreground", f"--port={port}", "--listen-address=127.0.0.1",
                                "--bind-interfaces", "--no-resolv", "--no-hosts", f"--addn-hosts={hosts}",
                                "--local=/cluster.local/", "--user=root", "--pid-file=", "--cache-size=0"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield Dns(port, hosts, process)
    finally:
        process.terminate()
        process.wait(5)


@pytest.mark.server
@requires_tool(Path(HAPROXY).is_file(), f"HAProxy at {HAPROXY} (Debian's haproxy)")
@requires_tool(Path(DNSMASQ).is_file(), f"dnsmasq at {DNSMASQ} (Debian's dnsmasq)")
def test_a_pod_s_name_published_takes_its_slot_into_the_checks_and_one_removed_leaves_them(tmp_path: Path) -> None:
    """The render, with a real dnsmasq as the cluster's DNS: a slot whose pod name does not resolve is out (MAINT);
    published, the balancer checks it (DOWN here: no group listens); removed, it is out again. Both lines of a slot
    (the group's and its backup) follow."""
    with running_dns(tmp_path) as dns:
        groups = dataclasses.replace(k8s.dns_groups(nameservers=(f"127.0.0.1:{dns.port}",), slots=2),
                                     grpc_port=free_port(), http_port=free_port(), agent_port=free_port())
        config, sock = tmp_path / "haproxy.cfg", tmp_path / "haproxy.sock"
        config.write_text(k8s.haproxy_config(groups, "127.0.0.1", free_port(), sock))
        haproxy = start_haproxy(config, tmp_path / "haproxy.log")
        try:
            def states() -> dict[str, str]:
                return balancer_states(sock)

            out = ("MAINT", "MAINT (resolution)")
            wait_until(lambda: len(states()) == 4 and all(s in out for s in states().values()), 10, "every slot out")
            dns.publish({groups.host(1): "127.0.0.3"})
            wait_until(lambda: states()["group1"] == "DOWN" and states()["group0"] in out, 10, "group1 checked")
            assert states()["group1-queue"] not in out
            dns.publish({})
            wait_until(lambda: states()["group1"] in out and states()["group1-queue"] in out, 10, "group1 out")
        finally:
            haproxy.terminate()
            haproxy.wait(5)


@contextlib.contextmanager
def group_pod(address: str, ports: tuple[int, int, int, int], parameters: dict[str, str], out: Path
              ) -> Iterator[subprocess.Popen[bytes]]:
    """A group as its pod runs it (groups.yaml's launcher), on its own loopback address with the pods' ports."""
    grpc, http, metrics, agent = ports
    out.mkdir(parents=True, exist_ok=True)
    with (out / "launcher.log").open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "backend.launch", "--sp", "1", "--kind", "cpu", "--address", address,
             "--grpc-port", str(grpc), "--http-port", str(http), "--metrics-port", str(metrics), "--agent-port",
             str(agent), "--repository-out", str(out / "repo"), "--log-file", str(out / "tritonserver.log"),
             "--drain-timeout-s", "30", *(a for k, v in parameters.items() for a in ("--param", f"{k}={v}"))],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


@pytest.mark.server
@requires_tool(Path(HAPROXY).is_file(), f"HAProxy at {HAPROXY} (Debian's haproxy)")
@requires_tool(Path(DNSMASQ).is_file(), f"dnsmasq at {DNSMASQ} (Debian's dnsmasq)")
def test_groups_found_by_dns_come_and_go_and_a_drained_group_s_world_goes_on_elsewhere_bit_for_bit(
        tmp_path: Path, tiny_checkpoint: str) -> None:
    """Two SP1 group pods (127.0.0.2 and 127.0.0.3, the same ports) behind the manifests' HAProxy render, a real
    dnsmasq as the cluster's DNS. A world plays on group 0 alone; group 1's name published takes it into rotation;
    group 0 SIGTERMed (the kubelet's stop) drains: the world ends MOVED and goes on on group 1 at its next block, the
    launcher exits well within the grace period; its name removed, it leaves the rotation. The world's blocks are
    those of an uninterrupted run of the same steps, bit for bit."""
    from bench.drain import Player, same_world
    from factories import tiny_request

    parameters = tiny_parameters(tiny_checkpoint, 1, max_sessions="2", max_queue="1", max_batch="1")
    parameters["snapshot_dir"] = str(tmp_path / "snapshots")  # the shared store (the PVC)
    ports = (free_port(), free_port(), free_port(), free_port())
    with running_dns(tmp_path) as dns, contextlib.ExitStack() as stack:
        groups = dataclasses.replace(k8s.dns_groups(nameservers=(f"127.0.0.1:{dns.port}",), slots=2),
                                     grpc_port=ports[0], http_port=ports[1], agent_port=ports[3])
        # Each its own rendezvous port: on one machine a server claims its rank by it host-wide (a pod has its own)
        pods = [stack.enter_context(group_pod(f"127.0.0.{2 + i}", ports, parameters | {"rendezvous_port": str(
            free_port())}, tmp_path / f"pod{i}")) for i in range(2)]
        config, sock, port = tmp_path / "haproxy.cfg", tmp_path / "haproxy.sock", free_port()
        config.write_text(k8s.haproxy_config(groups, "127.0.0.1", port, sock))
        haproxy = start_haproxy(config, tmp_path / "haproxy.log")
        stack.callback(haproxy.wait, 5)
        stack.callback(haproxy.terminate)
        url = f"127.0.0.1:{port}"

        def states() -> dict[str, str]:
            return balancer_states(sock)

        for i in range(2):  # as the readiness probe reads it (a name resolved is UP until its first check)
            wait_until(lambda i=i: model_ready(f"127.0.0.{2 + i}", ports[1]) or pods[i].poll() is not None, 120,
                       f"pod {i} ready")
            assert pods[i].poll() is None, (tmp_path / f"pod{i}" / "launcher.log").read_text()
        dns.publish({groups.host(0): "127.0.0.2"})
        wait_until(lambda: states().get("group0") == "UP", 20, "group 0 in rotation")
        world = Player(url, tiny_request(num_frames=9, decode=False, seed=3), 0.5).start()
        wait_until(lambda: len(world.latents) >= 2 or world.error, 60, "the world playing on group 0")
        assert world.error is None, world.error
        dns.publish({groups.host(0): "127.0.0.2", groups.host(1): "127.0.0.3"})
        wait_until(lambda: states().get("group1") == "UP", 120, "group 1 taken into rotation")
        pods[0].send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        wait_until(lambda: world.moves, 30, "the world moved")
        assert pods[0].wait(30) == 143
        took = time.monotonic() - stopped
        dns.publish({groups.host(1): "127.0.0.3"})
        wait_until(lambda: states()["group0"].startswith("MAINT"), 10, "group 0 out of rotation")
        world.finish(more=3)
        assert world.error is None and len(world.moves) == 1 and world.moves[0].replayed == 0, world.moves
        alone = Player(url, world.first, 0.0, len(world.latents)).start().finish()
        assert alone.error is None and same_world(alone, world)
        assert took < k8s_grace_s()
        print(f"group 0 drained and exited {took:.1f} s after SIGTERM (grace period {k8s_grace_s()} s)")


def model_ready(host: str, http_port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://{host}:{http_port}/v2/models/lingbot_world/ready", timeout=1).close()
        return True
    except OSError:
        return False


def k8s_grace_s() -> int:
    return by_kind("StatefulSet", k8s.GROUP)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
