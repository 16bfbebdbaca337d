"""deploy/compose, checked without a Docker engine: the file validates against the Compose specification
(compose-spec, after compose's own interpolation and YAML merge keys), workers scale (no fixed ports, discovery
through Redis), the CPU profile is the default and the GPU one requests devices, and images, ports and mounts agree
with the Dockerfiles and the Prometheus config."""

from __future__ import annotations

import copy
import functools
import re

import pytest
import yaml
from compose_spec import PyCompose

from pdserve.cli import build_parser
from pdserve.cli.env import known_variables

from stack import REPO
from test_deploy_images import entrypoint_default, exposed_ports, image_tag

COMPOSE_DIR = REPO / "deploy" / "compose"
WORKERS = {"prefill": "cpu", "decode": "cpu", "prefill-gpu": "gpu", "decode-gpu": "gpu"}
PDSERVE_SERVICES = ("model-init", "router", *WORKERS)
VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def interpolate(text: str) -> str:
    """What `docker compose config` does with no variables set: every ${VAR:-default} becomes its default."""
    return VARIABLE.sub(lambda m: m.group(2) or "", text).replace("$$", "$")


@functools.cache  # read-only: a test that edits the project edits a deep copy
def compose() -> dict:
    return yaml.safe_load(interpolate((COMPOSE_DIR / "docker-compose.yml").read_text()))  # resolves << merges


def validate(project: dict) -> None:
    # Field names and types, as the Compose specification has them. Re-dumped YAML (merge keys resolved) keeps the
    # failing field's path in the message.
    spec = PyCompose.from_yaml(yaml.safe_dump(project, sort_keys=False))
    spec.validate()  # references: networks, volumes, configs, secrets used are defined
    spec.to_spec()


def env(service: str) -> dict[str, str]:
    return {k: str(v) for k, v in compose()["services"][service].get("environment", {}).items()}


def flag_default(command: str, flag: str):
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    return next(a.default for a in sub._actions if flag in a.option_strings)


def role_ports() -> dict[str, dict[str, int]]:
    """{role: {PDSERVE_PORT: .., PDSERVE_METRICS_PORT: .., ...}}: the ports compose gives each role."""
    return {role: {k: int(v) for k, v in env(role).items() if k.endswith("_PORT")}
            for role in ("router", "prefill", "decode")}


def test_validates_against_the_compose_specification():
    validate(compose())


@pytest.mark.parametrize("break_it, says", [
    (lambda p: p["services"]["router"].update(imagee="pdserve"), "imagee"),
    (lambda p: p["services"]["decode"].update(stop_grace_period="soon"), "stop_grace_period"),
    (lambda p: p["services"]["router"].update(ports=[{"target": "grpc"}]), "ports"),
    (lambda p: p["services"]["router"].update(networks=["backend"]), "backend"),
])
def test_the_validator_rejects_what_compose_would(break_it, says):
    """The check above means something: a misspelt key, a wrong type or an undefined network fails it."""
    project = copy.deepcopy(compose())
    break_it(project)
    with pytest.raises(ValueError, match=says):
        validate(project)


def test_every_variable_has_a_default():
    text = (COMPOSE_DIR / "docker-compose.yml").read_text()
    for m in VARIABLE.finditer(text):
        assert m.group(2), f"${{{m.group(1)}}} has no default: `docker compose up` would need it set"
    assert "$" not in interpolate(text).replace("$$", "")


def test_services_and_profiles():
    services = compose()["services"]
    assert {"redis", "router", "prefill", "decode", "prometheus", "grafana"} <= set(services)
    for name in ("redis", "model-init", "router", "prometheus", "grafana"):
        assert "profiles" not in services[name], f"{name} must run in every profile"
    for name, profile in WORKERS.items():
        assert services[name]["profiles"] == [profile]
    assert "COMPOSE_PROFILES=cpu" in (COMPOSE_DIR / ".env").read_text().splitlines()  # CPU is the default
    for name, profile in WORKERS.items():
        devices = services[name].get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
        if profile == "gpu":
            assert devices and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
            assert services[name]["environment"]["PDSERVE_DEVICE"] == "cuda"
        else:
            assert devices is None


def test_workers_scale_and_find_each_other_through_redis():
    services = compose()["services"]
    for name in WORKERS:
        s = services[name]
        for fixed in ("ports", "container_name", "hostname"):
            assert fixed not in s, f"{name}: `{fixed}` would collide under --scale"
        assert s["environment"]["PDSERVE_REDIS_URL"] == "redis://redis:6379/0"
        assert s["environment"]["PDSERVE_HOST"] == "0.0.0.0"
        assert "PDSERVE_ADVERTISE_HOST" not in s["environment"]  # the entrypoint uses each replica's own IP
        assert s["depends_on"]["redis"]["condition"] == "service_healthy"
        assert s["depends_on"]["model-init"]["condition"] == "service_completed_successfully"
    assert services["router"]["environment"]["PDSERVE_REDIS_URL"] == "redis://redis:6379/0"
    # The GPU workers answer to the CPU workers' DNS names, which is what Prometheus looks up.
    for name in ("prefill", "decode"):
        assert services[f"{name}-gpu"]["networks"]["default"]["aliases"] == [name]


