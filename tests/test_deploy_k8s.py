"""deploy/k8s, checked without a cluster: every manifest validates against Kubernetes' own OpenAPI schemas in strict
mode (kubernetes-validate: unknown fields and wrong types fail), and the pieces fit together: selectors, native gRPC
probes on the gRPC ports, GPU requests, termination grace vs the workers' drain, the pod IP from the downward API,
Prometheus annotations, images, users and ports as the Dockerfiles and compose have them."""

from __future__ import annotations

import copy
import functools
import re

import pytest
import yaml
from kubernetes_validate import utils as kv

from pdserve.cli import build_parser
from pdserve.cli.env import known_variables

from stack import REPO
from test_deploy_compose import flag_default, role_ports
from test_deploy_images import exposed_ports, image_tag, user_id

K8S = REPO / "deploy" / "k8s"
# The oldest Kubernetes with GA gRPC probes, and the newest the validator knows.
VERSIONS = ("1.27.0", kv.latest_version())
ROLES = ("router", "prefill", "decode")


@functools.cache  # read-only: a test that edits a manifest edits a deep copy
def manifests() -> list[tuple[str, dict]]:
    return [(path.name, doc) for path in sorted(K8S.glob("*.yaml")) if path.name != "kustomization.yaml"
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def find(kind: str, name: str) -> dict:
    found = [d for _, d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def container(role: str) -> dict:
    return find("Deployment", f"pdserve-{role}")["spec"]["template"]["spec"]["containers"][0]


def env_values(role: str) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(role).get("env", [])}


def container_port(role: str, name: str) -> int:
    return next(p["containerPort"] for p in container(role)["ports"] if p["name"] == name)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_validates_strictly(version):
    docs = manifests()
    assert len(docs) >= 10
    for filename, doc in docs:
        kv.validate(doc, version, strict=True)


@pytest.mark.parametrize("break_it", [
    lambda d: d["spec"]["template"]["spec"]["containers"][0].update(readinesProbe={"grpc": {"port": 50061}}),
    lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(containerPort="grpc"),
    lambda d: d["spec"]["template"]["spec"].update(terminationGracePeriod=30),
])
def test_the_validator_rejects_broken_manifests(break_it):
    """The check above means something: a misspelt field or a wrong type fails it."""
    doc = copy.deepcopy(find("Deployment", "pdserve-prefill"))
    break_it(doc)
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, VERSIONS[0], strict=True)


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == sorted(p.name for p in K8S.glob("*.yaml")
                                                        if p.name != "kustomization.yaml")


def test_the_objects_are_there_and_selectors_match():
    for role in (*ROLES, "redis"):
        deployment = find("Deployment", f"pdserve-{role}")
        pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector.items() <= pod_labels.items()
        if role in ROLES:
            pdb = find("PodDisruptionBudget", f"pdserve-{role}")
            assert pdb["spec"]["selector"]["matchLabels"] == selector
        if role in ("router", "redis"):
            service = find("Service", f"pdserve-{role}")
            assert service["spec"]["selector"].items() <= pod_labels.items()
            names = {p["name"] for p in container(role)["ports"]}
            assert {p["targetPort"] for p in service["spec"]["ports"]} <= names
    assert find("PodDisruptionBudget", "pdserve-router")["spec"]["minAvailable"] >= 1
    assert find("Deployment", "pdserve-router")["spec"]["replicas"] > \
        find("PodDisruptionBudget", "pdserve-router")["spec"]["minAvailable"]  # a drain can proceed


@pytest.mark.parametrize("role", ROLES)
def test_native_grpc_probes_on_the_grpc_port(role):
    c = container(role)
    port = int(env_values(role)["PDSERVE_PORT"])
    assert container_port(role, "grpc") == port
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": port}, f"{role} {probe}: a native gRPC probe on {port}"
    if role != "router":  # checkpoints load for minutes
        startup = c["startupProbe"]
        assert startup["grpc"] == {"port": port}
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


@pytest.mark.parametrize("role", ("prefill", "decode"))
def test_workers_request_gpus(role):
    spec = find("Deployment", f"pdserve-{role}")["spec"]["template"]["spec"]
    assert int(spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert "nvidia.com/gpu" not in container("router")["resources"].get("limits", {})


@pytest.mark.parametrize("role", ROLES)
def test_termination_grace_covers_the_drain(role):
    """SIGTERM starts the drain (requests in flight get --drain-timeout to finish), then the engine, the KV
    transport and the Redis registration stop: the kill must not come before, with 10 s to spare."""
    drain = float(find("ConfigMap", "pdserve-config")["data"]["PDSERVE_DRAIN_TIMEOUT"])
    assert drain == flag_default(role, "--drain-timeout"), "keep the ConfigMap at the flag's default, or update this"
    spec = find("Deployment", f"pdserve-{role}")["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] >= drain + 10


@pytest.mark.parametrize("role", ("prefill", "decode"))
def test_workers_register_their_pod_ip(role):
    env = env_values(role)
    assert env["PDSERVE_ADVERTISE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["PDSERVE_WORKER_ID"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    if role == "decode":  # the KV endpoint prefill workers dial: bound to, and reported as, the pod IP
        assert env["PDSERVE_KV_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert container_port(role, "kv") == int(env["PDSERVE_KV_PORT"])
    text = "\n".join(p.read_text() for p in K8S.glob("*.yaml"))
    assert not re.findall(r"\b(?!0\.0\.0\.0)\d+\.\d+\.\d+\.\d+\b", text), "hard-coded IP addresses"


def test_shared_settings_come_from_the_configmap():
    config = find("ConfigMap", "pdserve-config")["data"]
    known = known_variables(build_parser())
    assert set(config) <= known, f"no pdserve flag reads {set(config) - known}"
    redis_service = find("Service", "pdserve-redis")
    assert config["PDSERVE_REDIS_URL"] == f"redis://pdserve-redis:{redis_service['spec']['ports'][0]['port']}/0"
    assert config["PDSERVE_HOST"] == "0.0.0.0"
    for role in ROLES:
        c = container(role)
        assert {"configMapRef": {"name": "pdserve-config"}} in c["envFrom"]
        assert set(env_values(role)) <= known
        mount = next(m for m in c["volumeMounts"] if m["name"] == "models")
        assert config["PDSERVE_MODEL"].startswith(mount["mountPath"] + "/") and mount["readOnly"]
        volume = next(v for v in find("Deployment", f"pdserve-{role}")["spec"]["template"]["spec"]["volumes"]
                      if v["name"] == "models")
        find("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])


@pytest.mark.parametrize("role", ROLES)
def test_prometheus_annotations_images_users_and_ports_agree(role):
    template = find("Deployment", f"pdserve-{role}")["spec"]["template"]
    annotations = template["metadata"]["annotations"]
    metrics_port = int(env_values(role)["PDSERVE_METRICS_PORT"])
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == metrics_port == container_port(role, "metrics")
    kind = "cpu" if role == "router" else "cuda"
    assert container(role)["image"] == image_tag(kind)
    security = template["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == user_id(kind)
    ports = {k: int(v) for k, v in env_values(role).items() if k.endswith("_PORT")}
    assert ports == role_ports()[role], "Kubernetes and compose give this role different ports"
    assert set(ports.values()) <= exposed_ports(kind)
