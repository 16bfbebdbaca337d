"""deploy/k8s/multi-host, checked without a cluster: its patches applied to deploy/k8s as kustomize's strategic merge
applies them (maps merged, containers by name) give manifests that validate strictly against Kubernetes' schemas,
and they set what a two-host deployment over NIXL needs: the nixl transport on both tiers (a value the flag takes),
UCX's transports with RDMA among them, and for each worker pod an RDMA device, the host's network with cluster DNS,
one pod per role per node. The CUDA image carries the nixl extra."""

from __future__ import annotations

import copy

import pytest
import yaml
from kubernetes_validate import utils as kv

from pdserve.cli import build_parser
from pdserve.cli.env import parse_args

from test_deploy_images import instructions, pyproject
from test_deploy_k8s import K8S, VERSIONS, manifests

OVERLAY = K8S / "multi-host"
WORKERS = ("prefill", "decode")


def merge(base, patch):
    """Strategic merge as kustomize does it for these patches: maps merged key by key, lists of named maps
    (containers, env) merged by name, other values replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = merge(base[key], value) if key in base else value
        return out
    if isinstance(base, list) and isinstance(patch, list) and all(isinstance(x, dict) and "name" in x
                                                                  for x in base + patch):
        out = [dict(x) for x in base]
        for item in patch:
            at = next((i for i, x in enumerate(out) if x["name"] == item["name"]), None)
            if at is None:
                out.append(item)
            else:
                out[at] = merge(out[at], item)
        return out
    return patch


def patched() -> dict[tuple[str, str], dict]:
    """(kind, name) -> the manifest of deploy/k8s with the overlay's patches applied."""
    docs = {(d["kind"], d["metadata"]["name"]): copy.deepcopy(d) for _, d in manifests()}
    for patch in yaml.safe_load_all((OVERLAY / "nixl.yaml").read_text()):
        key = (patch["kind"], patch["metadata"]["name"])
        assert key in docs, f"the overlay patches {key}, which deploy/k8s does not have"
        docs[key] = merge(docs[key], patch)
    return docs


def pod(role: str) -> dict:
    return patched()[("Deployment", f"pdserve-{role}")]["spec"]["template"]["spec"]


def test_the_overlay_is_deploy_k8s_plus_its_patches():
    kustomization = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization" and kustomization["resources"] == [".."]
    assert [p["path"] for p in kustomization["patches"]] == ["nixl.yaml"]


@pytest.mark.parametrize("version", VERSIONS)
def test_the_patched_manifests_validate_strictly(version):
    for doc in patched().values():
        kv.validate(doc, version, strict=True)


def test_a_patch_with_a_misspelt_field_fails_validation():
    doc = patched()[("Deployment", "pdserve-decode")]
    doc["spec"]["template"]["spec"]["hostNetwrok"] = True
    with pytest.raises(kv.ValidationError):
        kv.validate(doc, VERSIONS[0], strict=True)


def test_both_tiers_take_nixl_and_ucx_may_use_rdma():
    config = patched()[("ConfigMap", "pdserve-config")]["data"]
    assert config["PDSERVE_KV_TRANSPORT"] == "nixl"
    for role in WORKERS:  # the flag's own parser accepts every PDSERVE_* value (a bad one is an EnvError)
        args = parse_args(build_parser(), [role], {k: v for k, v in config.items() if k.startswith("PDSERVE_")})
        assert args.kv_transport == "nixl"
    assert "rc" in config["UCX_TLS"].split(",") and config["UCX_NET_DEVICES"]


@pytest.mark.parametrize("role", WORKERS)
def test_each_worker_pod_has_an_rdma_device_and_the_hosts_network(role):
    spec = pod(role)
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    container = spec["containers"][0]
    assert container["name"] == role and container["image"].endswith("-cuda")
    assert container["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1  # the base's limits are kept
    assert {"configMapRef": {"name": "pdserve-config"}} in container["envFrom"]
    term, = spec["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"  # host ports: one pod of a role per node
    assert term["labelSelector"]["matchLabels"] == {"app.kubernetes.io/component": role}


def test_the_cuda_image_carries_the_nixl_extra():
    pin, = pyproject()["project"]["optional-dependencies"]["nixl"]
    assert any(f'"{pin}"' in run for run in instructions("cuda", "RUN"))
