"""The fleet's Kubernetes manifests (deploy/kubernetes/): each one valid against the Kubernetes schemas
(kubernetes-validate ships them: no network), the balancer's ConfigMap the render of backend/fleet/kubernetes.py, and
the names and ports the render uses those the manifests give the group pods."""
from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from backend.fleet import kubernetes as k8s

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
