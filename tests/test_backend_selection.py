"""--attention-backend / --moe-backend on the CPU: `auto` picks what runs here, a GPU backend asked for on a machine
that cannot run it fails with what is missing, and the role decides `auto` where it matters (a decode engine under
CUDA graphs prefers our Triton MLA kernel, since FlashInfer re-plans on the host before every graphed step; a prefill
worker keeps FlashInfer and captures no decode graphs)."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser, engine_config_from_args
from pdserve.kernels import backends


def test_auto_on_the_cpu_is_torch():
    assert backends.resolve_backends("auto", "auto", "cpu") == ("torch", "torch", "torch")
    assert backends.resolve_backends("auto", "auto", "cpu", graphed_decode=True) == ("torch", "torch", "torch")


@pytest.mark.parametrize("kind, name, message", [
    ("attention", "flashinfer", "--attention-backend flashinfer needs a CUDA GPU"),
    ("attention", "triton", "--attention-backend triton needs"),
    ("moe", "triton", "--moe-backend triton needs"),
])
def test_a_gpu_backend_on_the_cpu_says_what_is_missing(kind, name, message, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=message):
        backends.validate_backend(kind, name, "cpu")


def test_an_unknown_backend_lists_the_choices():
    with pytest.raises((KeyError, ValueError), match="torch"):
        backends.validate_backend("attention", "flash-attn", "cpu")


@pytest.fixture
def gpu_with_everything(monkeypatch):
    """A CUDA machine where flashinfer, triton and deep_gemm all work (what `auto` chooses among)."""
    monkeypatch.setattr(backends, "available_backends",
                        lambda kind, device: list(backends.PREFERENCE[kind]))
    monkeypatch.setattr(backends, "_has_cuda", lambda device: True)


def test_auto_prefers_triton_attention_only_for_graphed_decoding(gpu_with_everything):
    assert backends.resolve_backends("auto", "auto", "cuda", graphed_decode=True) == ("triton", "deep_gemm",
                                                                                       "deep_gemm")
    assert backends.resolve_backends("auto", "auto", "cuda", graphed_decode=False)[0] == "flashinfer"


def test_the_role_steers_graphs_and_auto(gpu_with_everything, tmp_path):
    (tmp_path / "config.json").write_text("{}")  # a model directory by its looks: nothing is loaded here

    def config(*flags, prefill_only=False):
        args = build_parser().parse_args(["generate", "--model", str(tmp_path), "--device", "cuda", *flags])
        return engine_config_from_args(args, prefill_only=prefill_only)

    decode = config()
    assert (decode.attention_backend, decode.cuda_graph.enabled) == ("triton", True)
    eager = config("--disable-cuda-graph")
    assert (eager.attention_backend, eager.cuda_graph.enabled) == ("flashinfer", False)
    prefill = config(prefill_only=True)
    assert (prefill.attention_backend, prefill.cuda_graph.enabled) == ("flashinfer", False)
    assert config("--disable-cuda-graph", "--attention-backend", "triton").attention_backend == "triton"  # asked for


# ---- deep_gemm: chosen by `auto` only where its probe passes, refused with the probe's reason when asked for -----

MISMATCH = ("sgl-deep-gemm 0.1.4.post1 does not load with this torch (2.13.0+cu130): it is built for torch 2.11 "
            "with CUDA 13 (2.11.0+cu130). Install the build made for this torch.")


@pytest.fixture
def gpu_with_deep_gemm_installed(monkeypatch):
    """A CUDA machine with every package installed, deep_gemm registered as where its package is; each test sets
    the probe's answer (deep_gemm_ops.unusable_reason runs a child process on real machines)."""
    from pdserve.kernels import GEMM_BACKENDS, MOE_BACKENDS
    from pdserve.kernels.deep_gemm_dense import DeepGemmGemm
    from pdserve.kernels.deep_gemm_moe import DeepGemmMoE

    for registry, cls in ((MOE_BACKENDS, DeepGemmMoE), (GEMM_BACKENDS, DeepGemmGemm)):
        monkeypatch.setattr(registry, "_entries", {**registry._entries, "deep_gemm": cls})
    monkeypatch.setattr(backends, "_has_cuda", lambda device: True)
    monkeypatch.setattr(backends, "_package_imports", lambda name: True)

    def probe_says(reason):
        monkeypatch.setattr(backends.deep_gemm_ops, "unusable_reason", lambda: reason)

    return probe_says


def test_auto_picks_deep_gemm_for_moe_and_dense_where_the_probe_passes(gpu_with_deep_gemm_installed):
    gpu_with_deep_gemm_installed(None)
    assert backends.resolve_backends("auto", "auto", "cuda")[1:] == ("deep_gemm", "deep_gemm")
    # The torch MoE reference keeps the torch dense GEMM unless one is asked for.
    assert backends.resolve_backends("auto", "torch", "cuda")[1:] == ("torch", "torch")
    assert backends.resolve_backends("auto", "triton", "cuda", gemm="scaled_mm")[1:] == ("triton", "scaled_mm")


def test_auto_keeps_the_current_choices_where_the_probe_fails(gpu_with_deep_gemm_installed):
    gpu_with_deep_gemm_installed(MISMATCH)
    assert backends.resolve_backends("auto", "auto", "cuda")[1:] == ("triton", "scaled_mm")
    assert "deep_gemm" not in backends.available_backends("moe", "cuda")


@pytest.mark.parametrize("kind", ["moe", "gemm"])
def test_deep_gemm_asked_for_where_it_cannot_run_says_why(gpu_with_deep_gemm_installed, kind):
    gpu_with_deep_gemm_installed(MISMATCH)
    with pytest.raises(ValueError, match=rf"--{kind}-backend deep_gemm cannot run here: .*built for torch 2\.11"):
        backends.resolve_backends("auto", "deep_gemm" if kind == "moe" else "auto", "cuda",
                                  gemm="deep_gemm" if kind == "gemm" else "auto")


def test_cli_exits_2_with_the_reason(gpu_with_deep_gemm_installed, tmp_path, capsys):
    from pdserve.cli import main

    gpu_with_deep_gemm_installed(MISMATCH)
    (tmp_path / "config.json").write_text("{}")  # refused before the model would load
    code = main(["generate", "--model", str(tmp_path), "--device", "cuda", "--input-ids", "1,2",
                 "--moe-backend", "deep_gemm"])
    err = capsys.readouterr().err
    assert code == 2 and "--moe-backend deep_gemm cannot run here" in err and "torch 2.11" in err, err


def test_deep_gemm_without_the_package_names_the_install(monkeypatch):
    monkeypatch.setattr(backends, "_has_cuda", lambda device: True)
    monkeypatch.setattr(backends, "_package_imports", lambda name: name != "deep_gemm")
    with pytest.raises(ValueError, match=r"needs the deep_gemm package \(pip install 'pdserve\[gpu\]'"):
        backends.validate_backend("moe", "deep_gemm", "cuda")
