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
                                                                                       "scaled_mm")
    assert backends.resolve_backends("auto", "auto", "cuda", graphed_decode=False)[0] == "flashinfer"


def test_the_role_steers_graphs_and_auto(gpu_with_everything, tmp_path):
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
