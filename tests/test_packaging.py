"""One torch/CUDA story across what installs pdserve: scripts/setup.sh (and so CI), both images, the README and
pyproject.toml; the CUDA image installs the `gpu` extra as pinned; the compose file says it needs Compose v2 where it is
used; the license is one, in pyproject and in LICENSE.

The CPU build (setup.sh, CI, the CPU image) is the torch the CPU suite runs on; the GPU build is torch 2.11 + CUDA 13,
the one the GPU kernels' pins (FlashInfer, DeepGEMM's compiled extension) are made for."""

from __future__ import annotations

import io
import re

import pytest
from dockerfile_parse import DockerfileParser

from stack import REPO

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

DOCKER = REPO / "deploy" / "docker"


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def dockerfile(kind: str) -> DockerfileParser:
    return DockerfileParser(fileobj=io.BytesIO((DOCKER / f"Dockerfile.{kind}").read_bytes()))


def readme() -> str:
    """README.md with its line breaks as spaces (a phrase may wrap)."""
    return " ".join((REPO / "README.md").read_text().split())


def runs(kind: str) -> str:
    return " ".join(i["value"] for i in dockerfile(kind).structure if i["instruction"] == "RUN")


def cpu_torch_of_setup() -> str:
    text = (REPO / "scripts" / "setup.sh").read_text()
    (version,) = re.findall(r"^TORCH_CPU_VERSION=(\S+)$", text, re.M)
    assert text.count('"torch==$TORCH_CPU_VERSION"') == 2, "both of setup.sh's installs take the one pin"
    assert "torch==" not in text.replace("torch==$TORCH_CPU_VERSION", ""), "a second torch pin in setup.sh"
    return version


def gpu_build() -> tuple[str, str]:
    """(torch version, CUDA version) of the CUDA image's base."""
    base = dockerfile("cuda").baseimage
    match = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda(\d+\.\d+)-cudnn\d+-devel", base)
    assert match, f"{base}: expected an official pytorch/pytorch ...-devel image (DeepGEMM compiles with nvcc)"
    return match.group(1), match.group(2)


def test_the_cpu_torch_is_one_pin_in_setup_and_the_cpu_image():
    version = cpu_torch_of_setup()
    args = [a.split("=", 1)[1] for a in (i["value"] for i in dockerfile("cpu").structure if i["instruction"] == "ARG")
            if a.startswith("TORCH_VERSION=")]
    assert args == [version], f"Dockerfile.cpu installs torch {args}, setup.sh {version}"
    assert "download.pytorch.org/whl/cpu" in runs("cpu") and "torch==${TORCH_VERSION}" in runs("cpu")
    assert f"the CPU build of torch {version}" in readme()  # what setup.sh installs
    assert f"torch {version}, CPU build" in readme()  # the CPU image's line in Deploying


def test_the_gpu_build_is_one_story_in_the_readme_pyproject_the_cuda_image_and_the_kernel_pins():
    torch_version, cuda = gpu_build()
    major_minor, cuda_major, tag = ".".join(torch_version.split(".")[:2]), cuda.split(".")[0], cuda.replace(".", "")
    assert (major_minor, cuda_major) == ("2.11", "13"), "the GPU machines run torch 2.11 + CUDA 13"
    text = readme()
    gpu_section = text[text.index("**On a GPU**"):text.index("## Serving")]
    assert f"torch {major_minor} + CUDA {cuda_major} (cu{tag})" in gpu_section
    assert f"torch=={torch_version} --index-url https://download.pytorch.org/whl/cu{tag}" in gpu_section
    assert f"torch {major_minor} + CUDA {cuda}" in text  # the CUDA image's line in Deploying
    text = (REPO / "pyproject.toml").read_text()
    assert f"torch {major_minor} + CUDA {cuda_major} ({torch_version}+cu{tag}" in text
    from pdserve.kernels.deep_gemm_ops import BUILT_FOR, PINNED, PINNED_BUILD

    assert f"({torch_version}+cu{tag})" in BUILT_FOR[PINNED_BUILD]
    assert PINNED in pyproject()["project"]["optional-dependencies"]["gpu"]


def test_the_torch_requirement_admits_both_builds():
    (req,) = [r for r in pyproject()["project"]["dependencies"] if r.startswith("torch")]
    floor = tuple(int(x) for x in re.fullmatch(r"torch>=(\d+)\.(\d+)", req).groups())
    for version in (cpu_torch_of_setup(), gpu_build()[0]):
        assert tuple(int(x) for x in version.split(".")[:2]) >= floor, (req, version)


def test_the_cuda_image_installs_the_gpu_extra_as_pinned():
    """What `pip install 'pdserve[gpu]'` installs, DeepGEMM included, and FlashInfer's prebuilt kernels of the same
    version."""
    installed = runs("cuda")
    for requirement in pyproject()["project"]["optional-dependencies"]["gpu"]:
        assert f'"{requirement}"' in installed, f"Dockerfile.cuda does not install {requirement}"
    (flashinfer,) = re.findall(r'"flashinfer-python==([^"]+)"', installed)
    assert f'"flashinfer-cubin=={flashinfer}"' in installed
    assert "sgl-deep-gemm" not in runs("cpu") and "flashinfer" not in runs("cpu")


def test_the_compose_file_says_it_needs_compose_v2_where_it_is_used():
    compose = (REPO / "deploy" / "compose" / "docker-compose.yml").read_text()
    assert re.search(r"^name: ", compose, re.M), "no top-level name: this test's reason is gone"
    header = compose[:compose.index("\nname:")]
    assert "Compose v2" in header and "docker-compose 1.x" in header
    text = readme()
    assert "Compose v2" in text[text.index("**docker compose**"):text.index("**Kubernetes**")]


def test_one_license():
    project = pyproject()["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    for kind in ("cpu", "cuda"):  # `pip install .` in the image reads it (license-files)
        copies = [i["value"].split() for i in dockerfile(kind).structure if i["instruction"] == "COPY"]
        assert any("LICENSE" in c[:-1] for c in copies), f"Dockerfile.{kind} does not copy LICENSE"
        assert "!LICENSE" in (DOCKER / f"Dockerfile.{kind}.dockerignore").read_text().splitlines()
