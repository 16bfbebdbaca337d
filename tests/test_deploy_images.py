"""The container images, checked without a Docker engine: both Dockerfiles parse (dockerfile-parse), run as a
non-root user, health-check through `pdserve healthcheck`, copy what pyproject installs, pin what pyproject pins;
the entrypoint script runs for real against a stand-in `pdserve`."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

from pdserve.cli import build_parser
from pdserve.cli.env import known_variables

from stack import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

DOCKER = REPO / "deploy" / "docker"
KINDS = ("cpu", "cuda")


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def dockerfile(kind: str) -> DockerfileParser:
    # An in-memory file: the parser re-reads its file object on every property.
    return DockerfileParser(fileobj=io.BytesIO((DOCKER / f"Dockerfile.{kind}").read_bytes()))


def instructions(kind: str, name: str) -> list[str]:
    return [i["value"] for i in dockerfile(kind).structure if i["instruction"] == name]


def image_tag(kind: str) -> str:
    """The tag compose and Kubernetes must use for this Dockerfile's image."""
    return f"pdserve:{pyproject()['project']['version']}-{kind}"


def exposed_ports(kind: str) -> set[int]:
    return {int(p.split("/")[0]) for value in instructions(kind, "EXPOSE") for p in value.split()}


def user_id(kind: str) -> int:
    return int(instructions(kind, "USER")[-1].split(":")[0])


@pytest.mark.parametrize("kind", KINDS)
def test_runs_as_a_non_root_user_created_in_the_image(kind):
    users = instructions(kind, "USER")
    assert users, "no USER: the container would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {users[-1]} must be a numeric non-root uid (Kubernetes' " \
                                            "runAsNonRoot cannot check a name)"
    assert any(f"--uid {uid}" in run for run in instructions(kind, "RUN")), "the user is not created"
    structure = [i["instruction"] for i in dockerfile(kind).structure]
    assert "RUN" not in structure[structure.index("USER"):], "RUN after USER: installs would run as the user"


@pytest.mark.parametrize("kind", KINDS)
def test_health_check_entrypoint_and_role_by_command(kind):
    health = instructions(kind, "HEALTHCHECK")
    assert len(health) == 1 and health[0].endswith('CMD ["pdserve", "healthcheck"]')
    assert "--start-period=" in health[0]  # model loading is not a failure
    assert json.loads(instructions(kind, "ENTRYPOINT")[0]) == ["pdserve-entrypoint"]
    assert json.loads(instructions(kind, "CMD")[0]) == ["router"]
    # The HEALTHCHECK has no --target: `pdserve healthcheck` checks 127.0.0.1:$PDSERVE_PORT, set for every role.
    envs = dockerfile(kind).envs
    assert envs["PDSERVE_HOST"] == "0.0.0.0" and envs["PDSERVE_PORT"].isdigit()
    pdserve_vars = {k for k in envs if k.startswith("PDSERVE_")}
    assert pdserve_vars <= known_variables(build_parser()), pdserve_vars - known_variables(build_parser())


def test_bases_are_official():
    """Which torch each image runs (the CPU build setup.sh installs; torch 2.11 + CUDA 13) is test_packaging's."""
    cpu, cuda = dockerfile("cpu").baseimage, dockerfile("cuda").baseimage
    assert re.fullmatch(r"python:3\.1[0-9]-slim", cpu), cpu
    assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda[\d.]+-cudnn\d+-devel", cuda), cuda


def test_cuda_image_installs_flashinfer_at_the_pinned_version():
    pin = next(r for r in pyproject()["project"]["optional-dependencies"]["gpu"] if r.startswith("flashinfer-python"))
    assert pin == "flashinfer-python==0.5.3"
    runs = " ".join(instructions("cuda", "RUN"))
    assert f'"{pin}"' in runs and '"flashinfer-cubin==0.5.3"' in runs  # prebuilt: no compile at the first requests
    assert "flashinfer" not in " ".join(instructions("cpu", "RUN"))