def test_the_demo_model_is_put_in_the_volume_at_start():
    services = compose()["services"]
    assert services["model-init"]["command"] == ["init-model"]
    # What entrypoint.sh init-model copies from the image when PDSERVE_MODEL is unset (test_deploy_images runs it).
    demo = f"{entrypoint_default('MODELS_VOLUME')}/tiny-trained"
    assert {env(name)["PDSERVE_MODEL"] for name in PDSERVE_SERVICES} == {demo}
    mounts = {name: services[name]["volumes"] for name in PDSERVE_SERVICES}
    assert all(any(v.split(":")[:2] == ["models", "/models"] for v in vols) for vols in mounts.values())


def test_images_ports_and_variables_agree_with_the_dockerfiles():
    services = compose()["services"]
    known = known_variables(build_parser())
    for name in PDSERVE_SERVICES:
        s = services[name]
        kind = "cuda" if name.endswith("-gpu") else "cpu"
        assert s["image"] == image_tag(kind)
        if "build" in s:
            assert s["build"]["dockerfile"] == f"deploy/docker/Dockerfile.{kind}"
            assert (COMPOSE_DIR / s["build"]["context"] / s["build"]["dockerfile"]).is_file()
        variables = {k for k in s.get("environment", {}) if k.startswith("PDSERVE_")}
        assert variables <= known, f"{name}: no pdserve flag reads {variables - known}"
        ports = {int(v) for k, v in s.get("environment", {}).items() if k.endswith("_PORT")}
        assert ports <= exposed_ports(kind), f"{name}: ports {ports - exposed_ports(kind)} are not EXPOSEd"
    assert any(s.get("build") for s in services.values() if s.get("image") == image_tag("cpu"))
    assert any(s.get("build") for s in services.values() if s.get("image") == image_tag("cuda"))
    router = role_ports()["router"]
    published = {tuple(map(int, p.split(":"))) for p in services["router"]["ports"]}
    assert published == {(router["PDSERVE_PORT"],) * 2, (router["PDSERVE_HTTP_PORT"],) * 2}
    for name in ("prefill", "decode"):  # the GPU workers listen where the CPU ones do
        assert {k: v for k, v in env(f"{name}-gpu").items() if k.endswith("_PORT")} == \
            {k: v for k, v in env(name).items() if k.endswith("_PORT")}


def test_prometheus_scrapes_each_role_on_its_metrics_port():
    services = compose()["services"]
    config = yaml.safe_load((REPO / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    ports = role_ports()
    assert jobs["router"]["static_configs"][0]["targets"] == [f"router:{ports['router']['PDSERVE_METRICS_PORT']}"]
    for role in ("prefill", "decode"):  # every replica, by compose DNS: no static worker targets
        sd = jobs[role]["dns_sd_configs"][0]
        assert "static_configs" not in jobs[role]
        assert (sd["names"], sd["type"], sd["port"]) == ([role], "A", ports[role]["PDSERVE_METRICS_PORT"])
        assert role in services
    mounts = {v.split(":")[1]: v.split(":")[0] for v in services["prometheus"]["volumes"]}
    assert (COMPOSE_DIR / mounts["/etc/prometheus"] / "prometheus.yml").is_file()


def test_grafana_is_provisioned_from_the_repository():
    grafana = compose()["services"]["grafana"]
    mounts = {v.split(":")[1]: COMPOSE_DIR / v.split(":")[0] for v in grafana["volumes"]}
    provisioning = mounts["/etc/grafana/provisioning"]
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090" and datasource["type"] == "prometheus"
    provider = yaml.safe_load((provisioning / "dashboards" / "pdserve.yml").read_text())["providers"][0]
    dashboards = mounts[provider["options"]["path"]]
    assert (dashboards / "pdserve.json").is_file()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == provider["options"]["path"] + "/pdserve.json"


def test_stop_grace_covers_the_drain():
    """`docker compose stop` sends SIGTERM, then SIGKILL after stop_grace_period: it must outlast the drain
    (--drain-timeout, requests in flight finish) with 10 s to spare for stopping the engine and leaving Redis."""
    services = compose()["services"]
    for name in ("router", *WORKERS):
        command = services[name]["command"][0]
        drain = float(env(name).get("PDSERVE_DRAIN_TIMEOUT", flag_default(command, "--drain-timeout")))
        grace = services[name]["stop_grace_period"]
        assert grace.endswith("s") and float(grace[:-1]) >= drain + 10, f"{name}: {grace} for a {drain} s drain"
