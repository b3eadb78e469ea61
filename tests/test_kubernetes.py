"""The fleet's Kubernetes manifests (deploy/kubernetes/): each one valid against the Kubernetes schemas
(kubernetes-validate ships them: no network), the balancer's ConfigMap the render of backend/fleet/kubernetes.py, and
the names and ports the render uses those the manifests give the group pods."""
from __future__ import annotations

import contextlib
import dataclasses
import signal
import subprocess
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

MANIFESTS = sorted((Path(__file__).resolve().parent.parent / "deploy" / "kubernetes").glob("*.yaml"))
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
                try:
                    return server_states(sock)
                except OSError:  # haproxy is starting
                    return {}

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