@pytest.mark.parametrize("kind", KINDS)
def test_copies_every_installed_package_and_the_ignore_file_lets_them_in(kind):
    sources = []
    for value in instructions(kind, "COPY"):
        parts = [p for p in value.split() if not p.startswith("--")]
        sources += parts[:-1]
    for src in sources:
        assert (REPO / src).exists(), f"COPY {src}: not in the repository"
    package_dirs = set(pyproject()["tool"]["setuptools"]["package-dir"].values())
    assert package_dirs <= set(sources), f"not copied: {package_dirs - set(sources)}"
    assert {"pyproject.toml", "README.md", "deploy/docker/entrypoint.sh"} <= set(sources)
    ignore = (DOCKER / f"Dockerfile.{kind}.dockerignore").read_text().splitlines()
    let_in = {line[1:].removesuffix("/**") for line in ignore if line.startswith("!")}
    assert set(sources) <= let_in, f"excluded from the build context: {set(sources) - let_in}"


@pytest.mark.parametrize("kind", KINDS)
def test_version_label_matches_pyproject(kind):
    assert dockerfile(kind).labels["org.opencontainers.image.version"] == pyproject()["project"]["version"]
    assert f"-t {image_tag(kind)} " in dockerfile(kind).content  # the build command in its header


# ---- the entrypoint, run for real ------------------------------------------------------------------------------
def entrypoint_default(name: str) -> str:
    """The default the entrypoint gives NAME (`NAME=${NAME:-value}`): what it uses inside the image."""
    match = re.search(rf"^{name}=\$\{{{name}:-([^}}]+)\}}$", (DOCKER / "entrypoint.sh").read_text(), re.M)
    assert match, f"entrypoint.sh sets no default for {name}"
    return match.group(1)


@pytest.mark.parametrize("kind", KINDS)
def test_images_carry_the_demo_checkpoint_where_the_entrypoint_looks(kind, trained_model_dir):
    copies = [v.split() for v in instructions(kind, "COPY") if "models/tiny-trained" in v.split()]
    assert len(copies) == 1, "the image must carry models/tiny-trained for `init-model`"
    *flags, src, dest = copies[0]
    assert REPO / src == trained_model_dir and dest == entrypoint_default("BUNDLED_MODEL")
    assert not any(f.startswith("--chown") for f in flags), "the user must not be able to change the bundled model"
    modes = [int(f.split("=", 1)[1], 8) for f in flags if f.startswith("--chmod=")]
    # --chmod sets files and directories alike: others (the user) must read and traverse, never write.
    assert modes and modes[0] & 0o005 == 0o005 and not modes[0] & 0o022, [oct(m) for m in modes]
    assert json.loads(instructions(kind, "VOLUME")[0]) == [entrypoint_default("MODELS_VOLUME")]


