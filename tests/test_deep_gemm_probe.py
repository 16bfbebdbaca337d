"""deep_gemm_ops on the CPU: the probe's child process run for real against stand-in `deep_gemm` packages that fail
the way real builds do (a torch mismatch at load, a crash, missing ops), and the reason it reports for each; the op
lookup under each build's names."""

from __future__ import annotations

import textwrap

import pytest
import torch

from pdserve.kernels import deep_gemm_ops

UNDEFINED = ("ImportError: /site/deep_gemm/_C.so: undefined symbol: "
             "_ZN3c104cuda20getCurrentCUDAStreamEa")


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """Installs a stand-in `deep_gemm` (its __init__ given by the test) as sgl-deep-gemm 0.1.4.post1, on a machine
    that claims a Hopper GPU; returns the probe's answer."""
    def install(init_source: str, version: str = "0.1.4.post1") -> str | None:
        pkg = tmp_path / "deep_gemm"
        pkg.mkdir()
        (pkg / "__init__.py").write_text(textwrap.dedent(init_source))
        meta = tmp_path / f"sgl_deep_gemm-{version}.dist-info"
        meta.mkdir()
        (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sgl-deep-gemm\nVersion: {version}\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the probe's child process
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
        deep_gemm_ops.unusable_reason.cache_clear()
        try:
            return deep_gemm_ops.unusable_reason()
        finally:
            deep_gemm_ops.unusable_reason.cache_clear()

    return install


def test_a_build_for_another_torch_is_reported_plainly(fake_build):
    reason = fake_build(f"raise ImportError({UNDEFINED.split(': ', 1)[1]!r})")
    assert reason.startswith(f"sgl-deep-gemm 0.1.4.post1 does not load with this torch ({torch.__version__})")
    assert "it is built for torch 2.11 with CUDA 13" in reason and "undefined symbol" in reason


def test_an_unknown_build_names_the_pinned_one(fake_build):
    reason = fake_build("raise OSError('libcudart.so.12: cannot open shared object file')", version="0.2.5")
    assert "sgl-deep-gemm 0.2.5 does not load" in reason and deep_gemm_ops.PINNED in reason


def test_a_crash_at_import_is_caught_in_the_child(fake_build):
    reason = fake_build("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    assert "crashed (signal 11)" in reason and "built for torch 2.11" in reason


def test_a_build_without_the_masked_gemm_is_refused(fake_build):
    reason = fake_build("def fp8_gemm_nt(*a): pass\ndef m_grouped_fp8_gemm_nt_contiguous(*a): pass\n")
    assert "lacks the ops pdserve calls" in reason and "fp8_m_grouped_gemm_nt_masked" in reason


def test_not_installed(monkeypatch):
    monkeypatch.setattr(deep_gemm_ops, "installed", lambda: False)
    deep_gemm_ops.unusable_reason.cache_clear()
    try:
        assert "not installed" in deep_gemm_ops.unusable_reason()
    finally:
        deep_gemm_ops.unusable_reason.cache_clear()


class _Names:
    """A module with the given attribute names, each a distinct function."""

    def __init__(self, *names):
        for name in names:
            setattr(self, name, lambda *a, _name=name: _name)


@pytest.mark.parametrize("names,op,expected", [
    (("fp8_m_grouped_gemm_nt_masked", "m_grouped_fp8_gemm_nt_masked"), "masked", "fp8_m_grouped_gemm_nt_masked"),
    (("m_grouped_fp8_gemm_nt_masked",), "masked", "m_grouped_fp8_gemm_nt_masked"),  # upstream 2.x
    (("m_grouped_gemm_fp8_fp8_bf16_nt_masked",), "masked", "m_grouped_gemm_fp8_fp8_bf16_nt_masked"),  # 1.x
    (("gemm_fp8_fp8_bf16_nt", "fp8_gemm_nt"), "gemm", "fp8_gemm_nt"),
])
def test_ops_are_found_under_each_builds_names_newest_first(names, op, expected):
    assert deep_gemm_ops.find_op(_Names(*names), op)() == expected


def test_a_missing_op_names_what_was_looked_for():
    with pytest.raises(RuntimeError, match="m_grouped_fp8_gemm_nt_contiguous"):
        deep_gemm_ops.find_op(_Names("fp8_gemm_nt"), "contiguous")