@pytest.fixture
def run_entrypoint(tmp_path):
    """Runs deploy/docker/entrypoint.sh with a stand-in `pdserve` that prints its arguments and PDSERVE_* env."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "pdserve"
    stub.write_text("#!/bin/sh\necho \"args=$*\"\nenv | grep '^PDSERVE_' | sort\n")
    stub.chmod(0o755)
    python_dir = Path(sys.executable).parent

    def run(*args, expect_rc: int = 0, **env) -> dict:
        base = {k: v for k, v in os.environ.items()
                if not k.startswith("PDSERVE_") and k not in ("MODELS_VOLUME", "BUNDLED_MODEL")}
        out = subprocess.run(["sh", str(DOCKER / "entrypoint.sh"), *args], capture_output=True, text=True,
                             env={**base, **env, "PATH": f"{bin_dir}:{python_dir}:/usr/bin:/bin"}, timeout=30)
        assert out.returncode == expect_rc, out.stderr
        lines = out.stdout.splitlines()
        return dict(line.split("=", 1) for line in lines if "=" in line)

    return run


def test_entrypoint_syntax():
    sh = shutil.which("sh")
    assert subprocess.run([sh, "-n", str(DOCKER / "entrypoint.sh")]).returncode == 0
    assert os.access(DOCKER / "entrypoint.sh", os.X_OK)


def test_entrypoint_advertises_the_container_ip_unless_told(run_entrypoint):
    got = run_entrypoint("decode", "--num-pages", "64")
    assert got["args"] == "decode --num-pages 64"
    assert re.fullmatch(r"\d+\.\d+\.\d+\.\d+", got["PDSERVE_ADVERTISE_HOST"]) and \
        got["PDSERVE_ADVERTISE_HOST"] != "0.0.0.0"
    assert got["PDSERVE_KV_HOST"] == got["PDSERVE_ADVERTISE_HOST"]  # the KV endpoint peers dial
    got = run_entrypoint("prefill", PDSERVE_ADVERTISE_HOST="10.1.2.3")  # Kubernetes: the pod IP
    assert (got["PDSERVE_ADVERTISE_HOST"], got["PDSERVE_KV_HOST"]) == ("10.1.2.3", "10.1.2.3")
    got = run_entrypoint("decode", PDSERVE_ADVERTISE_HOST="10.1.2.3", PDSERVE_KV_HOST="10.9.9.9")
    assert got["PDSERVE_KV_HOST"] == "10.9.9.9"


# `init-model` against a temporary models volume, with the checkout's models/tiny-trained as the image's bundled copy.
@pytest.fixture
def volume(tmp_path, trained_model_dir) -> dict:
    (tmp_path / "models").mkdir()
    return {"MODELS_VOLUME": str(tmp_path / "models"), "BUNDLED_MODEL": str(trained_model_dir)}


def files(directory: Path) -> dict[str, bytes]:
    return {str(f.relative_to(directory)): f.read_bytes() for f in sorted(directory.rglob("*")) if f.is_file()}


def test_init_model_copies_the_bundled_demo_model_by_default(run_entrypoint, volume, trained_model_dir):
    models = Path(volume["MODELS_VOLUME"])
    (models / "tiny-trained.partial").mkdir()  # a copy cut short by an earlier run
    (models / "tiny-trained.partial" / "config.json").write_text("{}")
    assert "args" not in run_entrypoint("init-model", **volume)  # no pdserve command: a copy
    assert files(models / "tiny-trained") == files(trained_model_dir)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files(models / "tiny-trained"))
    assert sorted(p.name for p in models.iterdir()) == ["tiny-trained"]  # nothing partial left behind
    # An empty directory (a fresh mount point) is filled too, and naming the default explicitly is the same.
    shutil.rmtree(models / "tiny-trained")
    (models / "tiny-trained").mkdir()
    run_entrypoint("init-model", PDSERVE_MODEL=str(models / "tiny-trained"), **volume)
    assert files(models / "tiny-trained") == files(trained_model_dir)


def test_init_model_never_overwrites_what_is_in_the_volume(run_entrypoint, volume):
    target = Path(volume["MODELS_VOLUME"]) / "tiny-trained"
    target.mkdir()
    (target / "config.json").write_text('{"mine": true}')  # a checkpoint someone put there
    run_entrypoint("init-model", **volume)
    assert files(target) == {"config.json": b'{"mine": true}'}
    (target / "config.json").unlink()  # not a checkpoint, but not empty either: refused, left as it is
    (target / "notes.txt").write_text("keep")
    run_entrypoint("init-model", expect_rc=1, **volume)
    assert files(target) == {"notes.txt": b"keep"}


def test_init_model_makes_the_random_tiny_model_only_when_named(run_entrypoint, volume):
    models = Path(volume["MODELS_VOLUME"])
    random_model = models / "tiny-deepseek-v3"
    got = run_entrypoint("init-model", PDSERVE_MODEL=str(random_model), **volume)
    assert got["args"] == f"make-tiny-model {random_model}"
    assert list(models.iterdir()) == []  # the demo model is not copied when another is asked for
    random_model.mkdir()
    (random_model / "config.json").write_text("{}")
    assert "args" not in run_entrypoint("init-model", PDSERVE_MODEL=str(random_model), **volume)  # already there
    # Any other model must already be in the volume: init-model neither makes nor copies it.
    assert "args" not in run_entrypoint("init-model", PDSERVE_MODEL=str(models / "DeepSeek-V3"), **volume)
    assert sorted(p.name for p in models.iterdir()) == ["tiny-deepseek-v3"]


def test_init_model_fails_when_the_image_lacks_the_bundled_model(run_entrypoint, volume, tmp_path):
    """Workers must not start on nothing: model-init fails, so compose never starts them."""
    run_entrypoint("init-model", expect_rc=1, **{**volume, "BUNDLED_MODEL": str(tmp_path / "absent")})
    assert list(Path(volume["MODELS_VOLUME"]).iterdir()) == []
